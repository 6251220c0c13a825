"""Per-module-type strengths for the ``data_weighted`` arms, from the data-weighted memory-trace map.

The map's ``measure=data`` (:mod:`service.engram_maps`) gives each layer ``ρ_l = ‖E_l X_U‖_F /
‖W_l X_U‖_F``: the share of the layer's output, on the universe's inputs, that the engram takes away.
Here ``E_l`` is the unlearn request's own engram ``Σ_k E_k,l`` (every concept removed, coefficient 1),
read from the universe's stored engrams, and ``X_U`` the universe's summed statistics: cached files
only, no forward pass.

A module type's strength is the mean ``ρ_l`` of its layers, divided by the largest type's, so the
type where the concepts take the largest share of the output is edited at ``α·f_l`` and every other
less, in proportion. On mini-TOFU it did not beat Q/K+Gate (the README's calibration section).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from service.calibration.search import Arm
from service.calibration.space import arm_layers
from service.context import Context
from service.engine.checkpoint import CheckpointReader
from service.engine.compose import COMPUTE_DTYPE, augmented_weight, weighted_sum
from service.engine.errors import EditError
from service.engine.layers import LayerSpec, module_strength, module_type
from service.engine.layout import ModelLayout
from service.engine.stats_io import StatisticsFile
from service.engrams.manifest import UniverseManifest
from service.engrams.store import StoredEngrams, stored_engrams
from service.errors import JobFailed
from service.maps.build import data_weighted_ratio
from service.statistics.local import statistics

# The weakest strength a type is given: module_strengths are > 0, and three significant figures
# below this change nothing a probe can see.
STRENGTH_FLOOR = 1e-3


def data_weighted_rho(
    layers: Sequence[LayerSpec], engrams: StoredEngrams, universe: Sequence[StatisticsFile], reader: CheckpointReader
) -> dict[str, float]:
    """``‖E_l X_U‖_F / ‖W_l X_U‖_F`` per layer (the map's ``data`` measure), ``Σ_U`` summed once per
    input group and every product in float64.

    Args:
        layers: the layers to measure (those of one input group next to each other read it once).
        engrams: ``Σ_k c_k E_k`` of the universe (the coefficients' sign does not matter here).
        universe: the statistics of every member of the universe.
        reader: the model's weights.
    """
    rho: dict[str, float] = {}
    sigma: tuple[tuple[str, ...], torch.Tensor] | None = None
    for spec in layers:
        try:
            groups = tuple(stats.layer_group[spec.name] for stats in universe)
        except KeyError:
            raise EditError(f"no statistics for layer {spec.name}") from None
        if sigma is None or sigma[0] != groups:
            sigma = None  # one group's Σ_U in memory at a time
            sums = ((1.0, stats.sums[group]) for stats, group in zip(universe, groups, strict=True))
            sigma = (groups, weighted_sum(sums))
        weights = reader.layer_weights(spec)
        w = augmented_weight(spec, weights)
        engram = engrams.engram(spec, weights).to(COMPUTE_DTYPE)
        removed = float(((engram @ sigma[1]) * engram).sum())
        output = float(((w @ sigma[1]) * w).sum())
        rho[spec.name] = data_weighted_ratio(removed, output)
    return rho


def type_strengths(rho: Mapping[str, float]) -> dict[str, float]:
    """Each module type's mean ``ρ_l`` over the given layers, divided by the largest mean (3
    significant figures, at least :data:`STRENGTH_FLOOR`), keyed by the type as a suffix
    (``self_attn.q_proj``; a layer outside the blocks by its whole name).

    Raises:
        ValueError: no layer, or every ``ρ_l`` is 0 (the engram removes nothing the data reaches).
    """
    by_type: dict[str, list[float]] = {}
    for name, value in rho.items():
        by_type.setdefault(module_type(name), []).append(value)
    means = {t: sum(v) / len(v) for t, v in by_type.items()}
    top = max(means.values(), default=0.0)
    if not top > 0 or not math.isfinite(top):
        raise ValueError("the engram removes nothing from the universe's data on these layers")
    strengths = {t: max(STRENGTH_FLOOR, float(f"{m / top:.3g}")) for t, m in sorted(means.items())}
    clash = [n for n in rho if module_strength(n, strengths) != strengths[module_type(n)]]
    if clash:  # a type that is a suffix of another layer's name would give that layer the wrong factor
        raise ValueError(f"module types are not suffixes of their layers alone: {', '.join(clash[:3])}")
    return strengths


def measure_strengths(
    ctx: Context,
    universe: UniverseManifest,
    term_prefixes: Sequence[str],
    layout: ModelLayout,
    reader: CheckpointReader,
    arms: Sequence[Arm],
) -> list[Arm]:
    """The arms, each ``weighted`` one with its module types' strengths over its own layers.

    Args:
        universe: the built universe's manifest (its engrams and its members' statistics are read).
        term_prefixes: the statistics prefix of each concept removed (one per concept, as in a variant).

    Raises:
        JobFailed: a layer without engram or statistics, or an engram that removes nothing.
    """
    if not any(arm.weighted for arm in arms):
        return list(arms)
    names = {spec.name for arm in arms if arm.weighted for spec in arm_layers(layout.layers, arm)}
    terms: dict[str, float] = {}
    for prefix in term_prefixes:
        terms[prefix] = terms.get(prefix, 0.0) + 1.0
    members = [statistics(ctx, prefix) for prefix in universe.member_prefixes]
    try:
        engrams = stored_engrams(ctx, universe, terms)
        rho = data_weighted_rho([s for s in layout.layers if s.name in names], engrams, members, reader)
    except EditError as exc:
        raise JobFailed(f"the data-weighted strengths could not be measured: {exc}") from None
    measured = []
    for arm in arms:
        if arm.weighted:
            try:
                strengths = type_strengths({spec.name: rho[spec.name] for spec in arm_layers(layout.layers, arm)})
            except ValueError as exc:
                raise JobFailed(f"arm {arm.name}: {exc}") from None
            arm = dataclasses.replace(arm, strengths=tuple(strengths.items()))
        measured.append(arm)
    return measured
