"""No stored byte changes: each kind's fixture record is written, and read back and written again,
as the bytes the service wrote before its record moved onto the one stored-record base
(``tests/storage/stored_records/``, see :mod:`tests.storage.stored_record_fixtures`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from service.calibration.records import CalibrationProbes
from service.concepts.record import read_concept
from service.engrams.manifest import read_manifest
from service.jobs.collect_plan import CollectionPlan
from service.jobs.records import read_job_record
from service.models.record import ModelRecord
from service.statistics.manifest import read_statistics_manifest
from service.universes.records import read_current_pointer, read_plan
from service.variants.manifest import read_variant_manifest
from service.variants.plan import VariantPlan
from service.variants.spec import VariantRequest
from tests.storage.stored_record_fixtures import FORMS, HERE, UID, stored_bytes


def _model(data: dict[str, Any]) -> dict[str, Any]:
    return ModelRecord.model_validate(data).to_json()


# name -> its domain's reader of the stored form, and the form it writes back
READ_BACK: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "model": _model,
    "concept": lambda data: read_concept("concepts/forget.json", data).to_json(),
    **{name: (lambda data: read_job_record(data).model_dump(mode="json")) for name in FORMS if name.startswith("job-")},
    "variant-plan": lambda data: VariantPlan.stored("variant-plans/v.json", data).model_dump(mode="json"),
    "variant-request": lambda data: VariantRequest.stored("variants/v/request.json", data).model_dump(mode="json"),
    "variant-manifest": lambda data: read_variant_manifest("v" * 32, data).to_json(),
    "universe-manifest": lambda data: read_manifest(UID, data).to_json(),
    "universe-plan": lambda data: read_plan(UID, data).to_json(),
    "current-universe": lambda data: read_current_pointer("current.json", data).to_json(),
    "statistics-manifest": lambda data: read_statistics_manifest("stats/x/", data).to_json(),
    "calibration-probes": lambda data: json.loads(CalibrationProbes.model_validate(data).to_bytes()),
    "collection-plan": lambda data: CollectionPlan.model_validate(data).model_dump(mode="json"),
}


def test_every_pinned_record_has_a_reader() -> None:
    assert set(READ_BACK) == set(FORMS) == {p.stem for p in HERE.glob("*.json")}


@pytest.mark.parametrize("name", sorted(FORMS))
def test_a_new_record_is_written_as_the_pinned_bytes(name: str) -> None:
    assert stored_bytes(FORMS[name]()) == (HERE / f"{name}.json").read_bytes()


@pytest.mark.parametrize("name", sorted(FORMS))
def test_a_stored_record_reads_back_to_the_same_bytes(name: str) -> None:
    pinned = (HERE / f"{name}.json").read_bytes()
    assert stored_bytes(READ_BACK[name](json.loads(pinned))) == pinned
