"""The objective's part of a ``calibrate`` job: the base and retain models' reports, each
candidate's metrics, the result's objective fields and the held-out check of the recommendation.

Made by :func:`service.calibration.build.run_calibration` inside the job's template process (every
chat template rendered once, before any model runs), after the candidates' model is loaded and
scored as the base. The retain model is loaded once, its reports on the searched and the held-out
probes kept, and released.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from api_schemas.calibration import GoalView, HeldOutCheck, ResolvedConstraint
from api_schemas.calibration_default import GENERAL_SET
from service.calibration.candidates import InMemoryCandidates, Measured, check_probes, parse_probe, score
from service.calibration.goal import GoalSpec
from service.calibration.goal_attacks import AttackGateRun
from service.calibration.goal_scoring import metrics, own_metrics, prime, public, tofu_report
from service.calibration.goal_search import Goal, violation
from service.calibration.records import CalibrationProbes, StoredCalibrationResult
from service.calibration.search import Candidate, SearchResult
from service.context import Context
from service.engine.chat import RenderedOnce, Renderer
from service.engine.evaluate import TextProbe as Probe
from service.engine.tofu_scoring import TofuProbe, merged_cuts, tofu_probe
from service.errors import JobFailed
from service.evaluation import tofu_metrics as tm
from service.evaluation.run import load_retain_model


def _tofu_sets(raw: CalibrationProbes) -> dict[str, list[TofuProbe]]:
    """Stored probe sets (forget, retain, holdout, utility by name) as TOFU probes, empty ones dropped."""
    sets = {"forget": raw.forget, "retain": raw.retain, "holdout": raw.holdout or [], **(raw.utility or {})}
    return {name: [tofu_probe(dict(p)) for p in items] for name, items in sets.items() if items}


# Candidates the held-out probes may check before the best one is recommended unvalidated.
HELD_OUT_TRIES = 4


class GoalRun:
    """See the module docstring.

    Args:
        spec: the stored goal.
        candidates: the loaded candidates, their model at the base weights (as after construction).
        searched, held: the stored probe sets the search runs on and those held out (empty: no check).
        renderer: the job's template process, open while this is made.
    """

    def __init__(
        self,
        ctx: Context,
        job_id: str,
        spec: GoalSpec,
        candidates: InMemoryCandidates,
        searched: CalibrationProbes,
        held: CalibrationProbes,
        renderer: Renderer,
    ) -> None:
        self.spec, self.candidates = spec, candidates
        tokenizer = candidates.tokenizer
        self.has_held_out = bool(held.forget and held.retain)
        self.tofu = spec.kind != "exact_match"  # the default objective: the calibration's own metrics only
        self.gate: AttackGateRun | None = None
        self.job_id, self.ctx = job_id, ctx
        if not self.tofu:
            self._own_metrics_only(held, renderer)
            self._attack_gate()
            return
        self.sets = _tofu_sets(searched)
        self.held_sets = _tofu_sets(held)
        self.renderer = RenderedOnce(renderer)
        held_names = {f"held_out {k}": k for k in self.held_sets}
        every = {**self.sets, **{key: self.held_sets[name] for key, name in held_names.items()}}
        primed = prime(tokenizer, every, self.renderer, candidates.bound)
        self.sets = {name: primed[name] for name in self.sets}  # with their token IDs, within the probe bound
        self.held_sets = {name: primed[key] for key, name in held_names.items()}
        held_plain = {"forget": [parse_probe(p) for p in held.forget], "retain": [parse_probe(p) for p in held.retain]}
        self.held_plain = check_probes(tokenizer, held_plain, self.renderer, candidates.bound) if self.has_held_out else {}
        self.renderer.inner = None  # the template process ends with the job's block: all is rendered
        model = candidates.model  # at the base weights
        self.base_report = tofu_report(model, tokenizer, self.sets, self.renderer)
        self.base_held_summary = score(model, tokenizer, self.held_plain) if self.has_held_out else {}
        self.base_held_report = tofu_report(model, tokenizer, self.held_sets, self.renderer) if self.has_held_out else None
        self.retain_report: tm.ModelReport | None = None
        self.retain_held_report: tm.ModelReport | None = None
        if spec.retain_model is not None:
            retain = load_retain_model(ctx, spec.retain_model, tokenizer)
            self.retain_report = tofu_report(retain, tokenizer, self.sets, self.renderer)
            if self.has_held_out:
                self.retain_held_report = tofu_report(retain, tokenizer, self.held_sets, self.renderer)
        self.base_metrics = metrics(self.base_report, self.retain_report, self.base_report, candidates.base, candidates.base)
        self.goal = resolved(spec, self.base_metrics)
        self._attack_gate()

    def _attack_gate(self) -> None:
        """The attack constraints' gate (none without them), its base values measured now."""
        if self.spec.attacks:
            held = {split: self.held_plain.get(split, []) for split in ("forget", "retain")}
            self.gate = AttackGateRun(self.ctx, self.job_id, self.spec.attacks, self.candidates, held)

    def truncated(self) -> dict[str, list[bool]]:
        """Per probe set, whether each probe's prompt was cut to the probe bound: the searched probes,
        then the held-out ones (the holdout facts, used whole by both, once). A probe counts once, cut
        for its completion or for a longer TOFU answer."""
        searched = merged_cuts(self.candidates.truncated(), self.sets)
        held = merged_cuts({split: [p.cut for p in items] for split, items in self.held_plain.items()}, self.held_sets)
        held.pop("holdout", None)
        return {name: searched.get(name, []) + held.get(name, []) for name in {*searched, *held}}

    def _own_metrics_only(self, held: CalibrationProbes, renderer: Renderer) -> None:
        """The default objective's set-up: no TOFU report, the held-out forget, retain and general
        probes scored as the searched ones are (:func:`plain_sets`)."""
        candidates = self.candidates
        self.sets, self.held_sets = {}, {}
        self.retain_report = self.retain_held_report = self.base_held_report = None
        self.held_plain = {}
        if self.has_held_out:
            self.held_plain = check_probes(candidates.tokenizer, plain_sets(held), renderer, candidates.bound)
        self.base_held_summary = score(candidates.base_model(), candidates.tokenizer, self.held_plain)
        self.base_metrics = own_metrics(candidates.base, candidates.base)
        self.goal = resolved(self.spec, self.base_metrics)

    def candidate_metrics(self, measured: Measured) -> dict[str, float]:
        """The metrics of the candidate now applied to the model (its NLL summary measured)."""
        if not self.tofu:
            return own_metrics(measured.summary, self.candidates.base)
        report = tofu_report(self.candidates.model, self.candidates.tokenizer, self.sets, self.renderer)
        return metrics(report, self.retain_report, self.base_report, measured.summary, self.candidates.base)

    def check_held_out(self, best: Candidate) -> HeldOutCheck:
        """The recommended candidate on the held-out probes, its bounds resolved with the base's
        values on those probes (a ratio to the base is a ratio to the base on the same probes)."""
        tokenizer = self.candidates.tokenizer
        model = self.candidates.applied(best.arm, best.alpha)
        summary = score(model, tokenizer, self.held_plain)
        base_summary = self.base_held_summary
        if self.tofu:
            assert self.base_held_report is not None
            report = tofu_report(model, tokenizer, self.held_sets, self.renderer)
            held = metrics(report, self.retain_held_report, self.base_held_report, summary, base_summary)
            base_report = self.base_held_report
            base = metrics(base_report, self.retain_held_report, base_report, base_summary, base_summary)
        else:
            held, base = own_metrics(summary, base_summary), own_metrics(base_summary, base_summary)
        goal = resolved(self.spec, base)
        return HeldOutCheck(
            probes={name: len(items) for name, items in self.held_sets.items() if name != "holdout"}
            if self.tofu
            else {name: len(items) for name, items in self.held_plain.items()},
            margins=margins(goal, held),
            constraints=resolved_bounds(goal, base),
            feasible=violation(goal, held) == 0.0,
            base=public(base),
            recommended=public(held),
        )

    def validated_on_held_out(self, ranked: Sequence[Candidate]) -> tuple[Candidate | None, HeldOutCheck | None]:
        """The best-ranked candidate that meets the bounds on the held-out probes too, and its check
        (:func:`validated_on_held_out`); with attack constraints, one that meets them too, or none
        (:func:`gated_on_held_out`)."""
        if self.gate is None:
            return validated_on_held_out(ranked, self.check_held_out)
        return gated_on_held_out(ranked, self.check_held_out, self.gate.passes)

    def amend(self, result: StoredCalibrationResult, found: SearchResult, best: Candidate | None) -> StoredCalibrationResult:
        """The result with the objective's fields (``assemble`` wrote the NLL search's) and the attack
        gate's: each attacked candidate's scores, and the note when every one missed a bound."""
        retain = None
        if self.retain_report is not None:
            retain = public(tm.tofu_scores(self.retain_report, self.retain_report, self.base_report).values)
        amended = amend_goal_result(result, found, best, self.spec, self.goal, self.base_metrics, retain)
        if self.gate is None:
            return amended
        attacked = self.gate.rows()
        rows = [row.model_copy(update={"attacked": attacked.get(row.index)}) for row in amended.candidates]
        update: dict[str, object] = {"candidates": rows, "attack_gate": self.gate.report()}
        if best is None and attacked:
            update["note"] = self.gate.note(sum(c.feasible for c in found.candidates))
        return amended.model_copy(update=update)


