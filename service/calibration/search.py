"""The calibration search: the strongest edit that keeps the retain probes within a constraint.

Pure Python (no torch, no storage): the job hands it the arms of the edit space and a function
that evaluates one candidate, and it decides which candidates to evaluate within a budget.

An *arm* is a module set × layer set × scaling (with, for some, per-module-type strengths); a
*candidate* is an arm at a strength ``α``. Two observations make a search much cheaper than a full grid:

* Along one arm, the retain NLL ratio rises with ``α`` (a stronger edit disturbs more), so the arm's
  best feasible candidate sits at the largest ``α`` whose retain ratio meets the constraint. Each arm
  is first *bracketed* (coarse: from ``α_start``, doubling or halving until one feasible and one
  infeasible ``α`` enclose the boundary), then *refined* (fine: the boundary interpolated in
  ``log α`` on ``log(retain ratio / limit)``, kept inside the bracket's middle 80%), until the
  bracket is narrower than ``tol``.
* The forget NLL ratio rises with ``α`` too, so an arm can never feasibly beat the forget ratio of
  its smallest infeasible ``α``: that is its upper bound. An arm whose bound is at most the best
  feasible forget ratio found anywhere (the *incumbent*) is pruned (branch and bound): it receives
  no more evaluations.

Two safeguards keep the refinement from spending the budget where it cannot win:

* An arm that trails the incumbent is stepped at least as far as where its forget ratio,
  interpolated linearly in ``log α`` on ``log(forget ratio)``, would reach the incumbent. One
  evaluation there either finds a better candidate or, infeasible, cuts the arm's bound to about
  the incumbent, which prunes it. On mini-TOFU (``tests/e2e/test_calibrate_tofu.py``) an arm
  bounded by ×64 forget whose crossing forgets ×2.8 is pruned by one such step; interpolating
  its crossing took five, and a budget of 32 then ended two steps short of the best arm's crossing
  (×26.3 against the grid's ×29.3; with the step: ×29.9 in 29 evaluations).
* Interpolation on a curved retain ratio creeps along one end of the bracket (regula falsi), so
  the other end, which holds the bound, never moves. After ``k ≥ 2`` fine steps on the same side,
  the other end's value is divided by ``2^(k-1)`` (the Illinois rule), so that end moves soon.

Arms not yet bracketed are stepped round-robin; once every live arm is bracketed, the budget goes
to the arm with the highest bound. Both monotonicities are assumptions about the model, not
guarantees: where they fail the search still returns the best feasible candidate it evaluated, and
every candidate is reported.

This search serves the default objective only (the forget NLL ratio under ``max_retain_nll_ratio``),
for which both monotonicities are expected. A named objective (``objective`` in the request: TOFU's
Overall, say) is not monotone in ``α`` and has no such bound: :mod:`service.calibration.goal_search`
searches it, without pruning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

# service.engine.compose.Scaling's values, spelled here so the search stays free of torch and a
# stored request's arms validate as Arms.
Scaling = Literal["uniform", "weight_norm"]

__all__ = ["Arm", "Candidate", "Outcome", "SearchResult", "SearchSettings", "pareto_front", "recommend", "search"]


@dataclass(frozen=True)
class Arm:
    """One direction of the edit space.

    Attributes:
        module_set: the module set's name (``all``, ``qk_gate``, ``attention``, ``mlp``, or the
            suffixes of a custom set joined by ``+``).
        modules: module-name suffixes as a variant takes them (``None``: every layer).
        layers: block indices (``None``: every block, and the layers outside them).
        scaling: ``uniform`` or ``weight_norm``.
        weighted: each module type edited at its own strength, from the data-weighted map (the
            ``data_weighted`` module set); the job measures them into ``strengths`` before the search.
        strengths: ``(suffix, s)`` per module type, the variant's ``module_strengths`` (empty: all 1).

    A calibration's stored request holds its arms in this shape (pydantic validates and dumps the
    dataclass): every field but ``strengths``, which the job measures; a request stored before
    data_weighted has no ``weighted`` (none was), and any other key is refused.
    """

    __pydantic_config__ = ConfigDict(extra="forbid")

    module_set: str
    modules: tuple[str, ...] | None
    layers: tuple[int, ...] | None
    scaling: Scaling
    weighted: bool = False
    strengths: Annotated[tuple[tuple[str, float], ...], Field(exclude=True)] = ()

    @property
    def name(self) -> str:
        blocks = "" if self.layers is None else "@" + ",".join(map(str, self.layers))
        return f"{self.module_set}{blocks}/{self.scaling}"


@dataclass(frozen=True)
class Outcome:
    """What one evaluation measured: mean answer NLL ratios (variant / base) on the probes."""

    forget_ratio: float
    retain_ratio: float


@dataclass(frozen=True)
class Candidate:
    """An evaluated candidate, in evaluation order."""

    index: int
    arm: Arm
    alpha: float
    outcome: Outcome
    feasible: bool
    stage: str  # "coarse" (bracketing) or "fine" (refining a bracket)
    metrics: Mapping[str, float] = field(default_factory=dict)  # a goal search's measured metrics (see goal_search)


@dataclass(frozen=True)
class SearchSettings:
    """The search's knobs.

    Attributes:
        limit: the constraint, the largest acceptable retain NLL ratio.
        budget: the most candidates evaluated.
        alpha_min / alpha_max: the strengths searched.
        alpha_start: where every arm starts (clamped into the range).
        growth: the coarse step, a factor on ``α``.
        tol: an arm is done when its bracket's ``α_hi / α_lo ≤ 1 + tol``.
    """

    limit: float
    budget: int
    alpha_min: float = 0.05
    alpha_max: float = 4.0
    alpha_start: float = 1.0
    growth: float = 2.0
    tol: float = 0.01

    def __post_init__(self) -> None:
        if not (self.limit > 0 and math.isfinite(self.limit)):
            raise ValueError(f"limit must be a positive number, got {self.limit}")
        if self.budget < 1:
            raise ValueError(f"budget must be at least 1, got {self.budget}")
        if not (0 < self.alpha_min < self.alpha_max):
            raise ValueError(f"need 0 < alpha_min < alpha_max, got {self.alpha_min}, {self.alpha_max}")
        if self.growth <= 1 or self.tol <= 0:
            raise ValueError("growth must exceed 1 and tol must be positive")


@dataclass
class _ArmState:
    arm: Arm
    points: list[Candidate] = field(default_factory=list)
    pruned: bool = False

    def feasible_alphas(self) -> list[float]:
        return [p.alpha for p in self.points if p.feasible]

    def bracket(self) -> tuple[Candidate | None, Candidate | None]:
        """(largest feasible candidate, smallest infeasible candidate above it); either may be None."""
        feasible = [p for p in self.points if p.feasible]
        lo = max(feasible, key=lambda p: p.alpha, default=None)
        above = [p for p in self.points if not p.feasible and (lo is None or p.alpha > lo.alpha)]
        return lo, min(above, key=lambda p: p.alpha, default=None)

    def best_feasible(self) -> Candidate | None:
        return max((p for p in self.points if p.feasible), key=_rank, default=None)


def _rank(candidate: Candidate) -> tuple[float, float, float]:
    """Better first: more forgetting, then less retain damage, then the gentler edit."""
    return candidate.outcome.forget_ratio, -candidate.outcome.retain_ratio, -candidate.alpha


@dataclass(frozen=True)
class SearchResult:
    """Every evaluated candidate, the arms pruned, and why the search stopped."""

    candidates: list[Candidate]
    pruned: list[str]
    unexplored: list[str]
    stopped: str  # "budget" or "converged"


def next_alpha(state: _ArmState, settings: SearchSettings, incumbent: float = -math.inf) -> tuple[float, str] | None:
    """The arm's next strength and its stage, or None when the arm is done.

    Args:
        state: the arm and its candidates.
        settings: the constraint and the strengths.
        incumbent: the best feasible forget ratio of any arm: a fine step goes at least as far as
            where this arm's forget ratio would reach it (see the module docstring).
    """
    if not state.points:
        return min(max(settings.alpha_start, settings.alpha_min), settings.alpha_max), "coarse"
    lo, hi = state.bracket()
    if hi is None:  # every candidate so far is feasible: go stronger
        assert lo is not None
        if lo.alpha >= settings.alpha_max * (1 - 1e-9):
            return None
        return min(settings.alpha_max, lo.alpha * settings.growth), "coarse"
    if lo is None:  # every candidate so far is infeasible: go gentler
        if hi.alpha <= settings.alpha_min * (1 + 1e-9):
            return None
        return max(settings.alpha_min, hi.alpha / settings.growth), "coarse"
    if hi.alpha / lo.alpha <= 1 + settings.tol:
        return None
    t = max(_crossing(state, lo, hi, settings.limit), _overtaking(lo, hi, incumbent))
    return _at(lo, hi, t), "fine"


def _same_side(state: _ArmState) -> int:
    """How many of the arm's last candidates are fine steps on the same side of the constraint."""
    run = 0
    for point in reversed(state.points):
        if point.stage != "fine" or point.feasible != state.points[-1].feasible:
            break
        run += 1
    return run


