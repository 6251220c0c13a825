"""The calibration search's fine steps: the overtaking step that prunes a trailing arm, and the
Illinois rule that moves both ends of a bracket (service.calibration.search's module docstring).

Each expected strength is computed here from the candidates' figures, independently of the search's
helpers; the synthetic arms have known curves, so each arm's best feasible candidate is known exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from service.calibration.search import (
    Arm,
    Candidate,
    Outcome,
    SearchSettings,
    _ArmState,
    next_alpha,
    recommend,
    search,
)

LIMIT = 2.0
STRONG = Arm("qk_gate", ("q_proj",), None, "uniform")
LOOSE = Arm("qk_gate", ("q_proj",), None, "weight_norm")
TOL = SearchSettings(limit=LIMIT, budget=1).tol  # the default bracket: α within 1% of the crossing


def point(index: int, alpha: float, forget: float, retain: float, stage: str = "fine") -> Candidate:
    return Candidate(index, STRONG, alpha, Outcome(forget, retain), retain <= LIMIT, stage)


def bracketed(*fine: tuple[float, float, float]) -> _ArmState:
    """An arm bracketed by coarse α = 1 (forget ×5, retain ×1.5) and α = 2 (×60, ×4), then the fine
    steps given as (α, forget, retain)."""
    state = _ArmState(STRONG)
    state.points = [point(0, 1.0, 5.0, 1.5, "coarse"), point(1, 2.0, 60.0, 4.0, "coarse")]
    state.points += [point(2 + k, *figures) for k, figures in enumerate(fine)]
    return state


def step(state: _ArmState, incumbent: float = -math.inf) -> float:
    """The arm's next strength (a fine step: the arm is bracketed and not done)."""
    chosen = next_alpha(state, SearchSettings(limit=LIMIT, budget=10), incumbent)
    assert chosen is not None and chosen[1] == "fine"
    return chosen[0]


def log_between(lo: float, hi: float, t: float) -> float:
    return math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo)))


def test_a_trailing_arm_steps_to_where_its_forget_ratio_would_reach_the_incumbent() -> None:
    # the retain crossing: log(1.5/2) / (log(1.5/2) - log(4/2)) of the bracket, in log α
    crossing = log_between(1.0, 2.0, math.log(0.75) / (math.log(0.75) - math.log(2.0)))
    assert step(bracketed()) == pytest.approx(crossing)
    assert step(bracketed(), 4.0) == pytest.approx(crossing)  # lo already beats it
    # an incumbent of ×30: the forget ratio, log-interpolated between ×5 and ×60, reaches it this far up
    alpha = step(bracketed(), 30.0)
    overtaking = log_between(1.0, 2.0, math.log(30.0 / 5.0) / math.log(60.0 / 5.0))
    assert alpha == pytest.approx(overtaking) and alpha > crossing
    # near the bound, the step stays inside the bracket's middle 80%
    assert step(bracketed(), 59.0) == pytest.approx(log_between(1.0, 2.0, 0.9))


def test_after_two_fine_steps_on_one_side_the_other_end_counts_half() -> None:
    one = bracketed((1.2, 8.0, 1.7))
    g_lo, g_hi = math.log(1.7 / LIMIT), math.log(4.0 / LIMIT)
    assert step(one) == pytest.approx(log_between(1.2, 2.0, g_lo / (g_lo - g_hi)))
    two = bracketed((1.2, 8.0, 1.7), (1.3, 9.0, 1.8))  # two feasible steps: only lo moved
    g_lo = math.log(1.8 / LIMIT)
    assert step(two) == pytest.approx(log_between(1.3, 2.0, g_lo / (g_lo - g_hi / 2)))
    three = bracketed((1.2, 8.0, 1.7), (1.3, 9.0, 1.8), (1.35, 9.5, 1.9))
    g_lo = math.log(1.9 / LIMIT)
    assert step(three) == pytest.approx(log_between(1.35, 2.0, g_lo / (g_lo - g_hi / 4)))
    # two infeasible steps: hi moved twice, lo's value counts half
    down = bracketed((1.8, 40.0, 3.0), (1.6, 30.0, 2.5))
    g_lo, g_hi = math.log(1.5 / LIMIT) / 2, math.log(2.5 / LIMIT)
    assert step(down) == pytest.approx(log_between(1.0, 1.6, g_lo / (g_lo - g_hi)))


Curve = Callable[[float], float]


def curves_of(arms: dict[Arm, tuple[Curve, Curve]]) -> tuple[Callable[[Arm, float], Outcome], list[tuple[Arm, float]]]:
    """An evaluation of arms with known (forget, retain) curves, and the calls it received."""
    calls: list[tuple[Arm, float]] = []

    def evaluate(arm: Arm, alpha: float) -> Outcome:
        calls.append((arm, alpha))
        forget, retain = arms[arm]
        return Outcome(forget(alpha), retain(alpha))

    return evaluate, calls


def test_an_arm_whose_bound_is_loose_is_pruned_after_one_fine_step() -> None:
    """The shape of mini-TOFU's Q/K+Gate arms: weight_norm forgets ×64 at its infeasible α = 2 but
    only ×2.8 at its crossing, so its bound stays loose while the interpolation creeps up from below
    (five steps there, and the budget ran out before the uniform arm's crossing)."""
    arms = {
        STRONG: (lambda a: 1 + 40 * a**2, lambda a: 1 + (a / 0.75) ** 4),  # crossing 0.75: forgets ×23.5
        LOOSE: (lambda a: 1 + 0.4 * a**6, lambda a: 1 + (a / 1.45) ** 3),  # crossing 1.45: ×4.7, bound ×26.6
    }
    evaluate, _ = curves_of(arms)
    result = search([STRONG, LOOSE], evaluate, SearchSettings(limit=LIMIT, budget=14))
    fine = [c for c in result.candidates if c.arm == LOOSE and c.stage == "fine"]
    assert LOOSE.name in result.pruned and len(fine) == 1 and not fine[0].feasible
    best = recommend(result.candidates)
    optimum = 1 + 40 * 0.75**2
    assert best is not None and best.arm == STRONG
    assert optimum / (1 + TOL) ** 2 <= best.outcome.forget_ratio <= optimum  # 1% in α: 2% in forget (∝ α²)


@pytest.mark.parametrize("power", [2, 4, 8, 12])
def test_one_arm_converges_to_its_crossing_whatever_the_curvature(power: int) -> None:
    """Retain ``1 + (α/1.3)^p``: the steeper, the more plain interpolation creeps from below."""
    evaluate, calls = curves_of({STRONG: (lambda a: 1 + 10 * a, lambda a: 1 + (a / 1.3) ** power)})
    result = search([STRONG], evaluate, SearchSettings(limit=LIMIT, budget=60))
    best = recommend(result.candidates)
    assert result.stopped == "converged" and len(calls) <= 8
    assert best is not None and 1.3 / (1 + TOL) <= best.alpha <= 1.3