def validated_on_held_out(
    ranked: Sequence[Candidate], check: Callable[[Candidate], HeldOutCheck]
) -> tuple[Candidate, HeldOutCheck]:
    """The best-ranked candidate that meets the bounds on the held-out probes too, and its check.

    The search puts the best candidate on a bound's boundary (the objective pushes the edit as far
    as the floor allows), so on other probes it meets the bound about half the time: sampling
    noise, not a worse edit. The held-out probes therefore *validate* the choice: candidates are
    checked in rank order, at most :data:`HELD_OUT_TRIES` of them, and the first that meets every
    bound there is recommended (the next ranks are gentler edits, with room under the bound).
    When none does, the best is recommended with ``feasible: false``. ``rejected`` lists the
    candidates that failed the check; a test set the choice never saw stays with the user.
    """
    rejected: list[int] = []
    first: HeldOutCheck | None = None
    for candidate in ranked[:HELD_OUT_TRIES]:
        checked = check(candidate)
        first = first or checked
        if checked.feasible:
            return candidate, checked.model_copy(update={"candidate": candidate.index, "rejected": rejected})
        rejected.append(candidate.index)
    assert first is not None, "validated_on_held_out needs at least one candidate"
    return ranked[0], first.model_copy(update={"candidate": ranked[0].index, "rejected": rejected})