def _crossing(state: _ArmState, lo: Candidate, hi: Candidate, limit: float) -> float:
    """Where ``log(retain ratio / limit)`` crosses zero, as a fraction of the bracket in ``log α``.

    The Illinois rule: when the last ``k ≥ 2`` fine steps moved the same end, the other end's value
    counts ``2^(1-k)`` of itself, so the step reaches past the crossing and that end moves too.
    """
    g_lo = math.log(max(lo.outcome.retain_ratio, 1e-12) / limit)
    g_hi = math.log(max(hi.outcome.retain_ratio, 1e-12) / limit)
    run = _same_side(state)
    if run >= 2:
        if state.points[-1].feasible:
            g_hi /= 2 ** (run - 1)
        else:
            g_lo /= 2 ** (run - 1)
    return g_lo / (g_lo - g_hi) if g_hi > g_lo else 0.5


def _overtaking(lo: Candidate, hi: Candidate, incumbent: float) -> float:
    """Where the arm's forget ratio would reach the incumbent, as a fraction of the bracket in
    ``log α`` (``log`` of the forget ratio interpolated); 0 where its feasible end already does."""
    if not 0 < lo.outcome.forget_ratio < incumbent < hi.outcome.forget_ratio:
        return 0.0
    f_lo, f_hi = math.log(lo.outcome.forget_ratio), math.log(hi.outcome.forget_ratio)
    return (math.log(incumbent) - f_lo) / (f_hi - f_lo)


