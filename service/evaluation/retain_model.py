"""The retain model an evaluation or a calibration is scored against, as its request stores it.

A registered model is named with its checkpoint digest and a variant with its ID (which names its
content), so a retain model registered again is a new evaluation (or calibration), not an old answer.
Stored as ``{"id", "kind", "digest"}`` in the evaluation's probes (``tofu.retain_model``,
``classifier.retain_model``) and in a calibration's goal; this record is that JSON's one definition.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class RetainModelRef(BaseModel):
    """The retain model: a registered model (``digest`` its weights') or a variant (its ID)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    kind: Literal["model", "variant"]
    digest: str
