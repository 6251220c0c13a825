"""The calibration search on synthetic arms: Pareto front, budget, coarse-to-fine, pruning.

Each synthetic arm has a retain NLL ratio ``1 + a·α^p`` and a forget ratio ``1 + b·α`` (both rising
with α, as the search assumes), so the best feasible candidate of an arm is known exactly: the α
where ``1 + a·α^p`` reaches the limit.
"""

from __future__ import annotations

import math
import random

import pytest

from service.calibration.search import (
    Arm,
    Candidate,
    Outcome,
    SearchSettings,
    next_alpha,
    pareto_front,
    recommend,
    search,
)


def arm(name: str, scaling: str = "uniform") -> Arm:
    return Arm(name, None if name == "all" else (name,), None, scaling)


class Synthetic:
    """Arms with known curves; counts the evaluations each arm received."""

    def __init__(self, curves: dict[Arm, tuple[float, float, float]]) -> None:
        self.curves = curves  # arm -> (a, p, b)
        self.calls: list[tuple[Arm, float]] = []

    def __call__(self, which: Arm, alpha: float) -> Outcome:
        self.calls.append((which, alpha))
        a, p, b = self.curves[which]
        return Outcome(forget_ratio=1 + b * alpha, retain_ratio=1 + a * alpha**p)

    def boundary(self, which: Arm, limit: float, alpha_max: float) -> float:
        a, p, _ = self.curves[which]
        return min(((limit - 1) / a) ** (1 / p), alpha_max)

    def optimum(self, limit: float, alpha_max: float) -> float:
        """The best feasible forget ratio over every arm, exactly."""
        return max(1 + b * self.boundary(w, limit, alpha_max) for w, (_, _, b) in self.curves.items())


def candidate(index: int, forget: float, retain: float, limit: float = 2.0) -> Candidate:
    return Candidate(index, arm("all"), 1.0, Outcome(forget, retain), retain <= limit, "coarse")


def test_pareto_front_keeps_exactly_the_undominated_points() -> None:
    points = [
        candidate(0, 10.0, 1.5),
        candidate(1, 8.0, 1.6),  # dominated by 0 (less forgetting, more damage)
        candidate(2, 20.0, 3.0),
        candidate(3, 10.0, 1.5),  # equal to 0: both kept
        candidate(4, 5.0, 1.1),
        candidate(5, 20.0, 3.5),  # dominated by 2 (same forgetting, more damage)
    ]
    assert [c.index for c in pareto_front(points)] == [4, 0, 3, 2]
    assert pareto_front([]) == []


def test_recommend_is_the_feasible_candidate_that_forgets_most() -> None:
    points = [candidate(0, 10.0, 1.5), candidate(1, 30.0, 2.5), candidate(2, 12.0, 1.9), candidate(3, 12.0, 1.8)]
    assert recommend(points).index == 3  # ties on forgetting: the one with less retain damage
    assert recommend([candidate(0, 30.0, 2.5)]) is None


def test_one_arm_is_bracketed_then_refined_to_the_constraint() -> None:
    curves = Synthetic({arm("all"): (0.5, 2.0, 10.0)})  # retain 1 + 0.5 α²: the limit 2 is reached at α = √2
    settings = SearchSettings(limit=2.0, budget=40)
    result = search([arm("all")], curves, settings)
    alphas = [c.alpha for c in result.candidates]
    assert alphas[:2] == [1.0, 2.0]  # coarse: α = 1 feasible, then doubled: infeasible, bracketed
    assert [c.stage for c in result.candidates[:2]] == ["coarse", "coarse"]
    assert all(c.stage == "fine" for c in result.candidates[2:])
    assert result.stopped == "converged"
    best = recommend(result.candidates)
    assert best is not None and best.feasible
    assert math.sqrt(2) / (1 + settings.tol) <= best.alpha <= math.sqrt(2)  # within the tolerance, below the boundary
    grid = math.ceil(math.log(settings.alpha_max / settings.alpha_min) / math.log(1 + settings.tol)) + 1
    assert len(result.candidates) <= 8 < grid  # the same resolution as a grid of 442 strengths


def test_an_arm_feasible_everywhere_stops_at_alpha_max() -> None:
    curves = Synthetic({arm("all"): (0.001, 1.0, 1.0)})
    result = search([arm("all")], curves, SearchSettings(limit=2.0, budget=40, alpha_max=4.0))
    assert [c.alpha for c in result.candidates] == [1.0, 2.0, 4.0]
    assert result.stopped == "converged"


