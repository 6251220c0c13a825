"""The attack gate of a text calibration (``attack_constraints``: :mod:`api_schemas.calibration_attacks`).

A candidate passes when, on the held-out probes, every attack constraint holds after its attack,
measured as ``evaluate`` measures it (:mod:`service.evaluation.attacks`: the same quantized or
relearned copy, greedy exact match and answer NLL per split, relearn trained on the first held-out
forget probes and scored on the rest). The base model's unattacked values on each attack's probes are
measured once, at the start (a ratio to the base resolves against them; relearn's recovered fraction
reads the base's forget exact match).

Attacks are the expensive part (a model copy each, relearn a few optimizer steps on it), so a
candidate is attacked only when the held-out check asks (:func:`service.calibration.goal_run.gated_on_held_out`:
the best-ranked candidates that could still be recommended) and each once; the result names which.
Cancellation is checked after every scored chunk and relearning step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from api_schemas.attacks import RelearnAttack
from api_schemas.calibration_attacks import AttackConstraint, AttackGate, ResolvedAttackConstraint
from api_schemas.evaluation import ProbeSummary, Split
from service.calibration.candidates import InMemoryCandidates
from service.calibration.goal import ConstraintSpec
from service.calibration.goal_scoring import public
from service.calibration.goal_search import Bound
from service.calibration.search import Candidate
from service.context import Context
from service.engine.evaluate import TextProbe as Probe
from service.errors import JobFailed
from service.evaluation.attacks import (
    AttackContext,
    PreparedAttack,
    attacked_copy,
    prepare_relearn,
    recovered_fraction,
    summaries,
)
from service.jobs.progress import JobCancelled


class _CancelCheck:
    """The attack code's progress: counts nothing (the calibration's progress counts candidates),
    stops the job when it is cancelled."""

    def __init__(self, ctx: Context, job_id: str) -> None:
        self.ctx, self.job_id = ctx, job_id

    def advance(self, amount: int = 1) -> None:
        job = self.ctx.jobs.get(self.job_id)
        if job is not None and job.cancel_requested:
            raise JobCancelled()


def _values(summary: Mapping[Split, ProbeSummary]) -> dict[str, float]:
    """``<split>_exact_match`` and ``<split>_mean_nll`` of each scored split."""
    values: dict[str, float] = {}
    for split, scored in summary.items():
        values[f"{split}_exact_match"] = scored.exact_match
        values[f"{split}_mean_nll"] = scored.mean_nll
    return values


class AttackGateRun:
    """See the module docstring.

    Args:
        constraints: the stored goal's attack constraints.
        candidates: the loaded candidates (their model is set back to the base weights here).
        held: the held-out probes, tokenized (``forget`` and ``retain``).
    """

    def __init__(
        self,
        ctx: Context,
        job_id: str,
        constraints: Sequence[AttackConstraint],
        candidates: InMemoryCandidates,
        held: Mapping[str, Sequence[Probe]],
    ) -> None:
        if not held.get("forget") or not held.get("retain"):
            raise JobFailed("attack_constraints need held-out forget and retain probes; these hold none out")
        self.constraints, self.candidates = list(constraints), candidates
        probes: dict[Split, list[Probe]] = {"forget": list(held["forget"]), "retain": list(held["retain"])}
        self.prepared: dict[str, PreparedAttack] = {}
        for constraint in self.constraints:
            name = constraint.attack_name
            if name not in self.prepared:
                self.prepared[name] = self._prepare(name, constraint, probes)
        self.context = AttackContext(
            models={},
            tokenizer=candidates.tokenizer,
            metrics=None,
            batch_tokens=candidates.batch_tokens,
            progress=_CancelCheck(ctx, job_id),
        )
        base = candidates.base_model()
        self.base = {name: _values(summaries(base, item.probes, self.context)) for name, item in self.prepared.items()}
        self.bounds = [(c.attack_name, self._bound(c)) for c in self.constraints]
        self.scores: dict[int, dict[str, dict[str, float]]] = {}  # candidate -> attack -> metrics, in attack order

    def _prepare(self, name: str, constraint: AttackConstraint, probes: dict[Split, list[Probe]]) -> PreparedAttack:
        attack = constraint.attack
        if isinstance(attack, RelearnAttack):
            return prepare_relearn(name, attack, self.candidates.tokenizer, probes, {}, self.candidates.bound)
        return PreparedAttack(name, attack, probes)

    def _bound(self, constraint: AttackConstraint) -> Bound:
        fields = constraint.model_dump(include={"metric", "min", "max", "min_ratio_to_base", "max_ratio_to_base"})
        try:
            return ConstraintSpec(**fields).bound(self.base[constraint.attack_name])
        except ValueError as exc:
            raise JobFailed(f"attack constraint on {constraint.attack_name}: {exc} (on the held-out probes)") from None

    def attacked(self, candidate: Candidate) -> dict[str, dict[str, float]]:
        """Per attack, the candidate's metrics after it on the held-out probes (measured once)."""
        if candidate.index not in self.scores:
            model = self.candidates.applied(candidate.arm, candidate.alpha)
            self.scores[candidate.index] = {name: self._measure(item, model) for name, item in self.prepared.items()}
        return self.scores[candidate.index]

    def _measure(self, item: PreparedAttack, model: Any) -> dict[str, float]:
        before = summaries(model, item.probes, self.context) if isinstance(item.attack, RelearnAttack) else None
        attacked = attacked_copy(item, model, "candidate", self.context)
        values = _values(summaries(attacked, item.probes, self.context))
        del attacked  # one attacked copy at a time
        if before is not None:
            base_em, variant_em = self.base[item.name]["forget_exact_match"], before["forget"].exact_match
            fraction = recovered_fraction(base_em, variant_em, values["forget_exact_match"])
            values["recovered_fraction"] = fraction if isinstance(fraction, float) else math.nan
        return values

    def passes(self, candidate: Candidate) -> bool:
        """Every attack constraint holds for ``candidate`` (attacked now if it was not)."""
        scores = self.attacked(candidate)
        return all(bound.violation(scores[name].get(bound.metric)) == 0.0 for name, bound in self.bounds)

    def margins(self, index: int) -> dict[str, float]:
        """Per bound (``min_``/``max_<attack>.<metric>``), how far inside it the attacked candidate is."""
        out: dict[str, float] = {}
        for name, bound in self.bounds:
            value = self.scores[index][name].get(bound.metric, math.nan)
            if not math.isfinite(value):
                continue
            if bound.min is not None:
                out[f"min_{name}.{bound.metric}"] = round(value - bound.min, 6)
            if bound.max is not None:
                out[f"max_{name}.{bound.metric}"] = round(bound.max - value, 6)
        return out

    def report(self) -> AttackGate:
        """The gate as the result shows it (``attack_gate``)."""
        order = list(self.scores)
        probes: dict[str, dict[str, int]] = {
            name: {str(split): len(items) for split, items in item.probes.items()} for name, item in self.prepared.items()
        }
        return AttackGate(
            attacks={name: item.attack.model_dump(mode="json", exclude_none=True) for name, item in self.prepared.items()},
            constraints=[
                ResolvedAttackConstraint(
                    attack=name, metric=b.metric, min=b.min, max=b.max, base=_finite(self.base[name].get(b.metric))
                )
                for name, b in self.bounds
            ],
            probes=probes,
            base={name: public(values) for name, values in self.base.items()},
            attacked=order,
            passed=[i for i in order if all(b.violation(self.scores[i][n].get(b.metric)) == 0.0 for n, b in self.bounds)],
            margins={str(i): self.margins(i) for i in order},
        )

    def rows(self) -> dict[int, dict[str, dict[str, float | None]]]:
        """Candidate index -> attack -> its public metrics (the result's ``candidates[i].attacked``)."""
        return {index: {name: public(values) for name, values in scores.items()} for index, scores in self.scores.items()}

    def note(self, feasible: int) -> str:
        """Why nothing is recommended: the attacked candidates all missed an attack bound, the closest named."""
        closest = min(self.scores, key=self._violation)
        missed = [
            f"{name} {b.metric} {_shown(self.scores[closest][name].get(b.metric, math.nan))} ({_bounds(b)})"
            for name, b in self.bounds
            if b.violation(self.scores[closest][name].get(b.metric)) > 0
        ]
        return (
            f"no candidate meets the attack constraints on the held-out probes: the {len(self.scores)} best-ranked of "
            f"the {feasible} feasible candidates were attacked, and the closest (candidate {closest}) has "
            f"{'; '.join(missed)}; raise alpha_max or the budget, loosen the attack constraints, or calibrate "
            "another universe"
        )

    def _violation(self, index: int) -> float:
        return sum(b.violation(self.scores[index][name].get(b.metric)) for name, b in self.bounds)


def _bounds(bound: Bound) -> str:
    parts = ([f"min {bound.min:.4g}"] if bound.min is not None else []) + (
        [f"max {bound.max:.4g}"] if bound.max is not None else []
    )
    return ", ".join(parts)


def _shown(value: float) -> str:
    """A value in a note; NaN (relearn's recovered fraction where nothing was forgotten) says so."""
    return f"{value:.4g}" if math.isfinite(value) else "not measurable (the variant forgot none of these probes)"


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None
