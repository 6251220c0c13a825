"""The one stored-record base (service/storage/records.py): the reader refuses a newer version by
name, upgrades an older one through the registered steps one version at a time, refuses an older one
no step reads (pointing at ``engram-service migrate``), and writes the keys a record was stored with."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from service.concepts.record import ConceptRecord
from service.jobs.records import JobRecord
from service.models.record import ModelRecord
from service.storage.records import UPGRADES, StoredRecord, UnmigratedRecord, upgrade_step
from service.storage.stored_json import UnreadableRecord
from service.variants.plan import VariantPlan


class _Shelf(StoredRecord):
    record_name: ClassVar[str] = "test shelf"
    absent_when_none: ClassVar[frozenset[str]] = frozenset({"label"})

    format_version: int = 3
    books: int
    label: str | None = None
    note: str | None = None


@pytest.fixture(scope="module", autouse=True)
def _steps() -> Any:
    """Two steps, 1 -> 2 (``count`` renamed ``books``) and 2 -> 3 (the version only), registered once."""

    @upgrade_step("test shelf", 1)
    def _one_to_two(stored: dict[str, Any]) -> dict[str, Any]:
        rest = {k: v for k, v in stored.items() if k != "count"}
        return {**rest, "books": stored["count"], "format_version": 2}

    @upgrade_step("test shelf", 2)
    def _two_to_three(stored: dict[str, Any]) -> dict[str, Any]:
        return {**stored, "format_version": 3}

    yield
    del UPGRADES[("test shelf", 1)], UPGRADES[("test shelf", 2)]


def test_the_current_version_is_read_as_stored() -> None:
    assert _Shelf.stored("shelves/a.json", {"format_version": 3, "books": 4}) == _Shelf(books=4)


def test_an_older_version_is_upgraded_through_every_registered_step() -> None:
    assert _Shelf.stored("shelves/a.json", {"format_version": 1, "count": 7}) == _Shelf(books=7)


def test_a_newer_version_is_refused_by_name() -> None:
    with pytest.raises(UnmigratedRecord) as refused:
        _Shelf.stored("shelves/a.json", {"format_version": 4, "books": 1})
    message = refused.value.detail
    assert "test shelf shelves/a.json is stored in format version 4, not 3" in message and "newer" in message
    assert "upgrade this process" in message and refused.value.status == 503


@pytest.mark.parametrize("found", [None, 0, "3", True])
def test_an_older_version_without_a_step_points_at_migrate(found: Any) -> None:
    with pytest.raises(UnmigratedRecord, match="run `engram-service migrate` once") as refused:
        _Shelf.stored("shelves/a.json", {"format_version": found, "books": 1})
    assert refused.value.found == found and refused.value.current == 3


def test_fields_that_do_not_fit_are_refused_naming_the_key_and_the_field() -> None:
    with pytest.raises(UnreadableRecord, match=r"shelves/a.json cannot be read: not a test shelf \(books"):
        _Shelf.stored("shelves/a.json", {"format_version": 3, "books": "many"})


def test_a_step_is_registered_once() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        upgrade_step("test shelf", 1)(lambda stored: stored)


def test_the_stored_form_leaves_out_only_the_fields_absent_when_none() -> None:
    assert _Shelf(books=2).to_json() == {"format_version": 3, "books": 2, "note": None}
    assert _Shelf(books=2, label="x").to_json() == {"format_version": 3, "books": 2, "label": "x", "note": None}


def test_each_domain_names_its_current_version_once() -> None:
    """The version a reader accepts is the one the record writes (its field's default)."""
    versions = {cls.record_name: cls.current_format() for cls in (ModelRecord, ConceptRecord, JobRecord, VariantPlan)}
    assert versions == {"model registration": 2, "concept": 1, "job record": 1, "variant plan": 1}
    assert UPGRADES[("job record", None)]({"job_id": "j"}) == {"job_id": "j", "format_version": 1}
