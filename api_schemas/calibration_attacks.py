"""A calibration's attack gate (issue 37): bounds on what an attack leaves of the forgetting.

``attack_constraints`` name an attack as ``evaluate`` takes it (:mod:`api_schemas.attacks`: ``{"kind":
"quantize", "type": "Q4_1"}``, ``{"kind": "relearn", "steps": 10}``) and a bound on one metric of the
attacked candidate, e.g. ``{"attack": {"kind": "quantize", "type": "Q4_1"}, "metric": "forget_exact_match",
"max": 0.2}`` or ``{"attack": {"kind": "relearn"}, "metric": "recovered_fraction", "max": 0.3}``.

They are checked on the held-out probes only (the searched ones chose the candidate), with the numbers
``evaluate`` with that attack reports on those probes (greedy exact match, answer NLL; relearn trains
on the first held-out forget probes and scores the rest). Attacks cost a model copy (relearn: a few
optimizer steps) each, so only the candidates the held-out check reaches are attacked (the best-ranked,
at most four: those that could be recommended). A candidate that misses an attack bound is never
recommended; when none meets every one, the result recommends nothing and its note names the bound.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from api_schemas.attacks import Attack, AttackMetric, QuantizeAttack, RelearnAttack, RephraseAttack, attack_name
from api_schemas.common import Strict

MAX_ATTACK_CONSTRAINTS = 8
_Bound = Annotated[float, Field(allow_inf_nan=False, ge=-1e12, le=1e12)]
_Ratio = Annotated[float, Field(allow_inf_nan=False, gt=0.0, le=1e6)]


class AttackConstraint(Strict):
    """A bound on one metric of the candidate after an attack, on the held-out probes: absolute
    (``min``, ``max``) or relative to the base model's value on the same probes, unattacked."""

    attack: Attack = Field(description="quantize or relearn, as evaluate's attacks (rephrase: evaluate it)")
    metric: AttackMetric = Field(description="recovered_fraction: relearn only, (attacked − variant) / (base − variant)")
    min: _Bound | SkipJsonSchema[None] = Field(default=None, description="the value at least this")
    max: _Bound | SkipJsonSchema[None] = Field(default=None, description="the value at most this")
    # The bounds sit on the float (inside _Ratio): on the optional type they would be compared with a null.
    min_ratio_to_base: _Ratio | SkipJsonSchema[None] = Field(
        default=None, description="the value at least this x the base's, unattacked"
    )
    max_ratio_to_base: _Ratio | SkipJsonSchema[None] = Field(
        default=None, description="the value at most this x the base's, unattacked"
    )

    @model_validator(mode="after")
    def _checked(self) -> AttackConstraint:
        where = f"the attack constraint on {attack_name(self.attack)} {self.metric}"
        if isinstance(self.attack, RephraseAttack):
            raise ValueError(
                f"{where}: the gate takes quantize and relearn attacks; rephrasing changes the probes, not the "
                "model: evaluate the recommended variant with the rephrase attack"
            )
        if self.attack.thresholds is not None:
            raise ValueError(f"{where}: the attack's thresholds are evaluate's; bound the metric here (min, max)")
        if self.metric == "recovered_fraction" and not isinstance(self.attack, RelearnAttack):
            raise ValueError(f"{where}: recovered_fraction is relearn's; bound forget_exact_match after quantize")
        bounds = (self.min, self.max, self.min_ratio_to_base, self.max_ratio_to_base)
        if all(b is None for b in bounds):
            raise ValueError(f"{where} has no bound: min, max, min_ratio_to_base or max_ratio_to_base")
        if self.metric == "recovered_fraction" and (self.min_ratio_to_base or self.max_ratio_to_base):
            raise ValueError(f"{where}: the base recovers nothing (it forgot nothing); bound it with max")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"{where} has min {self.min} above max {self.max}")
        return self

    @property
    def attack_name(self) -> str:
        return attack_name(self.attack)


def check_attack_constraints(request: Any) -> None:
    """A calibrate request's attack constraints: text probes, held-out probes to check them on (a
    held_out_fraction, or the exact-match default's), and one setting per attack name.

    Raises:
        ValueError: naming what to change.
    """
    constraints: list[AttackConstraint] = request.attack_constraints
    if not constraints:
        return
    held_out = request.held_out_fraction is not None or (
        request.objective is None and "max_retain_nll_ratio" not in request.model_fields_set
    )
    if request.kind == "image":
        raise ValueError("attack_constraints are for language models' text probes (quantize and relearn attacks)")
    if not held_out:
        raise ValueError(
            "attack_constraints are checked on held-out probes: set held_out_fraction (e.g. 0.2), or leave out the "
            "objective and max_retain_nll_ratio (the exact-match default holds out 0.2)"
        )
    settings: dict[str, QuantizeAttack | RelearnAttack | RephraseAttack] = {}
    for constraint in constraints:
        name = constraint.attack_name
        if settings.setdefault(name, constraint.attack) != constraint.attack:
            raise ValueError(f"attack {name} is given with two settings: bound both metrics after one attack")


ATTACK_CONSTRAINTS_FIELD: Any = Field(
    default_factory=list,
    max_length=MAX_ATTACK_CONSTRAINTS,
    description="text probes, with held-out probes: bounds the recommended variant meets after an attack "
    '(api_schemas.calibration_attacks), e.g. {"attack": {"kind": "quantize", "type": "Q4_1"}, "metric": '
    '"forget_exact_match", "max": 0.2}; checked on the held-out probes for the candidates the held-out check '
    "reaches (the best-ranked, at most 4); none meets them: nothing is recommended",
)


class ResolvedAttackConstraint(BaseModel):
    """An attack constraint as applied: absolute bounds (a ratio resolved with the base's value)."""

    attack: str = Field(description="the attack's name, as evaluate reports it (quantize:Q4_1, relearn)")
    metric: str
    min: float | None = Field(default=None, description="the value at least this")
    max: float | None = Field(default=None, description="the value at most this")
    base: float | None = Field(default=None, description="the base model's value on these probes, unattacked")


class AttackGate(BaseModel):
    """The attack constraints checked on the held-out probes of the candidates that could be recommended."""

    attacks: dict[str, dict[str, Any]] = Field(description="attack name -> the attack as applied, with its defaults")
    constraints: list[ResolvedAttackConstraint]
    probes: dict[str, dict[str, int]] = Field(description="attack name -> held-out split -> probes scored after it")
    base: dict[str, dict[str, float | None]] = Field(
        description="attack name -> the base model's metrics on that attack's probes, unattacked"
    )
    attacked: list[int] = Field(
        description="the candidates attacked, in the order checked (the best-ranked the held-out check reaches, "
        "at most 4; the others were not attacked: none of them could be recommended)"
    )
    passed: list[int] = Field(description="the attacked candidates that meet every attack constraint")
    margins: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="candidate index -> per bound (min_/max_<attack>.<metric>) how far inside it the candidate is "
        "(negative: outside it; a metric that could not be measured is absent and fails)",
    )


ATTACK_GATE_FIELD: Any = Field(
    default=None,
    exclude_if=lambda v: v is None,
    description="with attack_constraints: the attacked candidates, which met them, the bounds as applied",
)
ATTACKED_FIELD: Any = Field(
    default=None,
    exclude_if=lambda v: v is None,
    description="with attack_constraints, the candidates the gate attacked: attack name -> its metrics after the "
    "attack on the held-out probes (null: not measurable)",
)
