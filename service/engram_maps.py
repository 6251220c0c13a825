"""Memory-trace maps: where each concept's engram lives, by block and module type (paper Fig. 4).

For every editable layer, ``ρ_l = ‖W_l⁺‖_F / ‖W_l‖_F`` of one concept's engram (coefficient 1)
relative to the universe ``reference ∪ concepts``. The numbers come from cached statistics only (no
forward pass); a map is content-addressed by everything that determines it and kept in storage
(``maps/<digest>.json``), so drawing it again, or as a PNG, costs nothing.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from service.engine.checkpoint import CheckpointReader, ModelLayout
from service.engine.compose import EditError, relative_norms
from service.engine.layers import module_type
from service.errors import InvalidInput, JobFailed
from service.registry import Context, canonical_digest, get_model, resolve_universe

MAX_CONCEPTS = 8


def engram_map(
    ctx: Context, model_id: str, concepts: Sequence[str], reference: Sequence[str] | None, rcond: float | None
) -> dict[str, Any]:
    """The ρ grid of each concept on a model (computed once, then read from storage).

    Returns:
        ``{model_id, concepts, reference, rcond, blocks, modules, maps: {concept: {rho: [[ρ|None]]
        (blocks × modules), max, argmax}}, outside_blocks: {concept: {layer: ρ}}, layers: [...]}``.
    """
    names = list(dict.fromkeys(concepts))
    if not names:
        raise InvalidInput("name at least one concept: ?concepts=a,b")
    if len(names) > MAX_CONCEPTS:
        raise InvalidInput(f"at most {MAX_CONCEPTS} concepts per map, got {len(names)}")
    model = get_model(ctx, model_id)
    universe = resolve_universe(ctx, model_id, names, reference)
    identity = {"model": model["digest"], "concepts": {n: universe.stats[n] for n in names}, "rcond": rcond}
    key = f"maps/{canonical_digest({**identity, 'universe': universe.prefixes})}.json"
    cached = ctx.storage.find_json(key)
    if cached is not None:
        return {**cached, "model_id": model_id}
    result = _compute(ctx, model, names, universe.names, universe.stats, universe.prefixes, rcond)
    ctx.storage.put_json(key, result)
    return result


def _compute(
    ctx: Context,
    model: dict[str, Any],
    names: list[str],
    universe_names: list[str],
    stats: dict[str, str],
    prefixes: list[str],
    rcond: float | None,
) -> dict[str, Any]:
    from service.tasks import _algebra, checked_model_dir  # the workers' statistics and factor caches

    layout = ModelLayout.from_json(model["layout"])
    reader = CheckpointReader(checked_model_dir(ctx, model), layout)
    rho: dict[str, dict[str, float]] = {}
    for name in names:
        request = {"terms": {name: 1.0}, "term_stats": {name: stats[name]}, "universe_stats": prefixes, "rcond": rcond}
        try:
            rho[name] = relative_norms(layout.layers, _algebra(ctx, request), reader.layer_weights)
        except EditError as exc:
            raise JobFailed(str(exc)) from None
    return _grid(model["model_id"], layout, names, universe_names, rho, rcond)


def _grid(
    model_id: str,
    layout: ModelLayout,
    names: list[str],
    universe_names: list[str],
    rho: dict[str, dict[str, float]],
    rcond: float | None,
) -> dict[str, Any]:
    in_blocks = [spec for spec in layout.layers if spec.block is not None]
    blocks = sorted({spec.block for spec in in_blocks if spec.block is not None})
    modules = list(dict.fromkeys(module_type(spec.name) for spec in in_blocks))
    maps, outside = {}, {}
    for name in names:
        grid: list[list[float | None]] = [[None] * len(modules) for _ in blocks]
        for spec in in_blocks:
            grid[blocks.index(spec.block)][modules.index(module_type(spec.name))] = rho[name][spec.name]
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
    }


def render_png(data: dict[str, Any], width: int, height: int) -> bytes:
    """One heatmap panel per concept (rows: blocks, columns: module types), ``width × height`` pixels."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must be chosen before pyplot is imported
    from matplotlib.figure import Figure

    dpi = 100
    figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    axes = figure.subplots(1, len(data["concepts"]), squeeze=False)[0]
    for ax, name in zip(axes, data["concepts"], strict=True):
        grid = [[float("nan") if v is None else v for v in row] for row in data["maps"][name]["rho"]]
        image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(data["modules"])), data["modules"], rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(data["blocks"])), [str(b) for b in data["blocks"]], fontsize=7)
        ax.set_ylabel("block")
        figure.colorbar(image, ax=ax, label="ρ = ‖W⁺‖F / ‖W‖F", shrink=0.9)
    figure.suptitle(f"engram map of {data['model_id']}", fontsize=10)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)  # no bbox_inches: the size stays exactly as asked
    return buffer.getvalue()


def default_size(data: dict[str, Any]) -> tuple[int, int]:
    """A readable size: 420 px per concept panel, 24 px per block (plus room for labels)."""
    return 120 + 420 * len(data["concepts"]), 220 + 24 * len(data["blocks"])