def gated_on_held_out(
    ranked: Sequence[Candidate], check: Callable[[Candidate], HeldOutCheck], passes: Callable[[Candidate], bool]
) -> tuple[Candidate | None, HeldOutCheck | None]:
    """:func:`validated_on_held_out` behind the attack gate: of the same :data:`HELD_OUT_TRIES`
    best-ranked candidates, the first that meets every bound and every attack constraint on the
    held-out probes; else the first that meets the attack constraints (``feasible: false``, as the
    ungated check recommends its best); else none (``(None, None)``): a candidate that misses an
    attack constraint is never recommended. A candidate is attacked only while it could still be
    recommended (one that misses a held-out bound after a fallback is found is not)."""
    rejected: list[int] = []
    fallback: tuple[Candidate, HeldOutCheck] | None = None
    for candidate in ranked[:HELD_OUT_TRIES]:
        checked = check(candidate)
        if (checked.feasible or fallback is None) and passes(candidate):
            if checked.feasible:
                return candidate, checked.model_copy(update={"candidate": candidate.index, "rejected": rejected})
            fallback = fallback or (candidate, checked)
        rejected.append(candidate.index)
    if fallback is None:
        return None, None
    candidate, checked = fallback
    others = [index for index in rejected if index != candidate.index]
    return candidate, checked.model_copy(update={"candidate": candidate.index, "rejected": others})


def amend_goal_result(
    result: StoredCalibrationResult,
    found: SearchResult,
    best: Candidate | None,
    spec: GoalSpec,
    goal: Goal,
    base_metrics: Mapping[str, float],
    retain_metrics: Mapping[str, float | None] | None,
    shown: Callable[[Mapping[str, float]], dict[str, float | None]] = public,
) -> StoredCalibrationResult:
    """``result`` with an objective's fields: every candidate's metrics (as ``shown``), the front of
    the objective against the first bound, the bounds as applied; the recommendation is left to the
    job, which builds it (``note`` says why there is none)."""
    front = goal_front(goal, found.candidates)
    rows = [
        row.model_copy(update={"metrics": shown(candidate.metrics), "pareto": candidate.index in front})
        for row, candidate in zip(result.candidates, found.candidates, strict=True)
    ]
    return result.model_copy(
        update={
            "candidates": rows,
            "pareto_front": sorted(front),
            "constraint": constraint_summary(goal),
            "objective": GoalView(metric=spec.objective, sense=spec.sense),
            "constraints": resolved_bounds(goal, base_metrics),
            "retain_model": spec.retain_model.id if spec.retain_model is not None else None,
            "base_metrics": shown(base_metrics),
            "retain_metrics": dict(retain_metrics) if retain_metrics is not None else None,
            "recommended": None,
            "note": None if best is not None else _no_feasible_note(goal, found),
        }
    )


