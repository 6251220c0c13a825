"""A calibration's request, typed once: its identity, its stored probes and the request its job reads.

:class:`CalibrationRequest` is made from the route's :class:`~api_schemas.CalibrateRequest`
(where the options are named on the wire), the universe it resolved to and the edit space it spans.
It is stored as ``calibrations/<id>/request.json``, written and read here only, and named by the
digest of :func:`calibration_identity`, the one place a calibration's ID is made.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, field_validator

from api_schemas import CalibrateRequest, Probe
from service.calibration.goal import GoalSpec
from service.calibration.goal_search import GoalSettings
from service.calibration.records import CalibrationProbes, MalformedCalibration, StoredRecord, read_record
from service.calibration.search import Arm, SearchSettings
from service.calibration.space import EditSpace
from service.engine.lora_rules import LoraTarget
from service.evaluation.records import ProbeJson
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
    (without one, the stored probes, and so the ID, are what they were before objectives); with image
    probes, the ``test`` set."""
    forget, retain = _probe_json(options.forget), _probe_json(options.retain)
    if options.kind == "image":  # an image classifier's: forget, retain and test images (no holdout, no utility)
        return CalibrationProbes(forget=forget, retain=retain, test=_probe_json(options.test)).to_bytes()
    if options.objective is not None or options.utility:  # the default objective's general text: utility.general
        utility = {name: _probe_json(items) for name, items in options.utility.items()}
        return CalibrationProbes(
            forget=forget, retain=retain, holdout=_probe_json(options.holdout), utility=utility
        ).to_bytes()
    return CalibrationProbes(forget=forget, retain=retain).to_bytes()


def probes_digest(probes: bytes) -> str:
    return hashlib.sha256(probes).hexdigest()


def has_messages(options: CalibrateRequest) -> bool:
    """Whether a probe is a conversation (the model then needs a chat template)."""
    extra = [*options.holdout, *(p for items in options.utility.values() for p in items)]
    return any(p.messages is not None for p in [*options.forget, *options.retain, *extra])


def _probe_json(probes: Sequence[Probe]) -> list[ProbeJson]:
    return [p.model_dump(exclude_none=True) for p in probes]


class SearchSpec(StoredRecord):
    """What the search is asked (stored as ``search``): the constraint, the budget, the α range, the arms.

    Attributes:
        max_retain_nll_ratio: the retain probes' mean answer NLL, variant / base, at most this.
        budget: the most candidates evaluated.
        alpha_min, alpha_max: the range of α searched.
        arms: the edit space's arms, in the order the search steps them (stored without their
            strengths: the job measures those).
    """

    max_retain_nll_ratio: float
    budget: int
    alpha_min: float
    alpha_max: float
    arms: tuple[Arm, ...]

    @field_validator("arms", mode="before")
    @classmethod
    def _strengths_are_never_stored(cls, arms: Any) -> Any:
        """An Arm validates from its fields, ``strengths`` too; a stored arm has none (the job measures them)."""
        for i, arm in enumerate(arms if isinstance(arms, (list, tuple)) else ()):
            if isinstance(arm, Mapping) and "strengths" in arm:
                raise ValueError(f"arm {i} stores strengths, which the job measures and a request never stores")
        return arms

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


class VariantFormat(StoredRecord):
    """How the recommended candidate is built as a variant (stored as ``variant``)."""

    format: Format = "checkpoint"
    lora_rank: int | None = None
    lora_target: LoraTarget = "peft"


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
        "search": search.model_dump(mode="json"),
        "variant": variant.model_dump(mode="json"),
    }
    if goal is not None:
        identity["goal"] = goal.model_dump(mode="json")
    return identity


class CalibrationRequest(StoredRecord):
    """The stored request of a calibration (``calibrations/<id>/request.json``): what its job reads.

    The record is its own stored form: ``to_json`` dumps it and ``from_json`` validates it, with the
    keys, in their order, that requests have always been stored with (``goal`` only with an objective).
    A request stored before presets were skipped has no ``skipped_module_sets`` (none was); one stored
    before data_weighted has arms without ``weighted`` (:class:`~service.calibration.search.Arm`).
    Any other shape is refused naming the calibration and its first wrong field.

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
    term_stats: dict[str, str]
    universe_id: str
    reference: tuple[str, ...]
    probes_digest: str
    search: SearchSpec
    skipped_module_sets: tuple[str, ...] = ()
    variant: VariantFormat
    job_id: str | None = None
    goal: GoalSpec | None = Field(default=None, exclude_if=lambda v: v is None)

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
        return self.model_copy(update={"job_id": job_id})

    def to_json(self) -> dict[str, Any]:
        """The stored JSON (``request.json``)."""
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, data: Any, calibration_id: str | None = None) -> CalibrationRequest:
        """A stored request (this version's, or one of the older shapes the class docstring names).

        Raises:
            MalformedCalibration: it is no calibration request (or, given ``calibration_id``, another's).
        """
        named = calibration_id or (str(data.get("calibration_id", "?")) if isinstance(data, Mapping) else "?")
        record = read_record(cls, named, "request.json", data)
        if record.calibration_id != named:
            raise MalformedCalibration(named, "request.json", f"it names calibration {record.calibration_id}")
        return record
