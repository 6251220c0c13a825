"""A collect job's plan: what its submission decided, stored in the job's payload so the job decides nothing again.

The plan holds what the submission resolved once from the concept, the model's layout and the
settings: the statistics key's settings digest, the layers collected and the first row of a dataset
reference (so that a message names a record as the row the user finds in their file). The settings
themselves stay where they always were, in ``payload.settings``. A payload stored without a plan
(a job queued by an earlier version) is planned when its job reads it, in one place:
``service.concepts.plan.read_collection``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PLAN_VERSION = 1  # of the stored plan; a new version gets its upgrade step in read_collection


class Sampling(BaseModel):
    """The texts a concept posted with ``samples`` has its one model draw (``service.concepts.sampled``):
    ``count`` texts of ``max_new_tokens`` tokens each, from the BOS token, at ``temperature``, seeded."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    count: int
    max_new_tokens: int
    temperature: float
    seed: int


class CollectionPlan(BaseModel):
    """One concept's collection on one model, as its submission resolved it.

    Attributes:
        settings_digest: the statistics key's settings digest (``CollectionSpec.digest`` of the
            payload's settings); with the model and dataset digests it is the key.
        layers: the names of the collected layers, in the model's layout order; ``None``: every
            editable layer of the layout. Listed only when a module selection narrowed them, so that
            the payload of a model with tens of thousands of expert layers stays small.
        first_row: the source row of a dataset reference's first record (``None``: records posted
            inline or uploaded, named ``record i``).
        samples: the texts the job draws with the model first (its dataset), for a concept posted with
            ``samples`` whose dataset is not drawn yet.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: Literal[1] = 1  # PLAN_VERSION
    settings_digest: str
    layers: tuple[str, ...] | None = Field(default=None, exclude_if=lambda v: v is None)
    first_row: int | None = Field(default=None, exclude_if=lambda v: v is None)
    samples: Sampling | None = Field(default=None, exclude_if=lambda v: v is None)