def plain_sets(raw: CalibrationProbes) -> dict[str, list[Probe]]:
    """The sets the default objective scores by NLL and exact match: forget, retain and, when the
    request gave general text, ``general``."""
    sets = {"forget": [parse_probe(p) for p in raw.forget], "retain": [parse_probe(p) for p in raw.retain]}
    general = (raw.utility or {}).get(GENERAL_SET)
    if general:
        sets[GENERAL_SET] = [parse_probe(p) for p in general]
    return sets


def margins(goal: Goal, values: Mapping[str, float]) -> dict[str, float]:
    """Per bound (``min_<metric>`` / ``max_<metric>``), how far inside it ``values`` are (negative:
    outside; a missing or non-finite value: omitted, the check names it infeasible)."""
    out: dict[str, float] = {}
    for bound in goal.bounds:
        value = values.get(bound.metric)
        if value is None or not math.isfinite(value):
            continue
        if bound.min is not None:
            out[f"min_{bound.metric}"] = round(value - bound.min, 6)
        if bound.max is not None:
            out[f"max_{bound.metric}"] = round(bound.max - value, 6)
    return out


def resolved(spec: GoalSpec, base: Mapping[str, float]) -> Goal:
    try:
        return spec.goal(base)
    except ValueError as exc:
        raise JobFailed(str(exc)) from None


def constraint_summary(goal: Goal) -> dict[str, float]:
    """The bounds applied, as the old ``constraint`` field names its one bound: ``min_<metric>`` /
    ``max_<metric>`` (absolute, a ratio to the base already resolved), so a client reading only that
    field sees what the recommendation meets (``max_retain_nll_ratio`` keeps its old name)."""
    summary: dict[str, float] = {}
    for bound in goal.bounds:
        if bound.min is not None:
            summary[f"min_{bound.metric}"] = bound.min
        if bound.max is not None:
            summary[f"max_{bound.metric}"] = bound.max
    return summary


def resolved_bounds(goal: Goal, base: Mapping[str, float]) -> list[ResolvedConstraint]:
    """The goal's bounds as applied, each with the base model's value of its metric (null: not finite)."""
    rows = []
    for bound in goal.bounds:
        value = base.get(bound.metric)
        finite = float(value) if value is not None and math.isfinite(value) else None
        rows.append(ResolvedConstraint(metric=bound.metric, min=bound.min, max=bound.max, base=finite))
    return rows


def goal_front(goal: Goal, candidates: Sequence[Candidate]) -> set[int]:
    """The candidates no other beats on both the objective and the first bound's metric (signed so
    that higher is safer: a lower bound's value, a negated upper bound's); with no bound, the best."""
    first = goal.bounds[0] if goal.bounds else None

    def point(c: Candidate) -> tuple[float, float]:
        if first is None:
            return goal.score(c.metrics), 0.0
        value = c.metrics.get(first.metric, math.nan)
        safe = value if first.min is not None else -value
        return goal.score(c.metrics), (safe if not math.isnan(safe) else -math.inf)

    points = {c.index: point(c) for c in candidates}
    return {
        i
        for i, (a, b) in points.items()
        if not any((a2 >= a and b2 >= b) and (a2 > a or b2 > b) for j, (a2, b2) in points.items() if j != i)
    }


def _no_feasible_note(goal: Goal, found: SearchResult) -> str:
    if not found.candidates:
        return "no candidate was evaluated"
    closest = min(found.candidates, key=lambda c: violation(goal, c.metrics))
    values = ", ".join(f"{b.metric} {closest.metrics.get(b.metric, math.nan):.4g}" for b in goal.bounds)
    return (
        f"no candidate meets every constraint: the closest ({closest.arm.name} at α={closest.alpha:.3g}) has {values}; "
        "lower alpha_min, or loosen the constraints"
    )
