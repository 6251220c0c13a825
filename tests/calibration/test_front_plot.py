"""The calibration front PNG (issue 28): both NLL-ratio axes are logarithmic, so the acceptable
candidates (retain ratio just above 1) are not squeezed into a sliver next to the ones at ×10. Read
from the matplotlib figure the PNG is drawn from."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

from service.calibration.plot import DPI, HEIGHT, WIDTH, front_figure, render_front_png


def candidate(retain: float, forget: float, *, pareto: bool = False, alpha: float = 1.0) -> dict[str, Any]:
    options = {"module_set": "mlp", "scaling": "uniform", "alpha": alpha, "layers": None}
    return {"options": options, "retain": {"nll_ratio": retain}, "forget": {"nll_ratio": forget}, "pareto": pareto}


def result(candidates: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model_id": "demo/m",
        "concepts": ["forget"],
        "evaluations": len(candidates),
        "candidates": candidates,
        "constraint": {"max_retain_nll_ratio": 1.05},
        "recommended": {"retain_nll_ratio": 1.04, "forget_nll_ratio": 3.0, "options": candidates[0]["options"]}
        if candidates
        else None,
    }


def test_both_ratio_axes_are_logarithmic() -> None:
    # forget ratios within ×20 of each other: the old plot kept a linear axis for them, and always for retain
    front = result([candidate(1.01, 1.5), candidate(1.04, 3.0, pareto=True), candidate(9.0, 12.0, pareto=True)])
    ax = front_figure(front).axes[0]
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    low, high = ax.get_xlim()
    assert low <= 1.01 and high >= 9.0


def test_the_png_keeps_its_size_without_candidates() -> None:
    png = render_front_png(result([]))
    assert Image.open(io.BytesIO(png)).size == (WIDTH, HEIGHT) and DPI == 100


def classifier_result() -> dict[str, Any]:
    """An image classifier's calibration as the job stores it (minimise forget accuracy, keep ≥ 0.855
    retain accuracy): the α grid runs from the base's 0.95 down to chance, 0.1."""
    grid = [(0.95, 0.9), (0.94, 0.5), (0.93, 0.2), (0.9, 0.05), (0.88, 0.0), (0.6, 0.0), (0.3, 0.0), (0.1, 0.0)]
    rows = []
    for i, (retain, forget) in enumerate(grid):
        options = {"module_set": "all", "scaling": "uniform", "alpha": 0.25 * (i + 1), "layers": None}
        metrics = {"retain_accuracy": retain, "forget_accuracy": forget}
        rows.append({"options": options, "metrics": metrics, "pareto": i < 5})  # the feasible trade-off
    return {
        "model_id": "vit",
        "concepts": ["zeros"],
        "evaluations": len(rows),
        "candidates": rows,
        "objective": {"metric": "forget_accuracy", "sense": "minimize"},
        "constraints": [{"metric": "retain_accuracy", "min": 0.855, "max": None}],
        "recommended": {"candidate": 4, "options": rows[4]["options"]},
    }


def feasible_share(ax: Any, values: list[float]) -> float:
    """The share of the x axis the values span, in the axis's own (scaled) coordinates."""
    to_axes = ax.transScale + ax.transLimits
    drawn = [to_axes.transform((v, 0.5))[0] for v in values]
    return max(drawn) - min(drawn)


def test_a_classifier_front_spreads_its_feasible_candidates_and_draws_the_front() -> None:
    front = classifier_result()
    ax = front_figure(front, "retain_accuracy", "forget_accuracy").axes[0]
    # linear, the five feasible candidates (0.88 to 0.95) spanned 8% of the x axis; logit at least twice that
    assert ax.get_xscale() == "logit"
    assert feasible_share(ax, [0.88, 0.95]) >= 0.16
    assert "logit scale" in ax.get_xlabel()
    fronts = [line for line in ax.get_lines() if line.get_label() == "Pareto front"]
    assert len(fronts) == 1
    xs, ys = (np.asarray(values, dtype=float).tolist() for values in fronts[0].get_data())
    # higher retain accuracy is better: each step drops before its point (drawstyle steps-pre)
    assert fronts[0].get_drawstyle() == "steps-pre"
    assert sorted(xs) == [0.88, 0.9, 0.93, 0.94, 0.95]
    assert sorted(ys) == [0.0, 0.05, 0.2, 0.5, 0.9]
    # the feasible forget accuracies already span the whole y axis: it stays linear
    assert ax.get_yscale() == "linear"


def test_a_front_on_other_metrics_than_its_own_draws_no_line() -> None:
    front = classifier_result()
    for row in front["candidates"]:
        row["metrics"]["tow"] = row["metrics"]["retain_accuracy"] - row["metrics"]["forget_accuracy"]
    ax = front_figure(front, "tow", "forget_accuracy").axes[0]
    assert [line for line in ax.get_lines() if line.get_label() == "Pareto front"] == []


def test_shares_spread_evenly_stay_linear() -> None:
    rows = classifier_result()
    for i, row in enumerate(rows["candidates"]):
        row["metrics"] = {"retain_accuracy": 0.3 + 0.08 * i, "forget_accuracy": 0.7 - 0.08 * i}
    rows["constraints"] = [{"metric": "retain_accuracy", "min": 0.2, "max": None}]
    ax = front_figure(rows, "retain_accuracy", "forget_accuracy").axes[0]
    assert (ax.get_xscale(), ax.get_yscale()) == ("linear", "linear")


def test_the_nll_front_keeps_its_line_after_each_point() -> None:
    front = result([candidate(1.01, 1.5), candidate(1.04, 3.0, pareto=True), candidate(9.0, 12.0, pareto=True)])
    (line,) = [line for line in front_figure(front).axes[0].get_lines() if line.get_label() == "Pareto front"]
    assert line.get_drawstyle() == "steps-post"  # lower retain ratio is better: a point dominates to its right