def test_an_arm_infeasible_everywhere_stops_at_alpha_min_and_recommends_nothing() -> None:
    curves = Synthetic({arm("all"): (100.0, 1.0, 1.0)})  # retain 1 + 100 α: over 2 for every α ≥ 0.05
    result = search([arm("all")], curves, SearchSettings(limit=2.0, budget=40, alpha_min=0.05))
    assert [c.alpha for c in result.candidates] == [1.0, 0.5, 0.25, 0.125, 0.0625, 0.05]
    assert recommend(result.candidates) is None


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 9, 17])
def test_the_budget_is_never_exceeded(budget: int) -> None:
    arms = [arm(n, s) for n in ("all", "qk_gate", "attention", "mlp") for s in ("uniform", "weight_norm")]
    rng = random.Random(budget)
    curves = Synthetic({w: (rng.uniform(0.1, 3), rng.uniform(1, 3), rng.uniform(1, 40)) for w in arms})
    result = search(arms, curves, SearchSettings(limit=2.0, budget=budget))
    assert len(result.candidates) == len(curves.calls) <= budget
    assert result.stopped == "budget" or (result.stopped == "converged" and budget > 9)
    assert len({(c.arm, c.alpha) for c in result.candidates}) == len(result.candidates)  # never the same twice
    if budget < len(arms):  # round-robin: the first arms once each, the rest never reached
        assert [c.arm for c in result.candidates] == arms[:budget]
        assert result.unexplored == [w.name for w in arms[budget:]]


def test_a_dominated_arm_is_pruned_and_the_budget_goes_to_the_promising_one() -> None:
    strong, weak = arm("qk_gate"), arm("mlp")
    # weak: forgets little (×1 + 0.5α) and damages much; strong forgets ×(1 + 20α) at α ≤ ~1.41.
    curves = Synthetic({strong: (0.5, 2.0, 20.0), weak: (2.0, 1.0, 0.5)})
    result = search([weak, strong], curves, SearchSettings(limit=2.0, budget=30))
    per_arm = {w: sum(1 for c in result.candidates if c.arm == w) for w in (strong, weak)}
    assert weak.name in result.pruned
    assert per_arm[weak] <= 2 < per_arm[strong]
    assert recommend(result.candidates).arm == strong


def test_search_reaches_the_optimum_on_random_monotone_arms_with_fewer_evaluations_than_the_grid() -> None:
    """Over random arm sets, within the budget, the recommendation is within 5% of the exact optimum,
    and at least as good as the best point of a uniform grid of α (0.05 to 1 by 0.05) over the same arms."""
    rng = random.Random(7)
    arms = [arm(n, s) for n in ("all", "qk_gate", "attention", "mlp") for s in ("uniform", "weight_norm")]
    for _ in range(30):
        curves = Synthetic({w: (rng.uniform(0.2, 4), rng.uniform(1, 3), rng.uniform(1, 40)) for w in arms})
        grid_alphas = [round(0.05 * k, 2) for k in range(1, 21)]
        grid = [curves(w, a) for w in arms[:2] for a in grid_alphas]  # {all, qk_gate} × uniform α: 40 points
        grid_best = max((o.forget_ratio for o in grid if o.retain_ratio <= 2.0), default=0.0)
        curves.calls.clear()
        result = search(arms, curves, SearchSettings(limit=2.0, budget=32, alpha_max=4.0))
        best = recommend(result.candidates)
        assert best is not None
        assert len(result.candidates) <= 32 < 40
        assert best.outcome.forget_ratio >= grid_best
        assert best.outcome.forget_ratio >= 0.95 * curves.optimum(2.0, 4.0)


def test_next_alpha_interpolates_inside_the_bracket() -> None:
    state_arm = arm("all")
    from service.calibration.search import _ArmState

    state = _ArmState(state_arm)
    settings = SearchSettings(limit=2.0, budget=10)
    state.points = [
        Candidate(0, state_arm, 1.0, Outcome(5.0, 1.5), True, "coarse"),
        Candidate(1, state_arm, 2.0, Outcome(9.0, 4.0), False, "coarse"),
    ]
    alpha, stage = next_alpha(state, settings)
    assert stage == "fine" and 1.0 < alpha < 2.0
    # log(1.5/2) / (log(1.5/2) - log(4/2)) of the way in log α: the retain curve's crossing, linearly
    t = math.log(0.75) / (math.log(0.75) - math.log(2.0))
    assert alpha == pytest.approx(2.0**t)


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="alpha_min < alpha_max"):
        SearchSettings(limit=2.0, budget=3, alpha_min=2.0, alpha_max=1.0)
    with pytest.raises(ValueError, match="budget"):
        SearchSettings(limit=2.0, budget=0)
    with pytest.raises(ValueError, match="distinct"):
        search([arm("all"), arm("all")], Synthetic({}), SearchSettings(limit=2.0, budget=3))
