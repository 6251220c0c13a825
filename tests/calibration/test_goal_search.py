"""The goal search (service.calibration.goal_search) on synthetic arms: pure and fast.

Each arm is a pair of functions of α: a constraint metric that falls with α (utility) and an
objective that is not monotone (a peak, as Overall's Privacy part has). The best feasible candidate
is computed independently on a fine grid and the search must come within its tolerance of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from service.calibration.goal_search import Bound, Goal, GoalSettings, goal_search, recommend_for_goal
from service.calibration.search import Arm

pytestmark = pytest.mark.fast

Curve = Callable[[float], float]


def _arm(name: str, scaling: str = "uniform") -> Arm:
    return Arm(name, None, None, scaling)  # type: ignore[arg-type]


def _peak(centre: float, height: float, width: float = 0.6) -> Curve:
    """A bump in log α: highest at ``centre``, falling on both sides."""
    return lambda a: height * math.exp(-(((math.log(a) - math.log(centre)) / width) ** 2))


def _falling(scale: float) -> Curve:
    """A utility that falls from 1 as α grows: ``1 / (1 + (α/scale)²)``."""
    return lambda a: 1.0 / (1.0 + (a / scale) ** 2)


def _evaluator(curves: dict[Arm, tuple[Curve, Curve]]) -> Callable[[Arm, float], dict[str, float]]:
    def evaluate(arm: Arm, alpha: float) -> dict[str, float]:
        objective, utility = curves[arm]
        return {"overall": objective(alpha), "model_utility": utility(alpha)}

    return evaluate


def _best_on_grid(curves: dict[Arm, tuple[Curve, Curve]], floor: float, lo: float, hi: float) -> float:
    """The best feasible objective over a grid 100 times finer than the search's tolerance."""
    n = 20000
    alphas = [lo * (hi / lo) ** (k / (n - 1)) for k in range(n)]
    return max(obj(a) for obj, util in curves.values() for a in alphas if util(a) >= floor)


GOAL = Goal("overall", "maximize", (Bound("model_utility", min=0.9),))


def test_an_interior_peak_inside_the_feasible_range_is_found() -> None:
    # utility ≥ 0.9 holds for α ≤ 3·(1/9)^½ = 1.0; the peak (0.4) is inside: an interior optimum
    arms = {_arm("all"): (_peak(0.4, 0.8), _falling(3.0)), _arm("mlp"): (_peak(0.3, 0.5), _falling(3.0))}
    found = goal_search(list(arms), _evaluator(arms), GOAL, GoalSettings(budget=40))
    best = recommend_for_goal(GOAL, found.candidates)
    assert best is not None and best.arm.module_set == "all"
    assert best.metrics["overall"] >= _best_on_grid(arms, 0.9, 0.05, 4.0) - 1e-3
    assert best.metrics["model_utility"] >= 0.9
    assert all(c.metrics for c in found.candidates)  # every candidate reports its metrics


def test_a_peak_beyond_the_constraint_gives_the_boundary() -> None:
    # the peak (2.0) is infeasible (utility 0.9 at α = 1): the best feasible α is the boundary
    arms = {_arm("all"): (_peak(2.0, 0.9), _falling(3.0))}
    found = goal_search(list(arms), _evaluator(arms), GOAL, GoalSettings(budget=40, tol=0.01))
    best = recommend_for_goal(GOAL, found.candidates)
    assert best is not None
    assert best.metrics["model_utility"] >= 0.9
    assert best.alpha == pytest.approx(1.0, rel=0.02)
    # the optimum is the boundary (α = 1): within the tolerance of it, on the feasible side
    assert best.metrics["overall"] >= _peak(2.0, 0.9)(1.0 / 1.01)
    assert _best_on_grid(arms, 0.9, 0.05, 4.0) == pytest.approx(_peak(2.0, 0.9)(1.0), rel=1e-3)


def test_the_search_does_not_prune_an_arm_a_monotone_bound_would_drop() -> None:
    # arm "attention" looks worse at every coarse point but its narrow peak, between two coarse
    # points, is the best feasible value; "all" is better on the coarse grid
    narrow = _peak(0.5, 0.95, width=0.35)
    arms = {_arm("all"): (_peak(0.2, 0.7, width=2.0), _falling(10.0)), _arm("attention"): (narrow, _falling(10.0))}
    found = goal_search(list(arms), _evaluator(arms), GOAL, GoalSettings(budget=60, coarse=8))
    assert found.pruned == []
    best = recommend_for_goal(GOAL, found.candidates)
    assert best is not None and best.arm.module_set == "attention"
    assert best.metrics["overall"] >= 0.95 - 1e-3


def test_minimize_and_an_upper_bound() -> None:
    # minimise a valley under an upper bound on a rising damage metric
    goal = Goal("exact_memorization", "minimize", (Bound("retain_nll_ratio", max=2.0),))
    arm = _arm("all")

    def evaluate(a: Arm, alpha: float) -> dict[str, float]:
        return {"exact_memorization": 1 - _peak(0.7, 0.9)(alpha), "retain_nll_ratio": 1 + alpha}

    found = goal_search([arm], evaluate, goal, GoalSettings(budget=40))
    best = recommend_for_goal(goal, found.candidates)
    assert best is not None and best.alpha == pytest.approx(0.7, rel=0.03)
    assert best.metrics["retain_nll_ratio"] <= 2.0


def test_nothing_feasible_recommends_nothing_and_the_budget_holds() -> None:
    arms = {_arm("all"): (_peak(0.4, 0.8), lambda a: 0.5)}
    found = goal_search(list(arms), _evaluator(arms), GOAL, GoalSettings(budget=9))
    assert recommend_for_goal(GOAL, found.candidates) is None
    assert len(found.candidates) <= 9
    assert not any(c.feasible for c in found.candidates)


def test_a_small_budget_spreads_the_coarse_grid_over_the_arms() -> None:
    arms = {_arm(name): (_peak(0.4, 0.8), _falling(3.0)) for name in ("all", "mlp", "attention")}
    found = goal_search(list(arms), _evaluator(arms), GOAL, GoalSettings(budget=5))
    assert found.stopped == "budget"
    assert [c.arm.module_set for c in found.candidates] == ["all", "mlp", "attention", "all", "mlp"]
    assert found.unexplored == []


def test_a_bound_needs_a_limit() -> None:
    with pytest.raises(ValueError, match="no bound"):
        Bound("model_utility")
