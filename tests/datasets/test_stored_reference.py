"""A dataset reference as a concept stores it (``service.datasets.refs.StoredReference``): every form
references were stored in reads back and is written again byte for byte, and the same reference with
another fingerprint is the same place with other content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.concepts.record import ConceptRecord
from service.datasets.refs import StoredReference, content_changed, same_reference
from service.models.stored import FORMAT_VERSION

STORED_FORMS = {
    "no options, stored before fingerprints": {"uri": "file:///d/a.jsonl", "format": "jsonl"},
    "no fingerprint to be had": {"uri": "file:///d/a.jsonl", "format": "jsonl", "fingerprint": None},
    "a file": {"uri": "file:///d/a.jsonl", "format": "jsonl", "fingerprint": {"size": 3, "mtime_ns": 17 << 56, "inode": 5}},
    "s3, columns and rows": {
        "uri": "s3://b/a.parquet",
        "format": "parquet",
        "columns": {"prompt": "q", "completion": "a"},
        "rows": {"start": 0, "stop": 5},
        "fingerprint": {"etag": '"x"', "size": 3, "version_id": "v"},
    },
    "an image folder from row 1": {
        "uri": "file:///d/digits",
        "format": "imagefolder",
        "rows": {"start": 1},
        "fingerprint": {"files": 3, "listing": "ab"},
    },
}


def concept_document(reference: dict[str, Any]) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "name": "c",
        "role": "target",
        "description": None,
        "num_records": None,
        "dataset_digest": None,
        "models": {"m": {"job_id": "j" * 32, "stats": None}},
        "created_at": "2026-11-28T10:00:00+00:00",
        "dataset": reference,
    }


@pytest.mark.parametrize("case", sorted(STORED_FORMS))
def test_a_stored_reference_is_read_as_a_model_and_written_back_byte_for_byte(case: str) -> None:
    stored = STORED_FORMS[case]
    document = concept_document(stored)
    concept = ConceptRecord.model_validate(json.loads(json.dumps(document)))
    assert isinstance(concept.dataset, StoredReference) and concept.dataset.uri == stored["uri"]
    assert json.dumps(concept.to_json()) == json.dumps(document)
    assert concept.dataset.start == stored.get("rows", {}).get("start", 0)


def test_the_same_place_with_another_fingerprint_is_other_content() -> None:
    held = StoredReference.model_validate(STORED_FORMS["a file"])
    touched = held.model_copy(update={"fingerprint": {"size": 3, "mtime_ns": 1, "inode": 5}})
    assert same_reference(held, touched) and content_changed(held, touched)
    assert not content_changed(held, StoredReference.model_validate(STORED_FORMS["a file"]))
    unprinted = StoredReference.model_validate(STORED_FORMS["no options, stored before fingerprints"])
    assert content_changed(unprinted, held), "a reference stored before fingerprints counts as other content"
    assert not same_reference(held, StoredReference.model_validate(STORED_FORMS["s3, columns and rows"]))


@pytest.mark.parametrize("case", sorted(STORED_FORMS))
def test_a_collect_job_carries_the_reference_as_a_record_and_stores_it_byte_for_byte(case: str) -> None:
    from service.jobs.records import CollectPayload, read_job_record

    stored = STORED_FORMS[case]
    payload = {
        "model_id": "m",
        "model_digest": "d" * 64,
        "dataset_digest": None,
        "settings": {"max_length": 64, "engine": "engram-service/1"},
        "concept": "c",
        "dataset": stored,
    }
    record = {
        "format_version": 1,
        "job_id": "j" * 32,
        "kind": "collect",
        "status": "queued",
        "progress": {"done": 0, "total": 0, "unit": "tokens"},
        "created_at": "2026-11-28T10:00:00+00:00",
        "payload": payload,
    }
    job = read_job_record(json.loads(json.dumps(record)))
    reference = job.payload_of(CollectPayload).dataset
    assert isinstance(reference, StoredReference) and reference.uri == stored["uri"]
    assert json.dumps(job.model_dump(mode="json")["payload"]["dataset"]) == json.dumps(stored)
