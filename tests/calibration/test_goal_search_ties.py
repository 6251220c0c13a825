"""The goal search's tie-break (service.calibration.goal_search) when the objective is flat: pure, fast.

On mini-TOFU, Engram's Privacy is 0 within a Utility floor, so Overall (a harmonic mean) is 0 at
every feasible candidate. Ranked by Overall alone the gentlest edit won and the fine phase refined
around ``α_min``; ranked by the tie-break (memorization, then utility, then privacy) the search
must refine toward the best memorization the floor allows, on the arm that reaches it. The
expected optimum is computed independently (closed form or by hand) for each test.
"""

from __future__ import annotations

import math

import pytest

from service.calibration.goal_search import (
    Bound,
    Goal,
    GoalSettings,
    goal_search,
    ranked_for_goal,
    recommend_for_goal,
    tie_break_order,
)
from service.calibration.search import Arm, Candidate, Outcome

pytestmark = pytest.mark.fast

FLOOR = 0.9
GOAL = Goal("overall", "maximize", (Bound("model_utility", min=FLOOR),))


def _arm(name: str) -> Arm:
    return Arm(name, None, None, "uniform")


def _utility(alpha: float, scale: float = 3.0) -> float:
    """Falls from 1 as α grows; ``≥ 0.9`` exactly for ``α ≤ scale / 3``."""
    return 1.0 / (1.0 + (alpha / scale) ** 2)


def _memorization(alpha: float, gain: float = 1.0) -> float:
    """Rises with α (the edit forgets more), below 1."""
    return gain * alpha / (1.0 + alpha)


def test_a_flat_overall_refines_to_the_best_memorization_within_the_floor() -> None:
    # Overall 0 everywhere; memorization rises with α, so the best tie-broken candidate is on the
    # floor's boundary, α = 3 / 3 = 1 (closed form). The old rank (objective, gentler edit) chose
    # α_min = 0.05 and spent the fine phase there.
    arm = _arm("all")

    def evaluate(a: Arm, alpha: float) -> dict[str, float]:
        return {"overall": 0.0, "memorization": _memorization(alpha), "model_utility": _utility(alpha)}

    found = goal_search([arm], evaluate, GOAL, GoalSettings(budget=40, tol=0.01))
    best = recommend_for_goal(GOAL, found.candidates)
    assert best is not None and best.metrics["model_utility"] >= FLOOR
    assert best.alpha == pytest.approx(1.0, rel=0.02)
    assert best.metrics["memorization"] >= _memorization(1.0 / 1.01)
    # every refinement lies between the coarse neighbours of the best coarse point (α 0.693 on the
    # grid 0.05·80^(k/5)), not around α_min
    grid = GoalSettings(budget=40).grid()
    fine = [c.alpha for c in found.candidates if c.stage == "fine"]
    assert fine and all(grid[2] < a < grid[4] for a in fine)


def test_the_fine_phase_refines_the_arm_that_wins_the_tie_break_first() -> None:
    # both arms: Overall 0 everywhere, the same floor; "attention" (listed second) memorizes less
    # at every α, i.e. forgets more: its memorization score is twice "all"'s. The old rank tied the
    # arms (both best at α_min) and refined the first listed.
    arms = [_arm("all"), _arm("attention")]
    gains = {"all": 0.4, "attention": 0.8}

    def evaluate(a: Arm, alpha: float) -> dict[str, float]:
        return {
            "overall": 0.0,
            "memorization": _memorization(alpha, gains[a.module_set]),
            "model_utility": _utility(alpha),
        }

    settings = GoalSettings(budget=15, tol=0.01)
    found = goal_search(arms, evaluate, GOAL, settings)
    fine = [c for c in found.candidates if c.stage == "fine"]
    assert len(fine) == 15 - 2 * settings.coarse
    assert all(c.arm.module_set == "attention" for c in fine)
    best = recommend_for_goal(GOAL, found.candidates)
    assert best is not None and best.arm.module_set == "attention"
    # the coarse point below the boundary (α = 0.05·80^(3/5) = 0.696), then refined toward α = 1
    coarse_best = 0.05 * 80 ** (3 / 5)
    assert best.metrics["memorization"] > _memorization(coarse_best, 0.8)


def _candidate(index: int, alpha: float, **metrics: float) -> Candidate:
    return Candidate(index, _arm("all"), alpha, Outcome(math.nan, math.nan), True, "coarse", metrics)


def test_the_tie_break_order_is_memorization_then_utility_then_privacy() -> None:
    assert tie_break_order("overall") == ("memorization", "utility", "privacy")
    assert tie_break_order("privacy") == ("overall", "memorization", "utility")
    assert tie_break_order("exact_memorization") == ("overall", "memorization", "utility", "privacy")
    goal = Goal("overall", "maximize")
    pool = [
        _candidate(0, 0.1, overall=0.0, memorization=0.2, utility=1.0, privacy=0.0),
        _candidate(1, 0.2, overall=0.0, memorization=0.5, utility=0.8, privacy=0.0),
        _candidate(2, 0.3, overall=0.0, memorization=0.5, utility=0.9, privacy=0.0),
        _candidate(3, 0.4, overall=0.0, memorization=0.5, utility=0.9, privacy=0.1),
        _candidate(4, 0.5, overall=0.01, memorization=0.0, utility=0.1, privacy=0.0),  # the objective first
    ]
    # by hand: 4 (best Overall), then among Overall 0: memorization 0.5 (1, 2, 3) before 0.2 (0);
    # among those utility 0.9 (2, 3) before 0.8 (1); between 2 and 3, privacy 0.1 (3)
    assert [c.index for c in ranked_for_goal(goal, pool)] == [4, 3, 2, 1, 0]


def test_a_component_objective_is_tie_broken_by_overall_and_a_full_tie_by_the_gentler_edit() -> None:
    goal = Goal("privacy", "maximize")
    pool = [
        _candidate(0, 0.1, privacy=0.0, overall=0.0, memorization=0.9),
        _candidate(1, 0.2, privacy=0.0, overall=0.3, memorization=0.1),
        _candidate(2, 0.3, privacy=0.0, overall=0.3, memorization=0.1),
    ]
    best = recommend_for_goal(goal, pool)
    assert best is not None and best.index == 1  # Overall before memorization; 1 and 2 tie: the gentler
    # no aggregate measured (an NLL objective): every tie-break value ranks last alike, the gentler edit wins
    nll = Goal("forget_nll_ratio", "maximize")
    plain = [_candidate(i, a, forget_nll_ratio=2.0) for i, a in enumerate((0.4, 0.2, 0.3))]
    assert [c.index for c in ranked_for_goal(nll, plain)] == [1, 2, 0]