def _at(lo: Candidate, hi: Candidate, t: float) -> float:
    """The strength a fraction ``t`` of the bracket up in ``log α``, kept within its middle 80%: an
    end is already measured, and a step at it would not shrink the bracket."""
    t = min(max(t, 0.1), 0.9)
    return math.exp(math.log(lo.alpha) + t * (math.log(hi.alpha) - math.log(lo.alpha)))


def _upper_bound(state: _ArmState, settings: SearchSettings) -> float:
    """The most forgetting the arm can still offer feasibly (see the module docstring)."""
    lo, hi = state.bracket()
    if hi is not None:
        return hi.outcome.forget_ratio
    if next_alpha(state, settings) is None:  # done without an infeasible point above: nothing left to gain
        best = state.best_feasible()
        return best.outcome.forget_ratio if best else -math.inf
    return math.inf


def _bracketed(state: _ArmState) -> bool:
    lo, hi = state.bracket()
    return lo is not None and hi is not None


def search(arms: Sequence[Arm], evaluate: Callable[[Arm, float], Outcome], settings: SearchSettings) -> SearchResult:
    """Search the arms for the strongest feasible edit, evaluating at most ``settings.budget`` candidates.

    Args:
        arms: the edit space (distinct arms).
        evaluate: measures one candidate (called once per candidate, in the order returned).
        settings: the constraint, the budget and the strengths.

    Returns:
        Every candidate evaluated, the arms pruned, and the arms never evaluated (budget too small).
    """
    if len(set(arms)) != len(arms):
        raise ValueError("the arms must be distinct")
    states = [_ArmState(arm) for arm in arms]
    candidates: list[Candidate] = []
    stopped = "converged"
    while True:
        chosen = _choose(states, settings, candidates)
        if chosen is None:
            break
        if len(candidates) >= settings.budget:
            stopped = "budget"
            break
        state, (alpha, stage) = chosen
        outcome = evaluate(state.arm, alpha)
        feasible = outcome.retain_ratio <= settings.limit
        candidate = Candidate(len(candidates), state.arm, alpha, outcome, feasible, stage)
        state.points.append(candidate)
        candidates.append(candidate)
    pruned = [s.arm.name for s in states if s.pruned]
    unexplored = [s.arm.name for s in states if not s.points]
    return SearchResult(candidates, pruned, unexplored, stopped)


def _arm_rank(state: _ArmState) -> tuple[float, float, float]:
    """An arm's best feasible point's rank; an arm with none ranks last."""
    best = state.best_feasible()
    return _rank(best) if best is not None else (-math.inf, -math.inf, -math.inf)


def _choose(
    states: list[_ArmState], settings: SearchSettings, candidates: list[Candidate]
) -> tuple[_ArmState, tuple[float, str]] | None:
    """The next arm to step: unbracketed arms round-robin (fewest points first), then the live arm
    with the highest upper bound. Prunes dominated arms first."""
    incumbent = max((c.outcome.forget_ratio for c in candidates if c.feasible), default=-math.inf)
    best_arm = max(states, key=_arm_rank)
    live: list[tuple[_ArmState, tuple[float, str]]] = []
    for state in states:
        if state.pruned:
            continue
        step = next_alpha(state, settings, incumbent)
        if step is None:
            continue
        if state is not best_arm and _upper_bound(state, settings) <= incumbent:
            state.pruned = True
            continue
        live.append((state, step))
    if not live:
        return None
    coarse = [item for item in live if not _bracketed(item[0])]
    if coarse:
        return min(coarse, key=lambda item: len(item[0].points))  # stable: arms in the order given
    return max(live, key=lambda item: (_upper_bound(item[0], settings), -len(item[0].points)))


def pareto_front(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates no other beats on both counts (more forgetting and no more retain damage, or
    less damage and no less forgetting), by increasing retain ratio. Equal points are all kept."""
    front = []
    for c in candidates:
        f, r = c.outcome.forget_ratio, c.outcome.retain_ratio
        dominated = any(
            (o.outcome.forget_ratio >= f and o.outcome.retain_ratio <= r)
            and (o.outcome.forget_ratio > f or o.outcome.retain_ratio < r)
            for o in candidates
        )
        if not dominated:
            front.append(c)
    return sorted(front, key=lambda c: (c.outcome.retain_ratio, -c.outcome.forget_ratio, c.index))


def recommend(candidates: Sequence[Candidate]) -> Candidate | None:
    """The feasible candidate that forgets most (ties: less retain damage, then the smaller α), or None."""
    return max((c for c in candidates if c.feasible), key=_rank, default=None)
