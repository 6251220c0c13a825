"""The calibration front as a PNG: every candidate, the Pareto front, the constraint, the recommendation."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WIDTH, HEIGHT, DPI = 900, 620, 100
_MARKERS = {"uniform": "o", "weight_norm": "s"}


def render_front_png(result: Mapping[str, Any]) -> bytes:
    """The front of :func:`front_figure` as PNG bytes (``WIDTH × HEIGHT`` pixels)."""
    buffer = io.BytesIO()
    front_figure(result).savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def front_figure(result: Mapping[str, Any]) -> Figure:
    """Forget NLL ratio against retain NLL ratio of every candidate (colour: module set, marker:
    scaling), the Pareto front as a line, the constraint as a dashed line, the recommendation starred.

    Both axes are logarithmic: the ratios run from about 1 (the acceptable candidates, retain ratio
    just above 1) to many times that, and a linear axis squeezes the acceptable ones into a sliver.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display; must be chosen before pyplot is imported
    from matplotlib.figure import Figure

    figure = Figure(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI, layout="constrained")
    ax = figure.subplots()
    points = [c for c in result["candidates"] if _finite(c)]
    sets = list(dict.fromkeys(c["options"]["module_set"] for c in result["candidates"]))
    colours = {name: f"C{i % 10}" for i, name in enumerate(sets)}
    for (module_set, scaling), group in _groups(points).items():
        ax.scatter(
            [c["retain"]["nll_ratio"] for c in group],
            [c["forget"]["nll_ratio"] for c in group],
            c=colours[module_set],
            marker=_MARKERS.get(scaling, "o"),
            alpha=0.75,
            label=f"{module_set} / {scaling}",
        )
    front = [c for c in points if c["pareto"]]
    front.sort(key=lambda c: c["retain"]["nll_ratio"])
    if front:
        xs = [c["retain"]["nll_ratio"] for c in front]
        ys = [c["forget"]["nll_ratio"] for c in front]
        ax.step(xs, ys, where="post", color="black", linewidth=1, label="Pareto front")
    limit = result["constraint"]["max_retain_nll_ratio"]
    ax.axvline(limit, color="red", linestyle="--", linewidth=1, label=f"max retain NLL ratio {limit:g}")
    recommended = result.get("recommended")
    if recommended is not None:
        ax.scatter(
            [recommended["retain_nll_ratio"]],
            [recommended["forget_nll_ratio"]],
            marker="*",
            s=320,
            c="gold",
            edgecolors="black",
            zorder=5,
            label=f"recommended: {_describe(recommended['options'])}",
        )
    ax.set_xlabel("retain answer NLL ratio (variant / base): lower keeps more")
    ax.set_ylabel("forget answer NLL ratio (variant / base): higher forgets more")
    ax.set_xscale("log")  # ratios: ×1.02 and ×10 both readable (only positive ratios are drawn)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    concepts = ", ".join(result["concepts"])
    ax.set_title(f"calibration of {result['model_id']} ({concepts}): {result['evaluations']} candidates", fontsize=10)
    return figure


def _finite(candidate: Mapping[str, Any]) -> bool:
    values = (candidate["forget"]["nll_ratio"], candidate["retain"]["nll_ratio"])
    return all(v is not None and math.isfinite(v) and v > 0 for v in values)


def _groups(points: list[Mapping[str, Any]]) -> dict[tuple[str, str], list[Mapping[str, Any]]]:
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for c in points:
        groups.setdefault((c["options"]["module_set"], c["options"]["scaling"]), []).append(c)
    return groups


def _describe(options: Mapping[str, Any]) -> str:
    blocks = "" if options.get("layers") is None else f" blocks {options['layers']}"
    return f"α={options['alpha']:.3g} {options['module_set']}{blocks} {options['scaling']}"
