"""The order in which the attack gate checks candidates (issue 37), on made-up checks: the first of the
best-ranked that meets every held-out bound and every attack constraint is recommended; a candidate
that misses an attack constraint never is; and a candidate is attacked only while it could still be
recommended."""

from __future__ import annotations

from collections.abc import Callable

from api_schemas.calibration import HeldOutCheck
from service.calibration.goal_run import HELD_OUT_TRIES, gated_on_held_out
from service.calibration.search import Arm, Candidate, Outcome

ARM = Arm("all", None, None, "uniform")


def ranked(n: int) -> list[Candidate]:
    return [Candidate(i, ARM, 1.0 / (i + 1), Outcome(2.0, 1.0), True, "coarse") for i in range(n)]


def check(feasible: set[int]) -> Callable[[Candidate], HeldOutCheck]:
    def held(candidate: Candidate) -> HeldOutCheck:
        ok = candidate.index in feasible
        return HeldOutCheck(probes={"forget": 2}, constraints=[], feasible=ok, base={}, recommended={})

    return held


def run(n: int, feasible: set[int], passing: set[int]) -> tuple[int | None, list[int] | None, list[int]]:
    attacked: list[int] = []

    def passes(candidate: Candidate) -> bool:
        attacked.append(candidate.index)
        return candidate.index in passing

    best, held = gated_on_held_out(ranked(n), check(feasible), passes)
    return (best.index if best else None), (held.rejected if held else None), attacked


def test_the_first_candidate_meeting_both_is_recommended_and_nothing_after_it_is_attacked() -> None:
    assert run(6, feasible={0, 1, 2}, passing={1, 2}) == (1, [0], [0, 1])


def test_missing_an_attack_bound_is_never_recommended() -> None:
    assert run(6, feasible={0, 1, 2, 3}, passing=set()) == (None, None, [0, 1, 2, 3])
    assert HELD_OUT_TRIES == 4  # at most four attacked, however many rank


def test_a_held_out_miss_that_passes_the_attacks_is_the_fallback_and_later_misses_are_not_attacked() -> None:
    # 0 misses a held-out bound but passes the attacks: the fallback; 1 misses held out too: not attacked;
    # 2 meets both held-out bounds but not the attacks; 3 meets neither held-out: not attacked
    assert run(4, feasible={2}, passing={0}) == (0, [1, 2, 3], [0, 2])
