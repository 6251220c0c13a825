"""A calibration's request, typed once: its identity, its stored probes and the request its job reads.

:class:`CalibrationRequest` is made from the route's :class:`~api_schemas.CalibrateRequest`
(where the options are named on the wire), the universe it resolved to and the edit space it spans.
It is stored as ``calibrations/<id>/request.json``, written and read here only, and named by the
digest of :func:`calibration_identity`, the one place a calibration's ID is made.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from api_schemas import CalibrateRequest, Probe
from service.calibration.goal import GoalSpec
from service.calibration.goal_search import GoalSettings
from service.calibration.records import (
    StoredArm,
    StoredCalibrationRequest,
    StoredSearch,
    StoredVariantFormat,
    read_calibration_request,
)
from service.calibration.search import Arm, SearchSettings
from service.calibration.space import EditSpace
from service.engine.lora_rules import LoraTarget
from service.models.record import ModelRecord
from service.storage.keys import ENGINE_VERSION, canonical_digest
from service.universes.members import EditUniverse

CALIBRATION_FORMAT = "engram-calibration/2"  # bump when the search or its result changes
Format = Literal["checkpoint", "delta", "peft"]


def one_term_each(options: CalibrateRequest) -> CalibrateRequest:
    """The request with each concept once: a name twice is one term, as in unlearn."""
    return options.model_copy(update={"concepts": list(dict.fromkeys(options.concepts))})


def stored_probes(options: CalibrateRequest) -> bytes:
    """The probes as ``probes/<sha256>.json`` holds them (and the ID digests them): each without its
    nulls, as evaluations store theirs. With an objective, also the ``holdout`` and ``utility`` sets
    (without one, the stored probes, and so the ID, are what they were before objectives)."""
    probes: dict[str, Any] = {"forget": _probe_json(options.forget), "retain": _probe_json(options.retain)}
    if options.objective is not None:
        probes["holdout"] = _probe_json(options.holdout)
        probes["utility"] = {name: _probe_json(items) for name, items in options.utility.items()}
    return json.dumps(probes, sort_keys=True, ensure_ascii=False).encode()


def probes_digest(probes: bytes) -> str:
    return hashlib.sha256(probes).hexdigest()


def has_messages(options: CalibrateRequest) -> bool:
    """Whether a probe is a conversation (the model then needs a chat template)."""
    extra = [*options.holdout, *(p for items in options.utility.values() for p in items)]
    return any(p.messages is not None for p in [*options.forget, *options.retain, *extra])


def _probe_json(probes: Sequence[Probe]) -> list[dict[str, Any]]:
    return [p.model_dump(exclude_none=True) for p in probes]


@dataclass(frozen=True)
class SearchSpec:
    """What the search is asked (stored as ``search``): the constraint, the budget, the α range, the arms.

    Attributes:
        max_retain_nll_ratio: the retain probes' mean answer NLL, variant / base, at most this.
        budget: the most candidates evaluated.
        alpha_min, alpha_max: the range of α searched.
        arms: the edit space's arms, in the order the search steps them (without their strengths:
            the job measures those).
    """

    max_retain_nll_ratio: float
    budget: int
    alpha_min: float
    alpha_max: float
    arms: tuple[Arm, ...]

    @classmethod
    def of(cls, options: CalibrateRequest, space: EditSpace) -> SearchSpec:
        return cls(
            max_retain_nll_ratio=float(options.max_retain_nll_ratio),
            budget=int(options.budget),
            alpha_min=float(options.alpha_min),
            alpha_max=float(options.alpha_max),
            arms=space.arms,
        )

    def settings(self) -> SearchSettings:
        """The search's settings: the paper's α = 1 first, where the range allows it."""
        return SearchSettings(
            limit=self.max_retain_nll_ratio,
            budget=self.budget,
            alpha_min=self.alpha_min,
            alpha_max=self.alpha_max,
            alpha_start=min(max(1.0, self.alpha_min), self.alpha_max),
        )

    def goal_settings(self) -> GoalSettings:
        """The goal search's settings (an objective's calibration)."""
        return GoalSettings(budget=self.budget, alpha_min=self.alpha_min, alpha_max=self.alpha_max)

    def to_json(self) -> dict[str, Any]:
        return {
            "max_retain_nll_ratio": self.max_retain_nll_ratio,
            "budget": self.budget,
            "alpha_min": self.alpha_min,
            "alpha_max": self.alpha_max,
            "arms": [_arm_json(arm) for arm in self.arms],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SearchSpec:
        return cls(
            max_retain_nll_ratio=float(data["max_retain_nll_ratio"]),
            budget=int(data["budget"]),
            alpha_min=float(data["alpha_min"]),
            alpha_max=float(data["alpha_max"]),
            arms=tuple(_arm_of(arm) for arm in data["arms"]),
        )


def _arm_json(arm: Arm) -> dict[str, Any]:
    return {
        "module_set": arm.module_set,
        "modules": _list(arm.modules),
        "layers": _list(arm.layers),
        "scaling": arm.scaling,
        "weighted": arm.weighted,
    }


def _arm_of(data: Mapping[str, Any]) -> Arm:
    """A stored arm (one stored before data_weighted has no ``weighted``: it was not)."""
    modules, layers = _tuple(data["modules"]), _tuple(data["layers"])
    return Arm(data["module_set"], modules, layers, data["scaling"], bool(data.get("weighted", False)))


@dataclass(frozen=True)
class VariantFormat:
    """How the recommended candidate is built as a variant (stored as ``variant``)."""

    format: Format = "checkpoint"
    lora_rank: int | None = None
    lora_target: LoraTarget = "peft"

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "lora_rank": self.lora_rank, "lora_target": self.lora_target}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VariantFormat:
        return cls(format=data["format"], lora_rank=data["lora_rank"], lora_target=data["lora_target"])


def calibration_identity(
    model_digest: str,
    universe_id: str,
    term_prefixes: Sequence[str],
    probes: str,
    search: SearchSpec,
    variant: VariantFormat,
    goal: GoalSpec | None = None,
) -> dict[str, Any]:
    """Everything that determines a calibration's answer; its ID is the digest of this.

    Args:
        term_prefixes: the removed concepts' statistics prefixes (names are labels).
        probes: the digest of :func:`stored_probes`.
        goal: an objective's goal (absent without one: the identity of a request before objectives).
    """
    identity = {
        "format": CALIBRATION_FORMAT,
        "engine": ENGINE_VERSION,
        "model_digest": model_digest,
        "universe_id": universe_id,
        "terms": sorted(term_prefixes),
        "probes": probes,
        "search": search.to_json(),
        "variant": variant.to_json(),
    }
    if goal is not None:
        identity["goal"] = goal.model_dump(mode="json")
    return identity


@dataclass(frozen=True)
class CalibrationRequest:
    """The stored request of a calibration (``calibrations/<id>/request.json``): what its job reads.

    Attributes:
        concepts: the concepts removed, each once, in the request's order.
        term_stats: each concept's statistics prefix.
        universe_id: the universe whose engrams the candidates are made of.
        reference: the names shown as the universe's reference.
        probes_digest: the stored probes' digest (``probes/<digest>.json``).
        skipped_module_sets: the default presets left out: they select no layer of the model.
        job_id: the job that answers it (None until it is created).
    """

    calibration_id: str
    model_id: str
    concepts: tuple[str, ...]
    term_stats: Mapping[str, str]
    universe_id: str
    reference: tuple[str, ...]
    probes_digest: str
    search: SearchSpec
    skipped_module_sets: tuple[str, ...]
    variant: VariantFormat
    job_id: str | None = None
    goal: GoalSpec | None = None

    @classmethod
    def new(
        cls,
        model: ModelRecord,
        options: CalibrateRequest,
        resolved: EditUniverse,
        space: EditSpace,
        probes: str,
        goal: GoalSpec | None = None,
    ) -> CalibrationRequest:
        """The request of a calibration of ``model`` (options with each concept once: :func:`one_term_each`)
        in the universe it resolved to, over ``space``, on the probes of digest ``probes``; named by its identity."""
        concepts = tuple(options.concepts)
        search = SearchSpec.of(options, space)
        variant = VariantFormat(format=options.format, lora_rank=options.lora_rank, lora_target=options.lora_target)
        universe_id = resolved.spec.universe_id
        term_prefixes = [resolved.terms[name] for name in concepts]
        identity = calibration_identity(model.digest, universe_id, term_prefixes, probes, search, variant, goal)
        return cls(
            calibration_id=canonical_digest(identity)[:32],
            model_id=model.model_id,
            concepts=concepts,
            term_stats={name: resolved.terms[name] for name in concepts},
            universe_id=universe_id,
            reference=tuple(resolved.reference),
            probes_digest=probes,
            search=search,
            skipped_module_sets=space.skipped,
            variant=variant,
            goal=goal,
        )

    @property
    def term_prefixes(self) -> list[str]:
        """The concepts' statistics prefixes, in the concepts' order."""
        return [self.term_stats[name] for name in self.concepts]

    def with_job(self, job_id: str) -> CalibrationRequest:
        return dataclasses.replace(self, job_id=job_id)

    def record(self) -> StoredCalibrationRequest:
        """The stored record (``request.json``)."""
        search = self.search
        return StoredCalibrationRequest(
            calibration_id=self.calibration_id,
            model_id=self.model_id,
            concepts=self.concepts,
            term_stats=dict(self.term_stats),
            universe_id=self.universe_id,
            reference=self.reference,
            probes_digest=self.probes_digest,
            search=StoredSearch(
                max_retain_nll_ratio=search.max_retain_nll_ratio,
                budget=search.budget,
                alpha_min=search.alpha_min,
                alpha_max=search.alpha_max,
                arms=tuple(StoredArm.model_validate(_arm_json(arm)) for arm in search.arms),
            ),
            skipped_module_sets=self.skipped_module_sets,
            variant=StoredVariantFormat.model_validate(self.variant.to_json()),
            job_id=self.job_id,
            goal=self.goal,
        )

    def to_json(self) -> dict[str, Any]:
        """The stored JSON: the keys, in their order, that requests have been stored with (``goal``
        only with an objective)."""
        return self.record().model_dump(mode="json")

    @classmethod
    def from_json(cls, data: Any, calibration_id: str | None = None) -> CalibrationRequest:
        """A stored request, read through :func:`~service.calibration.records.read_calibration_request`
        (this version's, or one stored before data_weighted: its arms have no ``weighted``).

        Raises:
            MalformedCalibration: it is no calibration request (or, given ``calibration_id``, another's).
        """
        named = calibration_id or (str(data.get("calibration_id", "?")) if isinstance(data, Mapping) else "?")
        record = read_calibration_request(named, data)
        search = record.search
        return cls(
            calibration_id=record.calibration_id,
            model_id=record.model_id,
            concepts=record.concepts,
            term_stats=dict(record.term_stats),
            universe_id=record.universe_id,
            reference=record.reference,
            probes_digest=record.probes_digest,
            search=SearchSpec(
                max_retain_nll_ratio=search.max_retain_nll_ratio,
                budget=search.budget,
                alpha_min=search.alpha_min,
                alpha_max=search.alpha_max,
                arms=tuple(Arm(a.module_set, a.modules, a.layers, a.scaling, a.weighted) for a in search.arms),
            ),
            skipped_module_sets=record.skipped_module_sets,
            variant=VariantFormat(
                format=record.variant.format, lora_rank=record.variant.lora_rank, lora_target=record.variant.lora_target
            ),
            job_id=record.job_id,
            goal=record.goal,
        )


def _tuple(values: Any) -> tuple[Any, ...] | None:
    return None if values is None else tuple(values)


def _list(values: tuple[Any, ...] | None) -> list[Any] | None:
    return None if values is None else list(values)
