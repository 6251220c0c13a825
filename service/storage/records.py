"""The one base of every stored record: frozen, strict, versioned where it carries a version, upgraded in one place.

Every shape the service stores (a model's registration, a concept, a job, a variant's request, plan
and manifest, a universe's manifest, plan and pointer, a statistics manifest, a calibration's files)
is a :class:`StoredRecord`: frozen, a key this version does not know refused, and written by
:meth:`StoredRecord.to_json` in the keys it was always stored with (a field listed in
:attr:`StoredRecord.absent_when_none` is left out, rather than written as null, when it has no value).

A record whose stored form changed carries ``format_version`` (a field whose default is the current
version). :meth:`StoredRecord.stored` reads one: a newer version is refused by name (this process
must be upgraded), an older one goes through the upgrade steps registered here
(:func:`upgrade_step`), one version at a time; an older version with no step is refused by name
too: ``engram-service migrate`` rewrites the store once (:mod:`service.variants.migrate`), so that
no reader carries a branch for a shape the store no longer holds. A record without
``format_version`` (a content-addressed manifest, written once, whose keys never changed) is only
validated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from service.errors import ServiceUnavailable, first_validation_error
from service.storage.stored_json import UnreadableRecord

# The version of every record that has not changed since versions were introduced; a record whose
# stored form changed has its own (``service.models.record.MODEL_FORMAT_VERSION``).
FORMAT_VERSION = 1

# A step from one stored version to the next: the stored JSON object in, the next version's out.
Upgrade = Callable[[dict[str, Any]], dict[str, Any]]

# (record name, the version a step reads; None: written before versions) -> the step. The one place
# upgrade steps live: each registered by :func:`upgrade_step` beside the record it upgrades.
UPGRADES: dict[tuple[str, int | None], Upgrade] = {}


class UnmigratedRecord(ServiceUnavailable):
    """A stored record of another format: an older one (the operator runs ``engram-service migrate``
    first) or a newer one (this process is older than the data: upgrade it)."""

    def __init__(self, what: str, key: str, found: Any, current: int = FORMAT_VERSION) -> None:
        self.found, self.current = found, current
        if is_newer(found, current):
            super().__init__(
                f"{what} {key} is stored in format version {found}, not {current}: data written by a newer "
                "version of the service, which this one cannot read; upgrade this process"
            )
            return
        super().__init__(
            f"{what} {key} is stored in format version {found!r}, not {current}: data written by an older "
            "version of the service; run `engram-service migrate` once to rewrite the store in the current format"
        )


def is_newer(found: Any, current: int) -> bool:
    """Whether a stored ``format_version`` is one a later version of the service wrote."""
    return _is_version(found) and found > current


def _is_version(found: Any) -> bool:
    return isinstance(found, int) and not isinstance(found, bool)


def upgrade_step(what: str, from_version: int | None) -> Callable[[Upgrade], Upgrade]:
    """Register ``step`` as the upgrade of a stored ``what`` of ``from_version`` to the next version.

    A step must not be registered twice (two modules would disagree about what an old record means).
    """

    def register(step: Upgrade) -> Upgrade:
        if (what, from_version) in UPGRADES:
            raise ValueError(f"an upgrade of {what} from format version {from_version!r} is registered twice")
        UPGRADES[(what, from_version)] = step
        return step

    return register


def upgraded(what: str, key: str, data: Mapping[str, Any], current: int) -> dict[str, Any]:
    """``data`` brought to format version ``current`` through the registered steps.

    Raises:
        UnmigratedRecord: it is newer than ``current``, or older with no step to the next version.
    """
    stored = dict(data)
    while (found := stored.get("format_version")) != current:
        # only a version this process could have written before has a step (True is not version 1)
        older = found is None or (_is_version(found) and found < current)
        step = UPGRADES.get((what, found)) if older else None
        if step is None:
            raise UnmigratedRecord(what, key, found, current)
        stored = step(stored)
        if stored.get("format_version") == found:
            raise RuntimeError(f"the upgrade step of {what} from format version {found!r} did not change the version")
    return stored


R = TypeVar("R", bound="StoredRecord")


class StoredRecord(BaseModel):
    """A stored record: frozen, and a key this version does not know is refused.

    Class attributes:
        record_name: what the record is called in a refusal ("concept", "variant plan").
        absent_when_none: fields the stored form leaves out, rather than writes as null, when None
            (the keys the record was always stored with).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    record_name: ClassVar[str] = "stored record"
    absent_when_none: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def current_format(cls) -> int | None:
        """The format version this process writes (the default of ``format_version``); None: the
        record carries none."""
        field = cls.model_fields.get("format_version")
        return None if field is None else int(field.default)

    @classmethod
    def upgraded(cls, key: str, data: Mapping[str, Any]) -> Mapping[str, Any]:
        """``data`` in the current format version (unchanged for a record that carries none).

        Raises:
            UnmigratedRecord: a newer version, or an older one no registered step upgrades.
        """
        current = cls.current_format()
        return data if current is None else upgraded(cls.record_name, key, data, current)

    @classmethod
    def stored(cls: type[R], key: str, data: Mapping[str, Any]) -> R:
        """The record stored under ``key``: upgraded to the current format, then validated.

        Raises:
            UnmigratedRecord: it is of a format this version does not read (named, with what to do).
            UnreadableRecord: its fields do not fit the record (the first named).
        """
        current = cls.upgraded(key, data)
        try:
            return cls.model_validate(current)
        except ValidationError as exc:
            raise UnreadableRecord(key, f"not a {cls.record_name} ({first_validation_error(exc)})") from None

    def to_json(self) -> dict[str, Any]:
        """The stored form: every field, those of :attr:`absent_when_none` only when they have a value."""
        absent = {name for name in self.absent_when_none if self.__dict__[name] is None}
        return self.model_dump(mode="json", exclude=absent or None)
