"""A memory-trace map as a PNG: one heatmap per concept, every panel on one colour scale (paper Fig. 4)."""

from __future__ import annotations

import io
import math
from typing import Any

MEASURE_LABELS = {
    "data": "‖W⁺X‖F / ‖WX‖F over the universe's inputs",
    "weight": "ρ = ‖W⁺‖F / ‖W‖F",
}


def panel(data: dict[str, Any], name: str) -> tuple[list[str], list[str], list[list[float]]]:
    """One concept's heatmap: rows are the blocks, then ``outside`` when layers lie outside them;
    columns the module types, then each outside layer (``lm_head``), so every edited layer has a cell."""
    outside = data["outside_blocks"].get(name) or {}
    columns = [*data["modules"], *outside]
    grid = [[math.nan if v is None else v for v in row] + [math.nan] * len(outside) for row in data["maps"][name]["rho"]]
    rows = [str(b) for b in data["blocks"]]
    if outside:
        grid.append([math.nan] * len(data["modules"]) + list(outside.values()))
        rows.append("outside")
    return rows, columns, grid


def render_png(data: dict[str, Any], width: int, height: int) -> bytes:
    """One heatmap panel per concept (rows: blocks, columns: module types, and the layers outside the
    blocks), on one colour scale for every panel, so concepts compare; ``width × height`` pixels."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must be chosen before pyplot is imported
    from matplotlib.figure import Figure

    dpi = 100
    figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    axes = figure.subplots(1, len(data["concepts"]), squeeze=False)[0]
    panels = [panel(data, name) for name in data["concepts"]]
    finite = [v for _, _, grid in panels for row in grid for v in row if math.isfinite(v)]
    top = max(finite, default=1.0) or 1.0
    measure = data.get("measure", "weight")
    image = None
    for ax, name, (rows, columns, grid) in zip(axes, data["concepts"], panels, strict=True):
        image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0.0, vmax=top)
        ax.set_title(f"{name} (max {data['maps'][name]['max']:.3g})", fontsize=9)
        ax.set_xticks(range(len(columns)), columns, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_ylabel("block")
    if image is not None:
        figure.colorbar(image, ax=list(axes), label=MEASURE_LABELS.get(measure, measure), shrink=0.9)
    figure.suptitle(f"engram map of {data['model_id']}", fontsize=10)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)  # no bbox_inches: the size stays exactly as asked
    return buffer.getvalue()


def default_size(data: dict[str, Any]) -> tuple[int, int]:
    """A readable size: 420 px per concept panel, 24 px per block row (plus room for labels)."""
    outside = any(data["outside_blocks"].get(name) for name in data["concepts"])
    return 120 + 420 * len(data["concepts"]), 220 + 24 * (len(data["blocks"]) + int(outside))
