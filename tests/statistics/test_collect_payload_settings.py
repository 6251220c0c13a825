"""A collect job's settings are a typed record (``service.jobs.records.CollectionSettings``) that
the statistics floor reads as a :class:`CollectionSpec`: the stored job record keeps the bytes the
settings dict had (the fields that are set, in their order), records stored before read the same,
and the statistics key digest stays ``canonical_digest`` of the old dict.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.config import Settings
from service.jobs.records import CollectionSettings, CollectPayload, read_job_record
from service.jobs.store import new_job
from service.statistics.spec import CollectionSpec
from service.storage.keys import canonical_digest

pytestmark = pytest.mark.fast

ONLY_REQUIRED = {"max_length": 512, "engine": "engram-service/1"}
EVERY_FIELD = {
    "max_length": 256,
    "engine": "engram-service/1",
    "modules": ["dense", "q_proj"],
    "layers": "ab" * 32,
    "template": "chat",
    "stats_dtype": "float32",
    "collect_dtype": "float16",
}
# The digests of these dicts as the statistics keys were built before the settings were typed.
DIGESTS = {
    "only_required": "e5b27daf0ff8e8b9d37ad546d7c6201fcf09e5d4a04c224feb55c28a9e7521fa",
}


def _stored_collect_job(settings: Any) -> dict[str, Any]:
    payload = CollectPayload(model_id="m", model_digest="d" * 64, dataset_digest="e" * 64, settings=settings, concept="c")
    return new_job("collect", payload, unit="tokens").model_dump(mode="json")


@pytest.mark.parametrize(
    ("spec", "old"),
    [
        (CollectionSpec(max_length=512, engine="engram-service/1"), ONLY_REQUIRED),
        (CollectionSpec.of(Settings()), ONLY_REQUIRED),
        # a field given as its default (None) is absent, as dump() always left it
        (CollectionSpec(max_length=512, engine="engram-service/1", template=None, modules=None), ONLY_REQUIRED),
        (CollectionSpec.model_validate(EVERY_FIELD), EVERY_FIELD),
    ],
    ids=["only-required", "of-default-settings", "defaults-given", "every-field"],
)
def test_a_collect_payload_stores_the_settings_dict_it_stored_before(spec: CollectionSpec, old: dict[str, Any]) -> None:
    assert spec.dump() == old
    stored = _stored_collect_job(spec)
    assert json.dumps(stored["payload"]["settings"]) == json.dumps(old), "the same keys, values and order"
    record = read_job_record(json.loads(json.dumps(stored)))
    settings = record.payload_of(CollectPayload).settings
    assert isinstance(settings, CollectionSettings), "typed, not a dict"
    assert json.dumps(record.model_dump(mode="json")) == json.dumps(stored), "read and written back: the same bytes"
    assert CollectionSpec.of_job(settings) == spec
    assert CollectionSpec.of_job(settings).digest() == canonical_digest(old)
    assert settings.dump() == old, "what the statistics manifest records"


@pytest.mark.parametrize("old", [ONLY_REQUIRED, {**ONLY_REQUIRED, "template": "chat"}, EVERY_FIELD])
def test_a_record_stored_before_reads_as_typed_settings_with_the_same_key(old: dict[str, Any]) -> None:
    """A record as an older version stored it: the settings a plain dict, optional keys absent."""
    stored = {
        "job_id": "j" * 32,
        "kind": "collect",
        "status": "queued",
        "progress": {"done": 0, "total": 0, "unit": "tokens"},
        "created_at": "2026-11-20T00:00:00+00:00",
        "payload": {
            "model_id": "m",
            "model_digest": "d" * 64,
            "dataset_digest": "e" * 64,
            "settings": dict(old),
            "concept": "c",
        },
    }
    record = read_job_record(stored)
    settings = record.payload_of(CollectPayload).settings
    assert isinstance(settings, CollectionSettings)
    assert settings.template == old.get("template") and settings.stats_dtype == old.get("stats_dtype")
    assert record.model_dump(mode="json")["payload"]["settings"] == old
    assert json.dumps(record.model_dump(mode="json")["payload"]["settings"]) == json.dumps(old)
    spec = CollectionSpec.of_job(settings)
    assert spec.digest() == canonical_digest(old)
    assert spec.key("d" * 64, "e" * 64).prefix == f"stats/{'d' * 64}/{'e' * 64}/{canonical_digest(old)}/"
    if old == ONLY_REQUIRED:
        assert spec.digest() == DIGESTS["only_required"]


def test_a_collect_payload_refuses_settings_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="max_lenght"):
        _stored_collect_job({"max_lenght": 512, "engine": "engram-service/1"})
