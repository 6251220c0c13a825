"""How the front PNG scales an axis, chosen by the data, and where it draws the Pareto front's line.

A linear axis squeezes the candidates that matter when the metric crowds at one end: an image
classifier's retain accuracy runs from chance (0.1, an α that destroys the model) to the base's
0.95, and every candidate that keeps ≥ 0.9 × the base sits in the last sixth of the axis. So each
axis is the scale under which the feasible candidates (those meeting every bound of the result)
span the largest share of it:

- ``log`` for positive values spanning orders of magnitude (NLL ratios always: issue 28);
- ``logit`` for shares in [0, 1] (accuracy, exact match) crowded near 0 or 1: 0.9, 0.99 and 0.01,
  0.1 are as far apart as 0.5 and 0.9; a 0 or 1 is drawn at ``ε`` or ``1 − ε`` (the axis label says so);
- ``linear`` otherwise, and unless another scale at least doubles that share (a linear axis reads easiest).

The front line joins the candidates marked ``pareto`` when the axes are the two metrics the front
was taken on, as the staircase that bounds what they dominate (its steps follow which way x is better).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Scale = Literal["linear", "log", "logit"]
_SHARE_SUFFIXES = ("_accuracy", "_exact_match")  # metrics that are shares of probes, in [0, 1]
_BETTER_BY = 2.0  # how many times a larger share of the axis a non-linear scale must give the feasible points
# Which way each front metric is better when the result states no objective (the NLL search's front).
_LOWER_IS_BETTER = {"retain_nll_ratio": True, "forget_nll_ratio": False}


@dataclass(frozen=True)
class AxisScale:
    """One axis's scale and, for ``logit``, where a 0 or 1 is drawn (``eps``, ``1 - eps``)."""

    scale: Scale
    eps: float = 0.0

    def place(self, value: float) -> float:
        """Where a value is drawn (a 0 or 1 moved inside a logit axis)."""
        if self.scale == "logit":
            return min(max(value, self.eps), 1.0 - self.eps)
        return value

    def note(self) -> str:
        """What the axis label adds (how to read a logit axis's ends)."""
        if self.scale == "logit":
            return f" (logit scale: 0 and 1 drawn at {self.eps:.2g} and {1 - self.eps:.3g})"
        return ""


def is_share(name: str) -> bool:
    """Whether a metric is a share of probes (accuracy, exact match, an attacked one's too)."""
    return name.endswith(_SHARE_SUFFIXES)


def choose_scale(name: str, values: Sequence[float], feasible: Sequence[float]) -> AxisScale:
    """The scale under which the feasible values (all values when fewer than two are feasible) take
    the largest share of the axis the values span; see the module's docstring.

    Args:
        name: the metric (an NLL ratio is always logarithmic, a share may be logit).
        values: every drawn candidate's value on this axis.
        feasible: the feasible candidates' values.
    """
    if name.endswith("_nll_ratio"):
        return AxisScale("log")
    shown = list(feasible) if len(feasible) >= 2 else list(values)
    options = [AxisScale("linear")]
    if values and min(values) > 0:
        options.append(AxisScale("log"))
    if values and is_share(name) and 0.0 <= min(values) and max(values) <= 1.0:
        options.append(AxisScale("logit", _logit_eps(values)))
    linear = _share_of_axis(options[0], values, shown)
    best = max(options[1:], key=lambda s: _share_of_axis(s, values, shown), default=None)
    if best is not None and _share_of_axis(best, values, shown) >= _BETTER_BY * max(linear, 1e-9):
        return best
    return options[0]


def _logit_eps(values: Sequence[float]) -> float:
    """Half the smallest distance of a value from 0 or 1 that is not 0, at most 0.01."""
    gaps = [d for v in values for d in (v, 1.0 - v) if d > 0]
    return min([0.01, *(g / 2 for g in gaps)])


def _transform(scale: AxisScale, value: float) -> float:
    value = scale.place(value)
    if scale.scale == "log":
        return math.log(value)
    if scale.scale == "logit":
        return math.log(value / (1.0 - value))
    return value


def _share_of_axis(scale: AxisScale, values: Sequence[float], shown: Sequence[float]) -> float:
    """The span of ``shown`` as a share of the span of ``values``, both on ``scale``."""
    everything = [_transform(scale, v) for v in values]
    mine = [_transform(scale, v) for v in shown]
    whole = max(everything, default=0.0) - min(everything, default=0.0)
    return (max(mine) - min(mine)) / whole if whole > 0 and mine else 0.0


def feasible_rows(result: Mapping[str, Any], rows: Sequence[Mapping[str, float]]) -> list[Mapping[str, float]]:
    """The candidates (as :func:`service.calibration.plot.candidate_values`) that meet every bound of
    the result: an objective's constraints, the NLL search's retain limit, the attack gate's."""
    bounds = [(b["metric"], b.get("min"), b.get("max")) for b in result.get("constraints") or []]
    old = (result.get("constraint") or {}).get("max_retain_nll_ratio")
    if old is not None:
        bounds.append(("retain_nll_ratio", None, old))
    for b in (result.get("attack_gate") or {}).get("constraints") or []:
        bounds.append((f"{b['attack']}.{b['metric']}", b.get("min"), b.get("max")))

    def meets(values: Mapping[str, float]) -> bool:
        return all(
            name in values and (low is None or values[name] >= low) and (high is None or values[name] <= high)
            for name, low, high in bounds
        )

    return [values for values in rows if meets(values)]


def front_axes(result: Mapping[str, Any]) -> dict[str, bool]:
    """The two metrics the result's front was taken on, each with whether lower is better: the NLL
    ratios without an objective; with one, the objective and its first bound's metric (a lower
    bound: higher is better; an upper bound: lower is). Empty when the front has one metric only."""
    objective = result.get("objective")
    if objective is None:
        return dict(_LOWER_IS_BETTER)
    axes = {objective["metric"]: objective["sense"] == "minimize"}
    first = (result.get("constraints") or [None])[0]
    if first is None or first["metric"] in axes:
        return {}
    axes[first["metric"]] = first.get("min") is None
    return axes


def front_steps(result: Mapping[str, Any], x: str, y: str) -> Literal["pre", "post"] | None:
    """How the front's line steps on these axes (``None``: they are not the front's metrics): after
    each point when lower x is better (the point dominates to its right), before it when higher is."""
    axes = front_axes(result)
    if set(axes) != {x, y}:
        return None
    return "post" if axes[x] else "pre"
