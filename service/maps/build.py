"""Memory-trace maps: where each concept's engram lives, by block and module type (paper Fig. 4).

For every editable layer (the head and anything else outside the blocks included), one number per
concept, of its engram ``E_l = W_l Σ_k Σ_U⁺`` (coefficient 1) relative to the universe
``reference ∪ concepts``. Two measures:

- ``data`` (the default): ``‖E_l X_U‖_F / ‖W_l X_U‖_F`` over the universe's inputs ``X_U``, i.e.
  ``sqrt(tr(E Σ_U Eᵀ) / tr(W Σ_U Wᵀ))`` with ``[W | b]`` and the augmented input for a layer with a
  bias: the share of the layer's output, on the data it sees, that the concept's engram accounts for
  (what removing the concept there takes away). It lies between 0 and 1 (``Σ_k ≤ Σ_U``), so it
  compares across layers, across concepts and across models: a concept that is a tenth of the
  universe's tokens but owns a layer's directions stands out there;
- ``weight``: the paper's W-Norm ``ρ_l = ‖E_l‖_F / ‖W_l‖_F``, which weighs every input direction
  alike, the rare ones the universe hardly sees included (it can exceed 1, and is what ``scaling:
  "weight_norm"`` scales by).

A convolution also gets its engram drawn inside the layer (``conv``: per output channel and per
kernel position, with the same measure; :mod:`service.maps.conv`).

The numbers come from cached statistics only (no forward pass), but they load weights and decompose
``Σ_U``: a ``map`` job computes them (:func:`run_map`, on a worker), and the API only checks the
request and reads the result (:mod:`service.maps.service`). A map is content-addressed by everything
that determines it and kept in storage (``maps/<map_id>.json``), so drawing it again, or as a PNG,
costs nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from service.context import Context
from service.engine.checkpoint import CheckpointReader
from service.engine.compose import LayerWeights, augmented_weight, relative_norm, weighted_sum
from service.engine.errors import EditError
from service.engine.layers import LayerSpec, module_type
from service.engine.layout import ModelLayout
from service.engine.stats_io import StatisticsFile
from service.engrams.store import statistics_algebra
from service.errors import JobFailed
from service.jobs.progress import NoProgress, Progress, ProgressReporter
from service.jobs.records import JobRecord, MapPayload
from service.jobs.results import MapResult
from service.maps.conv import conv_breakdown
from service.maps.document import ConceptGrid, ConvBreakdown, LeftOut, MapDocument
from service.maps.service import MapRequest, find_map, map_request
from service.models.loaded import checked_model_files
from service.models.record import ModelRecord
from service.models.registry import get_model
from service.statistics.cover import statistics_layers, unreached_by_every
from service.statistics.local import statistics
from service.statistics.manifest import stats_manifest
from service.storage.keys import map_key, map_request_key


def engram_map(
    ctx: Context,
    model_id: str,
    concepts: Sequence[str],
    reference: Sequence[str] | None,
    rcond: float | None,
    measure: str = "data",
) -> MapDocument:
    """The grid of each concept on a model, computed here when not stored yet (the ``map`` job's
    work, in this process: for tests and the bench; the API submits a job instead).

    Returns:
        ``{model_id, concepts, reference, rcond, measure, blocks, modules, maps: {concept: {rho: [[value|None]]
        (blocks × modules), max, argmax}}, outside_blocks: {concept: {layer: value}}, layers: [...]}``.
    """
    request = map_request(ctx, model_id, concepts, reference, rcond, measure)
    return find_map(ctx, request) or compute_map(ctx, request, lambda _: NoProgress())


def run_map(ctx: Context, job: JobRecord) -> MapResult:
    """The ``map`` job body: compute the map its request names and store it (once: a map already
    stored is not computed again)."""
    map_id = job.payload_of(MapPayload).map_id
    request = MapRequest.from_json(ctx.storage.get_json(map_request_key(map_id)))
    reused = find_map(ctx, request) is not None
    if not reused:
        compute_map(ctx, request, lambda total: ProgressReporter(ctx, job.job_id, total))
    return MapResult(map_id=map_id, model_id=request.model_id, concepts=tuple(request.concepts), reused=reused)


def compute_map(ctx: Context, request: MapRequest, progress: Callable[[int], Progress]) -> MapDocument:
    """Compute the map (from the statistics and the weights: the worker's work) and store it.

    Args:
        progress: made with the number of steps (one per concept and layer).
    """
    model = get_model(ctx, request.model_id)
    full = model.layout
    layout, left_out = _drawable(ctx, full, request)
    result = _compute(ctx, model, layout, request, progress(len(request.concepts) * len(layout.layers)))
    result["left_out"] = left_out
    ctx.storage.put_json(map_key(request.map_id), result)
    return result


def _drawable(ctx: Context, full: ModelLayout, request: MapRequest) -> tuple[ModelLayout, LeftOut]:
    """The layers the map can draw: those every concept of the universe has statistics for. The
    others are left off and named: ``unreached`` (no concept's forward pass ran them, a vision
    tower: no engram), ``without_statistics`` (a concept collected with ``modules`` lacks them:
    ``Σ_U`` cannot be formed there; a ``reference`` of concepts that have them draws them).

    Raises:
        JobFailed: no layer is covered by every concept.
    """
    unreached = unreached_by_every(ctx, request.prefixes)
    held = [statistics_layers(ctx, p, stats_manifest(ctx, p), full) for p in request.prefixes]
    covered = frozenset.intersection(*held) if held else frozenset()
    layers = [spec for spec in full.layers if spec.name in covered and spec.name not in unreached]
    left_out: LeftOut = {
        "unreached": [spec.name for spec in full.layers if spec.name in unreached],
        "without_statistics": [s.name for s in full.layers if s.name not in covered and s.name not in unreached],
    }
    if not layers:
        raise JobFailed(
            f"no layer has statistics in every concept of the map's universe ({', '.join(request.universe_names)}); "
            "concepts collected with modules cover only those: pass a reference of concepts that cover the same layers"
        )
    return dataclasses.replace(full, layers=layers), left_out


def _compute(ctx: Context, model: ModelRecord, layout: ModelLayout, request: MapRequest, progress: Progress) -> MapDocument:
    reader = CheckpointReader(checked_model_files(ctx, model), layout)
    weigher = _DataWeights([statistics(ctx, p) for p in request.prefixes]) if request.measure == "data" else None
    values: dict[str, dict[str, float]] = {}
    convs: dict[str, dict[str, ConvBreakdown]] = {}
    for name in request.concepts:
        stats = {name: request.stats[name]}
        algebra = statistics_algebra(ctx, {name: 1.0}, stats, list(request.prefixes), request.rcond)
        values[name], convs[name] = {}, {}
        for spec in layout.layers:
            weights = reader.layer_weights(spec)
            try:
                engram = algebra.engram(spec, weights)
            except EditError as exc:
                raise JobFailed(str(exc)) from None
            if weigher is None:
                values[name][spec.name] = relative_norm(spec, engram, weights)
            else:
                values[name][spec.name] = weigher.ratio(spec, engram, weights)
            if spec.kernel is not None:
                sigma = None if weigher is None else weigher.sigma(spec)
                convs[name][spec.name] = conv_breakdown(spec, engram, augmented_weight(spec, weights), sigma)
            progress.advance()
    names, universe_names = list(request.concepts), list(request.universe_names)
    document = _grid(model.model_id, layout, names, universe_names, values, request.rcond, request.measure)
    if any(convs.values()):  # a map without convs keeps its shape
        document["conv"] = convs
    return document


class _DataWeights:
    """``sqrt(tr(E Σ_U Eᵀ) / tr(W Σ_U Wᵀ))`` per layer, ``Σ_U`` summed once per input group (float64)."""

    def __init__(self, universe: Sequence[StatisticsFile]) -> None:
        self.universe = universe
        self._sigma: tuple[tuple[str, ...], torch.Tensor] | None = None  # a group's layers come in a row
        self._output: dict[str, float] = {}

    def sigma(self, spec: LayerSpec) -> torch.Tensor:
        try:
            groups = tuple(stats.layer_group[spec.name] for stats in self.universe)
        except KeyError:
            raise JobFailed(f"no statistics for layer {spec.name}") from None
        if self._sigma is None or self._sigma[0] != groups:
            self._sigma = None
            pairs = ((1.0, stats.sums[group]) for stats, group in zip(self.universe, groups, strict=True))
            self._sigma = (groups, weighted_sum(pairs))
        return self._sigma[1]

    def ratio(self, spec: LayerSpec, engram: torch.Tensor, weights: LayerWeights) -> float:
        sigma = self.sigma(spec)
        if spec.name not in self._output:  # the layer's output energy: the same for every concept
            w = augmented_weight(spec, weights)
            self._output[spec.name] = float(((w @ sigma) * w).sum())
        removed = float(((engram @ sigma) * engram).sum())
        return data_weighted_ratio(removed, self._output[spec.name])


def data_weighted_ratio(removed: float, output: float) -> float:
    """``sqrt(removed / output)``: 0 for a layer the universe's data never reaches (``output`` 0)."""
    return math.sqrt(max(removed, 0.0) / output) if output > 0 else 0.0


def _grid(
    model_id: str,
    layout: ModelLayout,
    names: list[str],
    universe_names: list[str],
    rho: dict[str, dict[str, float]],
    rcond: float | None,
    measure: str,
) -> MapDocument:
    in_blocks = [(spec, spec.block) for spec in layout.layers if spec.block is not None]
    blocks = sorted({block for _, block in in_blocks})
    modules = list(dict.fromkeys(module_type(spec.name) for spec, _ in in_blocks))
    maps: dict[str, ConceptGrid] = {}
    outside: dict[str, dict[str, float]] = {}
    for name in names:
        grid: list[list[float | None]] = [[None] * len(modules) for _ in blocks]
        for spec, block in in_blocks:
            grid[blocks.index(block)][modules.index(module_type(spec.name))] = rho[name][spec.name]
        top = max(rho[name], key=rho[name].__getitem__)
        maps[name] = {"rho": grid, "max": rho[name][top], "argmax": top}
        outside[name] = {spec.name: rho[name][spec.name] for spec in layout.layers if spec.block is None}
    return {
        "model_id": model_id,
        "concepts": names,
        "reference": [n for n in universe_names if n not in names],
        "rcond": rcond,
        "blocks": blocks,
        "modules": modules,
        "maps": maps,
        "outside_blocks": outside,
        "layers": [{"name": s.name, "block": s.block, "module": module_type(s.name)} for s in layout.layers],
        "measure": measure,  # after the grid's keys: the order maps were always stored in
    }
