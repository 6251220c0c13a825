"""The objective's part of a ``calibrate`` job: the base and retain models' reports, each
candidate's metrics, the result's objective fields and the held-out check of the recommendation.

Made by :func:`service.calibration.build.run_calibration` inside the job's template process (every
chat template rendered once, before any model runs), after the candidates' model is loaded and
scored as the base. The retain model is loaded once, its reports on the searched and the held-out
probes kept, and released.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from service.calibration.candidates import SPLITS, InMemoryCandidates, check_probes, parse_probe, score
from service.calibration.goal import GoalSpec
from service.calibration.goal_scoring import metrics, prime, public, tofu_report
from service.calibration.goal_search import Goal, violation
from service.calibration.search import Candidate, SearchResult
from service.context import Context
from service.engine.chat import RenderedOnce, Renderer
from service.engine.tofu_scoring import TofuProbe, tofu_probe
from service.errors import JobFailed
from service.evaluation import tofu_metrics as tm
from service.evaluation.run import load_retain_model


def _tofu_sets(raw: Mapping[str, Any]) -> dict[str, list[TofuProbe]]:
    """Stored probe sets (forget, retain, holdout, utility by name) as TOFU probes, empty ones dropped."""
    sets = {"forget": raw["forget"], "retain": raw["retain"], "holdout": raw.get("holdout") or [], **raw["utility"]}
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
        searched: Mapping[str, Any],
        held: Mapping[str, Any],
        renderer: Renderer,
    ) -> None:
        self.spec, self.candidates = spec, candidates
        tokenizer = candidates.tokenizer
        self.sets = _tofu_sets(searched)
        self.held_sets = _tofu_sets(held)
        self.has_held_out = all(held[split] for split in SPLITS)
        self.renderer = RenderedOnce(renderer)
        prime(tokenizer, {**self.sets, **{f"held_out {k}": v for k, v in self.held_sets.items()}}, self.renderer)
        held_plain = {split: [parse_probe(p) for p in held[split]] for split in SPLITS}
        self.held_plain = check_probes(tokenizer, held_plain, self.renderer) if self.has_held_out else {}
        self.renderer.inner = None  # the template process ends with the job's block: all is rendered
        model = candidates.model  # at the base weights
        self.base_report = tofu_report(model, tokenizer, self.sets, self.renderer)
        self.base_held_summary = score(model, tokenizer, self.held_plain) if self.has_held_out else {}
        self.base_held_report = tofu_report(model, tokenizer, self.held_sets, self.renderer) if self.has_held_out else None
        self.retain_report: tm.ModelReport | None = None
        self.retain_held_report: tm.ModelReport | None = None
        if spec.retain_model is not None:
            retain = load_retain_model(ctx, spec.retain_model.model_dump(), tokenizer)
            self.retain_report = tofu_report(retain, tokenizer, self.sets, self.renderer)
            if self.has_held_out:
                self.retain_held_report = tofu_report(retain, tokenizer, self.held_sets, self.renderer)
        self.base_metrics = metrics(self.base_report, self.retain_report, self.base_report, candidates.base, candidates.base)
        self.goal = _resolved(spec, self.base_metrics)

    def candidate_metrics(self, summary: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        """The metrics of the candidate now applied to the model (its NLL summary measured)."""
        report = tofu_report(self.candidates.model, self.candidates.tokenizer, self.sets, self.renderer)
        return metrics(report, self.retain_report, self.base_report, summary, self.candidates.base)

    def check_held_out(self, best: Candidate) -> dict[str, Any]:
        """The recommended candidate on the held-out probes, its bounds resolved with the base's
        values on those probes (a ratio to the base is a ratio to the base on the same probes)."""
        assert self.base_held_report is not None
        tokenizer = self.candidates.tokenizer
        model = self.candidates.applied(best.arm, best.alpha)
        summary = score(model, tokenizer, self.held_plain)
        report = tofu_report(model, tokenizer, self.held_sets, self.renderer)
        held = metrics(report, self.retain_held_report, self.base_held_report, summary, self.base_held_summary)
        base_summary, base_report = self.base_held_summary, self.base_held_report
        base = metrics(base_report, self.retain_held_report, base_report, base_summary, base_summary)
        goal = _resolved(self.spec, base)
        return {
            "probes": {name: len(items) for name, items in self.held_sets.items() if name != "holdout"},
            "constraints": _bounds_json(goal, base),
            "feasible": violation(goal, held) == 0.0,
            "base": public(base),
            "recommended": public(held),
        }

    def validated_on_held_out(self, ranked: Sequence[Candidate]) -> tuple[Candidate, dict[str, Any]]:
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
        first: dict[str, Any] | None = None
        for candidate in ranked[:HELD_OUT_TRIES]:
            check = self.check_held_out(candidate)
            first = first or check
            if check["feasible"]:
                return candidate, {**check, "candidate": candidate.index, "rejected": rejected}
            rejected.append(candidate.index)
        assert first is not None, "validated_on_held_out needs at least one candidate"
        return ranked[0], {**first, "candidate": ranked[0].index, "rejected": rejected}

    def amend(self, result: dict[str, Any], found: SearchResult, best: Candidate | None) -> None:
        """The objective's fields of the result (``assemble`` wrote the NLL search's): every
        candidate's metrics, the front of the objective against the first bound, the recommendation."""
        rows = result["candidates"]
        front = goal_front(self.goal, found.candidates)
        for row, candidate in zip(rows, found.candidates, strict=True):
            row["metrics"] = public(candidate.metrics)
            row["pareto"] = candidate.index in front
        result["pareto_front"] = sorted(front)
        result["constraint"] = {}
        result["objective"] = {"metric": self.spec.objective, "sense": self.spec.sense}
        result["constraints"] = _bounds_json(self.goal, self.base_metrics)
        result["retain_model"] = self.spec.retain_model.id if self.spec.retain_model is not None else None
        result["base_metrics"] = public(self.base_metrics)
        if self.retain_report is not None:
            retain = tm.tofu_scores(self.retain_report, self.retain_report, self.base_report)
            result["retain_metrics"] = public(retain.values)
        if best is None:
            result["recommended"] = None
            result["note"] = _no_feasible_note(self.goal, found)
            return
        result["note"] = None
        result["recommended"] = {
            "candidate": best.index,
            "options": rows[best.index]["options"],
            "forget_nll_ratio": rows[best.index]["forget"]["nll_ratio"],
            "retain_nll_ratio": best.outcome.retain_ratio,
            "metrics": public(best.metrics),
        }


def _resolved(spec: GoalSpec, base: Mapping[str, float]) -> Goal:
    try:
        return spec.goal(base)
    except ValueError as exc:
        raise JobFailed(str(exc)) from None


def _bounds_json(goal: Goal, base: Mapping[str, float]) -> list[dict[str, Any]]:
    rows = []
    for bound in goal.bounds:
        value = base.get(bound.metric)
        rows.append(
            {
                "metric": bound.metric,
                "min": bound.min,
                "max": bound.max,
                "base": float(value) if value is not None and math.isfinite(value) else None,
            }
        )
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
