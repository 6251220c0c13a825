"""The strength of an unlearn request that names none: safe on a real model, and said.

``W − α Σ_k f_l W_k⁺`` at α = 1 is the closed form's full projection. On a pretrained LLM it is
far too strong: on SmolLM2-135M-Instruct (2026-11-29, the table in docs/how-to/outputs.md) α = 1
kept 0% of a kind of fact the edit should keep and multiplied perplexity ~7×, where α = 0.25 kept
every kept fact at ×1.02. So a request without ``alpha`` is resolved here, at submit, before its
variant ID is made (the stored request records the α used, and the ID follows it):

1. the model's last successful calibration of the same concepts (as a set) in the same universe
   the request resolves to, whose recommended edit agrees with every shape option the request
   names (``scaling``, ``modules``, ``layers``, ``module_strengths``): its α, and its shape options
   for those the request leaves out, since the α was chosen for that shape;
2. else :data:`CONSERVATIVE_ALPHA`, with a warning that says so and how to calibrate.

Every unlearn is also checked for a general-text reference: a universe with no member of role
``reference`` besides the removed concepts projects out more of what the model should keep.

Calibrations are found in storage (``calibrations/<id>/result.json``, a
:class:`~api_schemas.CalibrationResult`) rather than through ``service.calibration``, which sits
above this domain; "last" is by the finish time of the job that answered each.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from api_schemas import CalibrationResult, UnlearnRequest
from api_schemas.calibration import CandidateOptions
from service.concepts.service import find_concept
from service.context import Context
from service.models.registry import get_model
from service.storage.keys import CALIBRATIONS, calibration_request_key
from service.universes.members import EditUniverse, resolve_members

log = logging.getLogger("engram.variants")

# Measured on SmolLM2-135M-Instruct (docs/how-to/outputs.md, "Strength"): the largest α of the grid
# that kept every kept fact within 2% of the base perplexity, with and without a general reference.
CONSERVATIVE_ALPHA = 0.25
# The options a calibration's recommendation fixes besides α: the α was chosen for this shape.
SHAPE_OPTIONS = ("scaling", "modules", "layers", "module_strengths")


@dataclass(frozen=True)
class ResolvedUnlearn:
    """An unlearn request with its α set, and what the answer tells about how it was chosen."""

    request: UnlearnRequest
    warnings: list[str]

    @property
    def alpha(self) -> float:
        if self.request.alpha is None:  # every path of resolve_unlearn sets it
            raise ValueError("an unlearn request left without alpha")
        return self.request.alpha


@dataclass(frozen=True)
class Calibrated:
    """A finished calibration's recommendation, and when its job finished (ISO time; '' unknown)."""

    calibration_id: str
    options: CandidateOptions
    finished_at: str


class _AnsweringJob(BaseModel):
    """The one field of a calibration's ``request.json`` read here: the job that answered it."""

    model_config = ConfigDict(extra="ignore")
    job_id: str | None = None


def resolve_unlearn(ctx: Context, model_id: str, body: UnlearnRequest) -> ResolvedUnlearn:
    """``body`` with a safe α when it names none, and the warnings its answer carries.

    Raises:
        NotFound, Conflict, InvalidInput: as the submission would for the same request (an unknown
            model or concept, a universe of another model); nothing is written.
    """
    universe = resolve_members(
        ctx,
        get_model(ctx, model_id),
        body.concepts,
        reference=body.reference,
        universe_id=body.universe,
        rcond=body.rcond,
    )
    warnings = reference_warnings(ctx, universe, body.concepts)
    if body.alpha is not None:
        return ResolvedUnlearn(body, warnings)
    named = sorted(body.model_fields_set & set(SHAPE_OPTIONS))
    found = last_calibration(ctx, model_id, body.concepts, universe.spec.universe_id)
    if found is not None and not disagreements(body, found.options, named):
        return ResolvedUnlearn(adopt(body, found.options, named), [calibrated_note(found), *warnings])
    other = "" if found is None else " " + shape_mismatch(found, body, named)
    fallback = body.model_copy(update={"alpha": CONSERVATIVE_ALPHA})
    return ResolvedUnlearn(fallback, [conservative_warning(model_id, body.concepts) + other, *warnings])


