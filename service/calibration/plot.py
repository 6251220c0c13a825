"""The calibration front as a PNG: every candidate on two metrics, the front, the bounds, the recommendation.

The default axes are the retain NLL ratio (x) and the forget NLL ratio (y), as the job draws and
stores the front; ``GET /calibrations/{id}/front.png?x=…&y=…`` draws any two metrics the
candidates carry (:func:`candidate_values`: the NLL ratios, mean NLLs and exact match per split,
and with an objective every metric measured, TOFU's included) from the stored result.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from service.calibration.plot_scales import AxisScale, choose_scale, feasible_rows, front_steps

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

WIDTH, HEIGHT, DPI = 900, 620, 100
_MARKERS = {"uniform": "o", "weight_norm": "s"}
DEFAULT_X, DEFAULT_Y = "retain_nll_ratio", "forget_nll_ratio"
CLASSIFIER_X, CLASSIFIER_Y = "retain_accuracy", "forget_accuracy"  # an image classifier's calibration
EXACT_X, EXACT_Y = "retain_exact_match", "forget_exact_match"  # the exact-match objective (text's default)
_LABELS = {
    "retain_nll_ratio": "retain answer NLL ratio (variant / base): lower keeps more",
    "forget_nll_ratio": "forget answer NLL ratio (variant / base): higher forgets more",
    "retain_accuracy": "retain top-1 accuracy: higher keeps more",
    "forget_accuracy": "forget top-1 accuracy: lower forgets more",
    "retain_exact_match": "retain exact match (share of answers): higher keeps more",
    "forget_exact_match": "forget exact match (share of answers): lower forgets more",
}
_SPLIT_FIELDS = {"nll_ratio": "nll_ratio", "mean_nll": "mean_nll", "exact_match": "exact_match"}


def candidate_values(candidate: Mapping[str, Any]) -> dict[str, float]:
    """Every finite metric of one candidate row of a result, by name."""
    values: dict[str, Any] = {}
    for split in ("forget", "retain"):
        scores = candidate.get(split) or {}
        for field, suffix in _SPLIT_FIELDS.items():
            values[f"{split}_{suffix}"] = scores.get(field)
    values.update(candidate.get("metrics") or {})
    for attack, attacked in (candidate.get("attacked") or {}).items():  # the attack gate's: <attack>.<metric>
        values.update({f"{attack}.{metric}": value for metric, value in attacked.items()})
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float) and math.isfinite(v)}


def default_axes(result: Mapping[str, Any]) -> tuple[str, str]:
    """The axes a result is drawn on by default: the NLL ratios; for an image classifier's
    calibration (its candidates carry ``forget_accuracy``) the retain and forget accuracies; for the
    exact-match objective the retain and forget exact match (the ratios are in the legend)."""
    classifier = any("forget_accuracy" in (c.get("metrics") or {}) for c in result["candidates"])
    if classifier:
        return CLASSIFIER_X, CLASSIFIER_Y
    if (result.get("objective") or {}).get("metric") == EXACT_Y:
        return EXACT_X, EXACT_Y
    return DEFAULT_X, DEFAULT_Y


def plottable_metrics(result: Mapping[str, Any]) -> list[str]:
    """The metrics some candidate of the result carries (what ``x`` and ``y`` may name)."""
    names: dict[str, None] = {}
    for candidate in result["candidates"]:
        names.update(dict.fromkeys(candidate_values(candidate)))
    return sorted(names)


def render_front_png(result: Mapping[str, Any], x: str = DEFAULT_X, y: str = DEFAULT_Y) -> bytes:
    """The front of :func:`front_figure` as PNG bytes (``WIDTH × HEIGHT`` pixels)."""
    buffer = io.BytesIO()
    front_figure(result, x, y).savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def front_figure(result: Mapping[str, Any], x: str = DEFAULT_X, y: str = DEFAULT_Y) -> Figure:
    """``y`` against ``x`` for every candidate (colour: module set, marker: scaling), the Pareto
    front as a line (on the two metrics it was taken on), the bounds on either metric as dashed
    lines, the recommendation starred.

    Each axis's scale is chosen by the data (:mod:`service.calibration.plot_scales`): an NLL ratio is
    logarithmic, a share crowded near 0 or 1 (an image classifier's accuracies) is logit, so that the
    feasible candidates are not squeezed into a sliver next to the ones an α too strong destroyed.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display; must be chosen before pyplot is imported
    from matplotlib.figure import Figure

    figure = Figure(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI, layout="constrained")
    ax = figure.subplots()
    points = [(c, candidate_values(c)) for c in result["candidates"]]
    points = [(c, v) for c, v in points if _drawable(v, x, x.endswith("_nll_ratio"))]
    points = [(c, v) for c, v in points if _drawable(v, y, y.endswith("_nll_ratio"))]
    feasible = feasible_rows(result, [v for _, v in points])
    scales = {
        axis: choose_scale(name, [v[name] for _, v in points], [v[name] for v in feasible])
        for axis, name in (("x", x), ("y", y))
    }
    sx, sy = scales["x"].place, scales["y"].place
    sets = list(dict.fromkeys(c["options"]["module_set"] for c in result["candidates"]))
    colours = {name: f"C{i % 10}" for i, name in enumerate(sets)}
    for (module_set, scaling), group in _groups(points).items():
        ax.scatter(
            [sx(v[x]) for _, v in group],
            [sy(v[y]) for _, v in group],
            c=colours[module_set],
            marker=_MARKERS.get(scaling, "o"),
            alpha=0.75,
            label=f"{module_set} / {scaling}",
        )
    steps = front_steps(result, x, y)
    front = sorted(((c, v) for c, v in points if c.get("pareto")), key=lambda item: item[1][x])
    if steps is not None and front:
        xs, ys = [sx(v[x]) for _, v in front], [sy(v[y]) for _, v in front]
        ax.step(xs, ys, where=steps, color="black", linewidth=1, label="Pareto front")
    _bounds(ax, result, x, y, scales)
    _star(ax, result, x, y, scales)
    ax.set_xlabel(_LABELS.get(x, x) + scales["x"].note())
    ax.set_ylabel(_LABELS.get(y, y) + scales["y"].note())
    ax.set_xscale(scales["x"].scale)  # log: only positive values are drawn; logit: 0 and 1 placed inside
    ax.set_yscale(scales["y"].scale)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    concepts = ", ".join(result["concepts"])
    ax.set_title(f"calibration of {result['model_id']} ({concepts}): {result['evaluations']} candidates", fontsize=10)
    return figure


def _star(ax: Axes, result: Mapping[str, Any], x: str, y: str, scales: Mapping[str, AxisScale]) -> None:
    """The recommendation, starred, its options and scores in the legend."""
    star = _recommended_point(result, x, y)
    if star is None:
        return
    ax.scatter(
        [scales["x"].place(star[0])],
        [scales["y"].place(star[1])],
        marker="*",
        s=320,
        c="gold",
        edgecolors="black",
        zorder=5,
        label=f"recommended: {_describe(result['recommended']['options'])}{_headline(result)}",
    )


def _drawable(values: Mapping[str, float], name: str, log: bool) -> bool:
    return name in values and (values[name] > 0 or not log)


def _bounds(ax: Axes, result: Mapping[str, Any], x: str, y: str, scales: Mapping[str, AxisScale]) -> None:
    """The constraint's lines: the NLL search's retain limit, or an objective's bounds on x or y."""
    limits: list[tuple[str, str, float]] = []
    old = (result.get("constraint") or {}).get("max_retain_nll_ratio")
    if old is not None:
        limits.append(("retain_nll_ratio", "max retain NLL ratio", old))
    for bound in result.get("constraints") or []:
        for side in ("min", "max"):
            if bound.get(side) is not None:
                limits.append((bound["metric"], f"{side} {bound['metric']}", bound[side]))
    for bound in (result.get("attack_gate") or {}).get("constraints") or []:
        name = f"{bound['attack']}.{bound['metric']}"
        limits += [(name, f"{side} {name}", bound[side]) for side in ("min", "max") if bound.get(side) is not None]
    for metric, label, value in limits:
        if metric == x:
            ax.axvline(scales["x"].place(value), color="red", linestyle="--", linewidth=1, label=f"{label} {value:.4g}")
        if metric == y:
            ax.axhline(scales["y"].place(value), color="red", linestyle="--", linewidth=1, label=f"{label} {value:.4g}")


def _recommended_point(result: Mapping[str, Any], x: str, y: str) -> tuple[float, float] | None:
    recommended = result.get("recommended")
    if recommended is None:
        return None
    index = recommended.get("candidate")
    rows = result["candidates"]
    if isinstance(index, int) and 0 <= index < len(rows):
        values = candidate_values(rows[index])
    else:  # a result without the candidate's index: the recommendation's own ratios
        values = {DEFAULT_X: recommended.get("retain_nll_ratio"), DEFAULT_Y: recommended.get("forget_nll_ratio")}
    if values.get(x) is None or values.get(y) is None:
        return None
    return float(values[x]), float(values[y])


def _groups(points: list[tuple[Mapping[str, Any], dict[str, float]]]) -> dict[tuple[str, str], list[Any]]:
    groups: dict[tuple[str, str], list[Any]] = {}
    for c, v in points:
        groups.setdefault((c["options"]["module_set"], c["options"]["scaling"]), []).append((c, v))
    return groups


def _headline(result: Mapping[str, Any]) -> str:
    """The recommendation's exact match (accuracy) beside its NLL ratios, as the legend shows them."""
    index = result["recommended"].get("candidate")
    rows = result["candidates"]
    if not isinstance(index, int) or not 0 <= index < len(rows):
        return ""
    parts = []
    for split in ("forget", "retain"):
        scores = rows[index].get(split) or {}
        em, ratio = scores.get("exact_match"), scores.get("nll_ratio")
        shown = f"{split} exact {em:.0%}" if isinstance(em, int | float) else f"{split}"
        parts.append(shown + (f" ×NLL {ratio:.3g}" if isinstance(ratio, int | float) else ""))
    return "\n" + ", ".join(parts)


def _describe(options: Mapping[str, Any]) -> str:
    blocks = "" if options.get("layers") is None else f" blocks {options['layers']}"
    return f"α={options['alpha']:.3g} {options['module_set']}{blocks} {options['scaling']}"
