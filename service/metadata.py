"""What a list of created resources (models, concepts, variants) narrows to by their creation metadata.

Every such view carries ``created_at``, ``created_by`` (a key's fingerprint) and ``labels``
(:class:`api_schemas.provenance.CreationMetadata`); the lists take the same query parameters for
them: ``label=key:value`` (repeated: every pair must match), ``created_by`` and the time range
``[created_after, created_before)``. One reading of them here, so the three lists cannot disagree.
A resource stored before its metadata was recorded matches no label, creator or time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol

from service.errors import InvalidInput


class Created(Protocol):
    """A view with creation metadata (a model, a concept, a variant)."""

    @property
    def created_at(self) -> str | None: ...

    @property
    def created_by(self) -> str | None: ...

    @property
    def labels(self) -> Mapping[str, str]: ...


@dataclass(frozen=True)
class MetadataFilter:
    """Every field set must match (none set: everything matches)."""

    labels: tuple[tuple[str, str], ...] = ()
    created_by: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None

    @classmethod
    def parse(
        cls, labels: Sequence[str], created_by: str | None, created_after: str | None, created_before: str | None
    ) -> MetadataFilter:
        """The filter of the query's values (a 422 naming the parameter and the form it takes)."""
        pairs = []
        for label in labels:
            key, colon, value = label.partition(":")
            if not colon or not key:
                raise InvalidInput(f"label={label!r}: write label=key:value (repeat it for several labels)")
            pairs.append((key, value))
        after, before = instant("created_after", created_after), instant("created_before", created_before)
        return cls(tuple(pairs), created_by, after, before)

    def admits(self, view: Created) -> bool:
        if any(view.labels.get(k) != v for k, v in self.labels):
            return False
        if self.created_by is not None and view.created_by != self.created_by:
            return False
        if self.created_after is None and self.created_before is None:
            return True
        if view.created_at is None:
            return False
        created = _utc(datetime.fromisoformat(view.created_at))
        after_ok = self.created_after is None or created >= self.created_after
        return after_ok and (self.created_before is None or created < self.created_before)


def instant(name: str, value: str | None) -> datetime | None:
    """An ISO 8601 instant (one without a zone is UTC), or a 422 naming the parameter."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidInput(f"{name}={value!r} is not an ISO 8601 time (e.g. 2026-11-29T08:00:00Z)") from None
    return _utc(parsed)


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
