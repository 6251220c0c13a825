"""A stored record's JSON read strictly: a JSON object, or a refusal that names its key and why.

``Storage.find_json`` reads a document that is not JSON as absent, and lets a JSON array, a number
or nesting deeper than Python's recursion limit through to each reader (where ``data.get`` or the
decoder itself raised: a 500, a traceback in ``engram-service migrate``). Every record the service
stores is a JSON object it wrote itself, so anything else in its place (non-UTF-8 bytes, a
truncated write from outside the service, a restored backup of something else) is damage an
operator repairs: :class:`UnreadableRecord`, a 503 like every other stored record the service
cannot read (an unmigrated record, a malformed manifest): the request was fine, the store is not.

A listing must not stop at one such record: :func:`skip_unreadable` leaves it out with a
structured warning naming its key, and reading that record itself answers its refusal.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import ValidationError

from service.errors import ServiceUnavailable, first_validation_error
from service.storage.base import ObjectNotFound, Storage

T = TypeVar("T")
log = logging.getLogger("engram.storage")


class UnreadableRecord(ServiceUnavailable):
    """A stored record that is not a JSON object (named by its storage key, with why)."""

    title, slug = "Unreadable stored record", "unreadable-record"

    def __init__(self, key: str, why: str) -> None:
        super().__init__(
            f"the stored record {key} cannot be read: {why}; restore it from a backup or delete it "
            "(`engram-service migrate --dry-run` names every record the service cannot read)"
        )
        self.key, self.why = key, why


def decode_record(key: str, raw: bytes) -> dict[str, Any]:
    """The JSON object stored under ``key``.

    Raises:
        UnreadableRecord: the bytes are not UTF-8, not JSON (a truncated write), nested past what the
            decoder reads, or JSON other than an object.
    """
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UnreadableRecord(key, f"its bytes are not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise UnreadableRecord(key, f"it is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise UnreadableRecord(key, "its JSON is nested too deeply to read") from None
    except ValueError as exc:  # an integer of over 4,300 digits (CVE-2020-10735)
        raise UnreadableRecord(key, f"it is not JSON this service reads ({exc})") from None
    if not isinstance(value, dict):
        raise UnreadableRecord(key, f"it is a JSON {_json_type(value)}, not an object")
    return value


def find_record(storage: Storage, key: str) -> dict[str, Any] | None:
    """The record under ``key``, None when there is none (an invalid key names nothing).

    Raises:
        UnreadableRecord: something is stored there that is not a JSON object.
    """
    try:
        raw = storage.get_bytes(key)
    except (ObjectNotFound, ValueError):
        return None
    return decode_record(key, raw)


def get_record(storage: Storage, key: str) -> dict[str, Any]:
    """The record under ``key``.

    Raises:
        ObjectNotFound: there is none.
        UnreadableRecord: something is stored there that is not a JSON object.
    """
    return decode_record(key, storage.get_bytes(key))


def skip_unreadable(key: str, read: Callable[[], T]) -> T | None:
    """``read()``, or None with a warning naming ``key`` when the stored record(s) it reads cannot be read.

    For listings: one damaged record must not break a list for every caller. What counts is every
    refusal of a stored record (each is a 503 :class:`ServiceUnavailable`: this module's, an
    unmigrated record, a malformed manifest or job record) and a record whose fields do not fit.
    """
    try:
        return read()
    except (ServiceUnavailable, ValidationError) as exc:
        why = exc.detail if isinstance(exc, ServiceUnavailable) else first_validation_error(exc)
        log.warning("left %s out of a listing: %s", key, why, extra={"record_key": key, "reason": why})
        return None


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"
