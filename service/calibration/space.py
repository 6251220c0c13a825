"""The edit space a calibration searches: module sets × layer sets × scalings, on one model's layout.

A module set is named (a preset) or given as module-name suffixes. The presets sort the layers of a
block by their path inside it (:func:`~service.engine.layers.module_type`):

- ``all``: every editable layer, the head and anything else outside the blocks included;
- ``attention``: the block's attention layers (a path with ``attn`` or ``attention``);
- ``mlp``: its feed-forward layers (``mlp``, ``feed_forward``, ``ffn``, ``intermediate``, ``output``
  outside attention, ``experts``);
- ``qk_gate``: the paper's Q/K+Gate: the attention's query and key projections (a fused QKV
  projection counts, as it holds them) and the MLP's gate (or first) projection;
- ``data_weighted``: every layer, as ``all``, each module type at its own strength: the mean of the
  data-weighted memory-trace map over its layers, relative to the largest type's
  (:mod:`service.calibration.strengths`, measured by the job from cached engrams and statistics).

Each preset becomes the list of module types it selects (and ``data_weighted`` its
``module_strengths``), so the recommended variant is an ordinary unlearn request with ``modules``.
A preset that selects no layer of this model is left out (named in the result); one the request
names is a 422.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.calibration.search import Arm
from service.engine.layers import LayerSpec, module_type, select_layers, unmatched_suffixes

if TYPE_CHECKING:
    from service.engine.compose import Scaling

PRESETS = ("all", "qk_gate", "attention", "mlp", "data_weighted")
WEIGHTED = "data_weighted"  # the preset whose arms carry per-module-type strengths
SCALINGS = ("uniform", "weight_norm")

_ATTENTION_MARKS = ("attn", "attention")
_MLP_MARKS = ("mlp", "feed_forward", "ffn", "intermediate", "output", "experts")
# Last path segments of query/key projections (fused QKV ones included) and of MLP gates (or first layers).
_QUERY_KEY = {"q_proj", "k_proj", "query", "key", "q", "k", "c_attn", "qkv_proj", "query_key_value", "Wqkv", "qkv"}
_GATE = {"gate_proj", "w1", "gate_up_proj", "c_fc", "fc1", "dense_h_to_4h", "wi", "wi_0", "up_gate_proj"}


class SpaceError(ValueError):
    """The requested edit space names something this model does not have (said by name)."""


def _kind(path: str) -> str | None:
    """``attention``, ``mlp`` or None for a module type (its path inside the block)."""
    lowered = path.lower()
    if any(mark in lowered for mark in _ATTENTION_MARKS):
        return "attention"
    if any(mark in lowered for mark in _MLP_MARKS) or path.split(".")[-1] in _GATE:
        return "mlp"
    return None


def preset_modules(layers: Sequence[LayerSpec], preset: str) -> tuple[str, ...] | None:
    """The module types (suffixes) a preset selects on these layers; ``None`` for ``all``; ``()`` when none."""
    if preset in ("all", WEIGHTED):
        return None
    types = list(dict.fromkeys(module_type(spec.name) for spec in layers if spec.block is not None))
    if preset in ("attention", "mlp"):
        return tuple(t for t in types if _kind(t) == preset)
    if preset == "qk_gate":
        leaf = {t: t.split(".")[-1] for t in types}
        wanted = {"attention": _QUERY_KEY, "mlp": _GATE}
        return tuple(t for t in types if leaf[t] in wanted.get(_kind(t) or "", ()))
    raise SpaceError(f"unknown module set {preset!r}; the presets are {', '.join(PRESETS)}")


@dataclass(frozen=True)
class EditSpace:
    """The arms to search, and the presets left out because they select no layer of this model."""

    arms: tuple[Arm, ...]
    skipped: tuple[str, ...]


def edit_space(
    layers: Sequence[LayerSpec],
    module_sets: Sequence[str | Sequence[str]] | None,
    layer_sets: Sequence[Sequence[int]] | None,
    scalings: Sequence[Scaling],
) -> EditSpace:
    """The arms of a request on a model's layers.

    Args:
        layers: the model's editable layers.
        module_sets: preset names or suffix lists; ``None``: every preset that selects a layer.
        layer_sets: block-index lists; ``None``: every block (and, for ``all``, the layers outside them).
        scalings: ``uniform`` and/or ``weight_norm``.

    Raises:
        SpaceError: an unknown preset or scaling, a preset or suffix that matches no layer, a layer
            set or a module set × layer set that selects nothing, a duplicate.
    """
    bad_scalings = [s for s in scalings if s not in SCALINGS]
    if bad_scalings or not scalings:
        raise SpaceError(f"scalings must be among {', '.join(SCALINGS)}, got {list(scalings)}")
    if len(set(scalings)) != len(scalings):
        raise SpaceError(f"a scaling is listed twice: {list(scalings)}")
    named, skipped = _module_sets(layers, module_sets)
    blocks = _layer_sets(layers, layer_sets)
    arms = []
    for (name, modules, weighted), chosen in itertools.product(named, blocks):
        if not select_layers(layers, modules, chosen):
            where = "" if chosen is None else f" in blocks {list(chosen)}"
            raise SpaceError(f"module set {name} selects no layer{where}")
        arms += [Arm(name, modules, chosen, scaling, weighted) for scaling in scalings]
    return EditSpace(tuple(arms), tuple(skipped))


def _module_sets(
    layers: Sequence[LayerSpec], module_sets: Sequence[str | Sequence[str]] | None
) -> tuple[list[tuple[str, tuple[str, ...] | None, bool]], list[str]]:
    """(name, suffixes, weighted) per module set, and the default presets that select no layer."""
    requested = list(PRESETS) if module_sets is None else list(module_sets)
    named: list[tuple[str, tuple[str, ...] | None, bool]] = []
    skipped: list[str] = []
    for entry in requested:
        if isinstance(entry, str):
            modules = preset_modules(layers, entry)
            if modules == ():
                if module_sets is not None:
                    raise SpaceError(f"module set {entry} selects no layer of this model")
                skipped.append(entry)
                continue
            named.append((entry, modules, entry == WEIGHTED))
        else:
            suffixes = tuple(dict.fromkeys(entry))
            missing = unmatched_suffixes(layers, suffixes)
            if not suffixes or missing:
                raise SpaceError(f"module suffix(es) match no layer: {', '.join(missing) or '(none given)'}")
            named.append(("+".join(suffixes), suffixes, False))
    names = [n for n, _, _ in named]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SpaceError(f"module set(s) listed twice: {', '.join(twice)}")
    return named, skipped


def _layer_sets(layers: Sequence[LayerSpec], layer_sets: Sequence[Sequence[int]] | None) -> list[tuple[int, ...] | None]:
    if layer_sets is None:
        return [None]
    present = {spec.block for spec in layers if spec.block is not None}
    chosen: list[tuple[int, ...] | None] = []
    for entry in layer_sets:
        blocks = tuple(sorted(set(entry)))
        missing = [b for b in blocks if b not in present]
        if not blocks or missing:
            raise SpaceError(f"layer set {list(entry)}: no block {', '.join(map(str, missing)) or '(none given)'}")
        if blocks in chosen:
            raise SpaceError(f"layer set {list(blocks)} is listed twice")
        chosen.append(blocks)
    return chosen


def arm_layers(layers: Sequence[LayerSpec], arm: Arm) -> list[LayerSpec]:
    """The layers an arm edits."""
    return select_layers(layers, arm.modules, arm.layers)
