"""An evaluation's stored probes (``probes/<sha256>.json``) as one frozen record.

Written by :mod:`service.evaluation.service` at submission and read by the job
(:mod:`service.evaluation.run`); the file's digest names the evaluation, so its bytes are what they
have always been: the keys the submission set, sorted (without metrics only ``forget`` and
``retain``; with metrics also ``tofu``; an image classifier's ``forget``, ``retain``, ``test`` and
``classifier``). A file that does not fit is refused naming it, never passed on as a dict.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from service.errors import JobFailed, first_validation_error
from service.evaluation.retain_model import RetainModelRef

# A probe as the route sent it (api_schemas' Probe dumped without its nulls: text, chat or image),
# kept as JSON: its bytes are part of the evaluation's identity, and the job parses it per kind.
ProbeJson = dict[str, Any]


class _Stored(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TofuOptions(_Stored):
    """``metrics`` asked (``"tofu"`` or a list of names), the extra probe sets, the retain model resolved."""

    metrics: str | list[str]
    holdout: list[ProbeJson]
    utility: dict[str, list[ProbeJson]]
    retain_model: RetainModelRef | None


class ClassifierOptions(_Stored):
    """An image classifier's evaluation: the retrained classifier resolved (None without one)."""

    retain_model: RetainModelRef | None


class StoredProbes(_Stored):
    forget: list[ProbeJson]
    retain: list[ProbeJson]
    test: list[ProbeJson] | None = None
    tofu: TofuOptions | None = None
    classifier: ClassifierOptions | None = None
    # The request's attacks (api_schemas.attacks, dumped with their defaults); set only when some are
    # asked, so an evaluation without attacks keeps its stored bytes and identity.
    attacks: list[dict[str, Any]] | None = None

    def to_bytes(self) -> bytes:
        """The stored bytes (their sha256 names the evaluation): the fields set, keys sorted."""
        return json.dumps(self.model_dump(mode="json", exclude_unset=True), sort_keys=True, ensure_ascii=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes, digest: str) -> StoredProbes:
        """The stored probes of digest ``digest``.

        Raises:
            JobFailed: not JSON, or not this record (naming the file and its first wrong field).
        """
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            why = first_validation_error(exc)
            raise JobFailed(f"the stored probes probes/{digest}.json cannot be read ({why})") from exc
