"""A memory-trace map as a PNG: one heatmap per concept, each on its own colour scale (paper Fig. 4);
with conv layers, two more per concept: their output channels and their kernel positions."""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any

from service.maps.document import MapDocument

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MEASURE_LABELS = {
    "data": "‖W⁺X‖F / ‖WX‖F over the universe's inputs",
    "weight": "ρ = ‖W⁺‖F / ‖W‖F",
}


def panel(data: MapDocument, name: str) -> tuple[list[str], list[str], list[list[float]]]:
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


def conv_panels(data: MapDocument, name: str) -> tuple[list[str], list[list[float]], list[list[float]]]:
    """One concept's conv layers: rows are the layers; one grid's columns their output channels, the
    other's their kernel positions row by row (``kh × kw`` flattened), NaN past a layer's own."""
    layers = data.get("conv", {}).get(name) or {}
    rows = list(layers)
    channels = [list(layers[row]["channels"]) for row in rows]
    kernels = [[v for line in layers[row]["kernel"] for v in line] for row in rows]
    return rows, _padded(channels), _padded(kernels)


def _padded(rows: list[list[float]]) -> list[list[float]]:
    width = max((len(row) for row in rows), default=0)
    return [row + [math.nan] * (width - len(row)) for row in rows]


def render_png(data: MapDocument, width: int, height: int) -> bytes:
    """The map of :func:`map_figure` as PNG bytes, ``width × height`` pixels."""
    figure = map_figure(data, width, height)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=figure.dpi)  # no bbox_inches: the size stays exactly as asked
    return buffer.getvalue()


def map_figure(data: MapDocument, width: int, height: int) -> Figure:
    """One heatmap panel per concept (rows: blocks, columns: module types, and the layers outside the
    blocks), each on its own colour scale with its own colour bar, ``width × height`` pixels.

    One scale for all would draw the weaker concept as one flat colour next to the stronger: each
    panel spans its own range, so where a concept's trace lies shows at a glance; the colour bars and
    the titles' maxima give the magnitudes to compare across concepts.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display; must be chosen before pyplot is imported
    from matplotlib.figure import Figure

    dpi = 100
    figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    with_convs = any(data.get("conv", {}).get(name) for name in data["concepts"])
    grid_axes = figure.subplots(3 if with_convs else 1, len(data["concepts"]), squeeze=False)
    axes = grid_axes[0]
    label = MEASURE_LABELS.get(data.get("measure", "weight"), data.get("measure", "weight"))
    for column, name in enumerate(data["concepts"]):
        if with_convs:
            _conv_panels(figure, grid_axes[1][column], grid_axes[2][column], data, name, label)
    for ax, name in zip(axes, data["concepts"], strict=True):
        rows, columns, grid = panel(data, name)
        low, high = panel_range(grid)
        image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest", vmin=low, vmax=high)
        ax.set_title(f"{name} (max {data['maps'][name]['max']:.3g})", fontsize=9)
        ax.set_xticks(range(len(columns)), columns, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_ylabel("block")
        figure.colorbar(image, ax=ax, shrink=0.9).set_label(label, fontsize=7)
    figure.suptitle(f"engram map of {data['model_id']}: each panel on its own colour scale", fontsize=10)
    return figure


def _conv_panels(figure: Figure, channel_ax: Any, kernel_ax: Any, data: MapDocument, name: str, label: str) -> None:
    """A concept's conv layers by output channel and by kernel position, each on its own scale."""
    rows, channels, kernels = conv_panels(data, name)
    for ax, grid, what in ((channel_ax, channels, "output channel"), (kernel_ax, kernels, "kernel position (row-major)")):
        if not rows:
            ax.set_axis_off()
            continue
        low, high = panel_range(grid)
        image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest", vmin=low, vmax=high)
        ax.set_title(f"{name}: conv layers by {what}", fontsize=8)
        ax.set_yticks(range(len(rows)), [_short(row) for row in rows], fontsize=6)
        ax.set_xlabel(what, fontsize=7)
        figure.colorbar(image, ax=ax, shrink=0.9).set_label(label, fontsize=6)


def _short(layer: str, width: int = 28) -> str:
    """A layer name that fits a tick label: its end, which tells the layers of one model apart."""
    return layer if len(layer) <= width else "…" + layer[-(width - 1) :]


def panel_range(grid: list[list[float]]) -> tuple[float, float]:
    """The colour range of one panel: its smallest to its largest finite value (a panel of one
    value, or none, gets a range around it so that the colour bar still reads)."""
    finite = [v for row in grid for v in row if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    low, high = min(finite), max(finite)
    if high > low:
        return low, high
    pad = 0.05 * abs(low) or 0.5
    return low - pad, high + pad


def default_size(data: MapDocument) -> tuple[int, int]:
    """A readable size: 420 px per concept panel, 24 px per block row (plus room for labels)."""
    outside = any(data["outside_blocks"].get(name) for name in data["concepts"])
    convs = max((len(data.get("conv", {}).get(name) or {}) for name in data["concepts"]), default=0)
    conv_height = 2 * (120 + 18 * convs) if convs else 0  # the channel and kernel rows of panels
    return 120 + 420 * len(data["concepts"]), 220 + 24 * (len(data["blocks"]) + int(outside)) + conv_height
