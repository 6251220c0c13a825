"""The format version of the records whose stored form has not changed since versions came, and
the check of it for readers that take a stored JSON object and a name.

The base, the refusal and the upgrade steps live in :mod:`service.storage.records` (one place for
every domain); this module keeps the names the domains' readers import. A reader accepts exactly
the current version, or an older one a registered step upgrades; data written before it (0.1.0
wrote none) is rewritten once by ``engram-service migrate`` (:mod:`service.cli`), never read
through compatibility branches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.storage.records import FORMAT_VERSION, UnmigratedRecord, upgraded

__all__ = ["FORMAT_VERSION", "UnmigratedRecord", "check_format"]


def check_format(what: str, key: str, data: Mapping[str, Any], current: int = FORMAT_VERSION) -> Mapping[str, Any]:
    """``data`` in format version ``current`` (the record's own), through the steps registered for ``what``.

    Raises:
        UnmigratedRecord: it is of another version no step upgrades (an older service's: no
            ``format_version`` at all), or of a newer one.
    """
    return upgraded(what, key, data, current)