def reference_warnings(ctx: Context, universe: EditUniverse, removed: Sequence[str]) -> list[str]:
    """A warning when no member of the universe but the removed concepts has role ``reference``."""
    others = [name for name in universe.spec.names if name not in set(removed)]
    if any(_role(ctx, name) == "reference" for name in others):
        return []
    members, model_id = ", ".join(universe.spec.names), universe.spec.model_id
    return [
        f"the universe of this edit ({members}) has no general-text reference (no concept with role "
        '"reference" besides the removed ones): the edit is less selective and damages more of what the model '
        'should keep. Add one: POST /concepts with "role": "reference" and ~100 paragraphs of ordinary text '
        'the model writes well (or let the service draw it from the model: "samples": {"count": 240, '
        '"max_new_tokens": 128}), then name it in "reference" (or in a new universe: '
        f"POST /models/{model_id}/universes)"
    ]


def _role(ctx: Context, name: str) -> str | None:
    concept = find_concept(ctx, name)
    return None if concept is None else concept.role


def last_calibration(ctx: Context, model_id: str, concepts: Sequence[str], universe_id: str) -> Calibrated | None:
    """The most recently finished calibration of ``model_id`` that removed exactly ``concepts`` in
    ``universe_id`` and recommended an edit; None when there is none."""
    wanted = set(concepts)
    found = [
        Calibrated(result.calibration_id, result.recommended.options, _finished_at(ctx, result.calibration_id))
        for result in _recommendations(ctx)
        if result.recommended is not None
        and result.model_id == model_id
        and set(result.concepts) == wanted
        and result.universe_id == universe_id
    ]
    return max(found, key=lambda c: c.finished_at, default=None)


def _recommendations(ctx: Context) -> Iterator[CalibrationResult]:
    """Every stored calibration result (one that cannot be read is left out with a log line: a
    broken record of another edit must not refuse this one)."""
    for key in ctx.storage.list(CALIBRATIONS):
        if not key.endswith("/result.json"):
            continue
        try:  # written once, last: cached once found
            yield CalibrationResult.model_validate(ctx.reads.immutable_json(key))
        except (ValidationError, ValueError) as exc:
            log.warning("calibration result %s unreadable, not used for a default alpha: %s", key, exc)


def _finished_at(ctx: Context, calibration_id: str) -> str:
    """When the job that answered the calibration finished ('' when that job is gone)."""
    stored = ctx.storage.find_json(calibration_request_key(calibration_id))
    try:
        job_id = _AnsweringJob.model_validate(stored).job_id
    except ValidationError:
        return ""
    job = ctx.jobs.get(job_id) if job_id else None
    return (job.finished_at or "") if job is not None else ""


def _shape(options: UnlearnRequest | CandidateOptions, name: str) -> Any:
    """One shape option, normalised: module and layer lists compare as sets (order names no layer)."""
    value = getattr(options, name)
    return sorted(value) if name in ("modules", "layers") and value is not None else value


def disagreements(body: UnlearnRequest, options: CandidateOptions, named: Sequence[str]) -> list[str]:
    """The shape options ``body`` names with another value than the recommendation's."""
    return [name for name in named if _shape(body, name) != _shape(options, name)]


def adopt(body: UnlearnRequest, options: CandidateOptions, named: Sequence[str]) -> UnlearnRequest:
    """``body`` with the recommendation's α and the shape options it leaves out."""
    update: dict[str, Any] = {name: getattr(options, name) for name in SHAPE_OPTIONS if name not in named}
    return body.model_copy(update={**update, "alpha": options.alpha})


def _shape_text(options: CandidateOptions) -> str:
    parts = [f"alpha {options.alpha:.4g}", f"scaling {options.scaling}"]
    parts += [f"{name} {getattr(options, name)}" for name in SHAPE_OPTIONS[1:] if getattr(options, name) is not None]
    return ", ".join(parts)


def calibrated_note(found: Calibrated) -> str:
    return (
        f"alpha not given: used the recommendation of calibration {found.calibration_id} of these concepts "
        f"({_shape_text(found.options)}); give alpha to choose another strength"
    )


def conservative_warning(model_id: str, concepts: Sequence[str]) -> str:
    return (
        f"alpha not given: used {CONSERVATIVE_ALPHA:g}, the conservative default (alpha 1 can destroy a pretrained "
        f"model: see docs/how-to/outputs.md); calibrate to choose the strength for {', '.join(concepts)} "
        f"(POST /models/{model_id}/calibrate with forget and retain probes, or engram calibrate): an unlearn "
        "without alpha then uses its recommendation; or give alpha"
    )


def shape_mismatch(found: Calibrated, body: UnlearnRequest, named: Sequence[str]) -> str:
    differing = ", ".join(f"{name} {getattr(body, name)}" for name in disagreements(body, found.options, named))
    return (
        f"Calibration {found.calibration_id} of these concepts recommended {_shape_text(found.options)}, "
        f"but this request names {differing}: omit those options to use it"
    )
