"""One stored-format version per record: what a reader accepts, and the refusal of anything older.

Every record the service stores (model registrations, concepts, universe requests and manifests,
variant requests) carries ``format_version``. A reader accepts exactly the current version; data
written before it (0.1.0 wrote none) is rewritten once by ``engram-service migrate``
(:mod:`service.cli`), never read through compatibility branches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.errors import ServiceUnavailable

# The version of every record that has not changed since versions were introduced; a record whose
# stored form changed has its own (``service.models.record.MODEL_FORMAT_VERSION``).
FORMAT_VERSION = 1


class UnmigratedRecord(ServiceUnavailable):
    """A stored record of an older format: the operator runs ``engram-service migrate`` first."""

    def __init__(self, what: str, key: str, found: Any, current: int = FORMAT_VERSION) -> None:
        if isinstance(found, int) and not isinstance(found, bool) and found > current:
            super().__init__(
                f"{what} {key} is stored in format version {found}, not {current}: data written by a newer "
                "version of the service, which this one cannot read; upgrade this process"
            )
            return
        super().__init__(
            f"{what} {key} is stored in format version {found!r}, not {current}: data written by an older "
            "version of the service; run `engram-service migrate` once to rewrite the store in the current format"
        )


def check_format(what: str, key: str, data: Mapping[str, Any], current: int = FORMAT_VERSION) -> Mapping[str, Any]:
    """``data`` when it is of the current format version (``current``: the record's own).

    Raises:
        UnmigratedRecord: it is of another (an older service's: no ``format_version`` at all).
    """
    found = data.get("format_version")
    if found != current:
        raise UnmigratedRecord(what, key, found, current)
    return data
