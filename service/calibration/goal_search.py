"""The calibration search for a named objective under named constraints (TOFU's scores, say).

Pure Python (no torch, no storage), like :mod:`service.calibration.search`: the job hands it the
arms and a function that measures one candidate's metrics, and it decides which candidates to
evaluate within a budget.

What is assumed, and for which objective:

* The branch and bound of :mod:`service.calibration.search` needs the objective to rise with ``α``
  along an arm (the forget NLL ratio does), so that an arm's best feasible candidate sits on its
  feasibility boundary. Overall does not: its Privacy part peaks where the unlearned model's
  forget losses look like the retain model's, and falls again past it (an over-edited model is as
  recognisable as an untouched one). No upper bound of an arm can be read off its points, so no
  arm is pruned here.
* What this search assumes instead, per arm: the constraints are met on one interval of ``α``
  (the constraint metric is monotone in ``α``, or near enough: model utility falls as the edit
  grows), and the objective is unimodal on it (it has one peak; a monotone objective is the
  special case whose peak is the interval's end). Then the best feasible ``α`` of an arm lies
  between the evaluated neighbours of its best evaluated feasible point, and shrinking that bracket
  finds it. Where the assumptions fail the search still returns the best feasible candidate it
  evaluated, and every candidate is reported.

The search, with ``budget`` evaluations:

1. *coarse*: every arm on the same geometric grid of ``coarse`` strengths from ``α_min`` to
   ``α_max``, round-robin (so a small budget spreads over the arms);
2. *fine*: the arm whose best point is best (feasible first, by objective, then the tie-break
   below; an arm with no feasible point by its smallest constraint violation) is refined at the
   geometric midpoint of the wider gap between its best point and its evaluated neighbours; an
   infeasible point counts as worse than any feasible one, so the bracket closes on the
   feasibility boundary when the peak lies beyond it (a golden-section-like shrink of the bracket
   around the best). An arm is done when both gaps are within a factor ``1 + tol``; the next arm
   is then refined.

*Ties on the objective.* Overall is a harmonic mean: one part at 0 (Privacy within a Utility floor,
say) makes it 0 at every candidate. Ranked by the objective alone, every feasible point would then
tie, the gentlest edit would win, and the fine phase would refine around ``α_min``, improving
nothing. Candidates that tie exactly on the objective are therefore ranked by the other TOFU
aggregates, in :func:`tie_break_order`'s order (for ``overall``: ``memorization``, then ``utility``,
then ``privacy``; for any other objective: ``overall``, then those three), each higher is better
(TOFU's aggregates are scores), a missing one ranking last; then by the gentler edit. The fine
phase picks its arm and its point by the same rank, so on a flat objective it refines toward the
best memorization within the bounds, and the recommendation is the best on the tie-break.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from service.calibration.search import Arm, Candidate, Outcome, SearchResult

__all__ = [
    "AGGREGATES",
    "Bound",
    "Goal",
    "GoalSettings",
    "goal_rank",
    "goal_search",
    "ranked_for_goal",
    "recommend_for_goal",
    "tie_break_order",
    "violation",
]

Sense = Literal["maximize", "minimize"]

# TOFU's aggregate scores (higher is better), in the order that breaks a tie on the objective.
AGGREGATES = ("overall", "memorization", "utility", "privacy")


# An exact-match objective ties often (a share of a few probes). The retain exact match breaks the tie
# first (of two edits that forget as much, users keep the one that keeps more answers: on SmolLM2 the
# edit on the retain floor kept 80% of unseen kept facts), then the NLL ratios: the forget ratio higher
# (the edit reaches further past the answers), the retain ratio and the perplexity lower.
EXACT_MATCH_TIE_BREAK = (
    ("retain_exact_match", 1.0),
    ("forget_nll_ratio", 1.0),
    ("retain_nll_ratio", -1.0),
    ("perplexity_ratio", -1.0),
)


def signed_tie_break(objective: str) -> tuple[tuple[str, float], ...]:
    """The metrics that rank candidates tying on ``objective``, each with the sign that makes higher better."""
    if objective == "forget_exact_match":
        return EXACT_MATCH_TIE_BREAK
    return tuple((name, 1.0) for name in tie_break_order(objective))


def tie_break_order(objective: str) -> tuple[str, ...]:
    """The metrics that rank candidates tying on ``objective``, first first: the aggregates but the
    objective itself (for ``overall``: memorization, utility, privacy: the part Engram moves first,
    then the one the floor protects; for any other objective, Overall leads)."""
    return tuple(name for name in AGGREGATES if name != objective)


@dataclass(frozen=True)
class Bound:
    """A constraint on one metric, in absolute terms (a bound relative to the base model is
    resolved to an absolute one before the search: the base's value times the ratio)."""

    metric: str
    min: float | None = None
    max: float | None = None

    def __post_init__(self) -> None:
        if self.min is None and self.max is None:
            raise ValueError(f"the constraint on {self.metric} has no bound")
        for value in (self.min, self.max):
            if value is not None and math.isnan(value):
                raise ValueError(f"the constraint on {self.metric} has a NaN bound")

    def violation(self, value: float | None) -> float:
        """How far ``value`` is outside the bound (0: within it; a missing or NaN value: infinitely)."""
        if value is None or math.isnan(value):
            return math.inf
        below = (self.min - value) if self.min is not None and value < self.min else 0.0
        above = (value - self.max) if self.max is not None and value > self.max else 0.0
        return max(below, above)


@dataclass(frozen=True)
class Goal:
    """What the search optimises: ``sense`` of ``objective`` with every bound met."""

    objective: str
    sense: Sense
    bounds: tuple[Bound, ...] = ()

    def score(self, metrics: Mapping[str, float]) -> float:
        """The objective signed so that higher is better; a missing or NaN value ranks last."""
        value = _value(metrics, self.objective)
        return value if self.sense == "maximize" or value == -math.inf else -value

    def tie_break(self, metrics: Mapping[str, float]) -> tuple[float, ...]:
        """The :func:`signed_tie_break` metrics' values, signed so that higher is better (missing or NaN: last)."""
        values = []
        for name, sign in signed_tie_break(self.objective):
            value = _value(metrics, name)
            values.append(value if value == -math.inf else sign * value)
        return tuple(values)


def _value(metrics: Mapping[str, float], name: str) -> float:
    value = metrics.get(name)
    return -math.inf if value is None or math.isnan(value) else value


def violation(goal: Goal, metrics: Mapping[str, float]) -> float:
    """The sum of the bounds' violations (0: feasible)."""
    return sum(bound.violation(metrics.get(bound.metric)) for bound in goal.bounds)


@dataclass(frozen=True)
class GoalSettings:
    """The search's knobs: the budget, the strengths, the coarse grid and when an arm is done."""

    budget: int
    alpha_min: float = 0.05
    alpha_max: float = 4.0
    coarse: int = 6
    tol: float = 0.02

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget must be at least 1, got {self.budget}")
        if not (0 < self.alpha_min < self.alpha_max):
            raise ValueError(f"need 0 < alpha_min < alpha_max, got {self.alpha_min}, {self.alpha_max}")
        if self.coarse < 2 or self.tol <= 0:
            raise ValueError("coarse must be at least 2 and tol positive")

    def grid(self) -> list[float]:
        """The coarse strengths: geometric from ``α_min`` to ``α_max``, both ends included."""
        step = math.log(self.alpha_max / self.alpha_min) / (self.coarse - 1)
        inner = [self.alpha_min * math.exp(step * k) for k in range(1, self.coarse - 1)]
        return [self.alpha_min, *inner, self.alpha_max]


def goal_rank(goal: Goal, candidate: Candidate) -> tuple[float, ...]:
    """Higher is better: feasible before infeasible, then the objective, then the tie-break
    (:meth:`Goal.tie_break`), then the gentler edit; an infeasible candidate: the smaller violation,
    then the tie-break, then the gentler edit."""
    first = goal.score(candidate.metrics) if candidate.feasible else -violation(goal, candidate.metrics)
    return (1.0 if candidate.feasible else 0.0), first, *goal.tie_break(candidate.metrics), -candidate.alpha


@dataclass
class _Arm:
    arm: Arm
    points: list[Candidate] = field(default_factory=list)
    done: bool = False

    def best(self, goal: Goal) -> Candidate | None:
        return max(self.points, key=lambda c: goal_rank(goal, c), default=None)

    def next_alpha(self, goal: Goal, settings: GoalSettings) -> float | None:
        """The midpoint (in ``log α``) of the wider gap beside the best point; None when both
        gaps are within ``1 + tol`` (or at the range's ends)."""
        best = self.best(goal)
        if best is None:
            return None
        alphas = sorted({p.alpha for p in self.points})
        i = alphas.index(best.alpha)
        gaps = []
        if i > 0:
            gaps.append((alphas[i] / alphas[i - 1], alphas[i - 1]))
        if i + 1 < len(alphas):
            gaps.append((alphas[i + 1] / alphas[i], alphas[i + 1]))
        gaps = [(ratio, other) for ratio, other in gaps if ratio > 1 + settings.tol]
        if not gaps:
            return None
        _, other = max(gaps)
        return math.sqrt(best.alpha * other)


def goal_search(
    arms: Sequence[Arm], evaluate: Callable[[Arm, float], Mapping[str, float]], goal: Goal, settings: GoalSettings
) -> SearchResult:
    """Search the arms for the best feasible candidate (see the module docstring).

    Args:
        arms: the edit space (distinct arms).
        evaluate: one candidate's metrics (called once per candidate, in the order returned). The
            metrics ``forget_nll_ratio`` and ``retain_nll_ratio``, when present, become the
            candidate's :class:`Outcome` (NaN when absent).
        goal: the objective and the bounds.
        settings: the budget and the strengths.

    Returns:
        Every candidate evaluated (``stage`` coarse or fine), no arm pruned, the arms never evaluated.
    """
    if len(set(arms)) != len(arms):
        raise ValueError("the arms must be distinct")
    states = [_Arm(arm) for arm in arms]
    candidates: list[Candidate] = []

    def run(state: _Arm, alpha: float, stage: str) -> None:
        metrics = dict(evaluate(state.arm, alpha))
        outcome = Outcome(metrics.get("forget_nll_ratio", math.nan), metrics.get("retain_nll_ratio", math.nan))
        feasible = violation(goal, metrics) == 0.0
        candidate = Candidate(len(candidates), state.arm, alpha, outcome, feasible, stage, metrics)
        state.points.append(candidate)
        candidates.append(candidate)

    for alpha in settings.grid():  # coarse, round-robin over the arms
        for state in states:
            if len(candidates) >= settings.budget:
                return _result(states, candidates, "budget")
            run(state, alpha, "coarse")
    while True:
        live = [s for s in states if not s.done]
        if not live:
            return _result(states, candidates, "converged")
        state = max(live, key=lambda s: _arm_key(goal, s))
        step = state.next_alpha(goal, settings)
        if step is None:
            state.done = True
            continue
        if len(candidates) >= settings.budget:
            return _result(states, candidates, "budget")
        run(state, step, "fine")


def _arm_key(goal: Goal, state: _Arm) -> tuple[float, ...]:
    best = state.best(goal)
    return goal_rank(goal, best) if best is not None else (-1.0,)


def _result(states: list[_Arm], candidates: list[Candidate], stopped: str) -> SearchResult:
    unexplored = [s.arm.name for s in states if not s.points]
    return SearchResult(candidates, [], unexplored, stopped)


def recommend_for_goal(goal: Goal, candidates: Sequence[Candidate]) -> Candidate | None:
    """The feasible candidate with the best objective (ties: :meth:`Goal.tie_break`, then the
    gentler edit), or None."""
    return max((c for c in candidates if c.feasible), key=lambda c: goal_rank(goal, c), default=None)


def ranked_for_goal(goal: Goal, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The feasible candidates, best first (:func:`recommend_for_goal`'s order): the order in which
    the held-out probes validate them."""
    return sorted((c for c in candidates if c.feasible), key=lambda c: goal_rank(goal, c), reverse=True)
