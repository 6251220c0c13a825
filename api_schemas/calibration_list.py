"""A calibration as ``GET /calibrations`` lists it: its subject, status, creation and, once done, its
recommendation's headline (the whole result is ``GET /calibrations/{id}``'s; its home,
:mod:`api_schemas.calibration`, is at its size limit)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from api_schemas.calibration import CandidateOptions

CalibrationStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class RecommendationHeadline(BaseModel):
    """What a list shows of the recommended candidate: its options, its two ratios, its exact match
    and the variant it was built as."""

    candidate: int = Field(description="its index among the calibration's candidates")
    options: CandidateOptions
    forget_nll_ratio: float | None = Field(description="forget probes' mean answer NLL, variant / base")
    retain_nll_ratio: float = Field(description="retain probes' mean answer NLL, variant / base")
    forget_exact_match: float | None = Field(default=None, description="share of forget probes still answered exactly")
    retain_exact_match: float | None = Field(default=None, description="share of retain probes answered exactly")
    variant_id: str = Field(description="the candidate built as an unlearn variant (GET /variants/{variant_id})")
    format: Literal["checkpoint", "delta", "peft"]


class CalibrationSummary(BaseModel):
    """One calibration in ``GET /calibrations``."""

    calibration_id: str
    model_id: str
    concepts: list[str]
    universe_id: str
    status: CalibrationStatus
    job_id: str | None = None
    created_at: str | None = Field(
        description="when its job was created (UTC, ISO 8601); null when the job's record is gone"
    )
    candidates: int | None = Field(default=None, description="once succeeded: the candidates evaluated")
    recommended: RecommendationHeadline | None = Field(
        default=None, description="once succeeded: the recommendation (null before, and when none was feasible)"
    )
    note: str | None = Field(default=None, description="once succeeded without a recommendation: why")
    warnings: int = Field(default=0, description="once succeeded: how many warnings its result carries")
