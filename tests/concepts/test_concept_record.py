"""The concept as a record: its stored keys round-trip, updates return new records, 0.1.0's are migrated."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from service.concepts.migrate import concepts_of_any_version, migrate_concepts
from service.concepts.record import ConceptModelState, ConceptRecord, read_concept
from service.concepts.service import find_concept, list_concepts
from service.models.stored import UnmigratedRecord
from service.storage.keys import concept_key
from tests.helpers.store_world import StoreWorld


def old_concept() -> dict[str, Any]:
    """A concept as 0.1.0 stored it (no ``format_version``): a dataset reference resolved on one
    model collected with modules, pending on another."""
    return {
        "name": "forget",
        "role": "target",
        "description": "facts to forget",
        "num_records": 40,
        "dataset_digest": "a" * 64,
        "models": {
            "m/one": {"job_id": "1" * 32, "stats": "stats/d1/aa/s1/", "modules": ["mlp.down_proj"]},
            "m/two": {"job_id": "2" * 32, "stats": None},
        },
        "created_at": "2026-11-20T10:00:00Z",
        "dataset": {"uri": "file:///data/facts.jsonl", "format": "jsonl"},
        "template": "chat",
    }


def test_a_stored_concept_round_trips_with_its_keys() -> None:
    stored = {**old_concept(), "format_version": 1}
    record = read_concept("concepts/forget.json", stored)
    assert record.to_json() == stored
    assert record.models["m/one"].modules == ("mlp.down_proj",) and record.models["m/two"].stats is None
    inline = {k: v for k, v in stored.items() if k not in ("dataset", "template")}
    inline["models"] = {"m/one": {"job_id": "1" * 32, "stats": "stats/d1/aa/s1/"}}
    assert read_concept("concepts/forget.json", inline).to_json() == inline, "no dataset, template or modules: absent"


def test_updates_return_a_new_record() -> None:
    record = read_concept("concepts/forget.json", {**old_concept(), "format_version": 1, "dataset_digest": None})
    resolved = record.resolved("b" * 64, 12)
    grown = resolved.with_model("m/two", ConceptModelState(job_id="3" * 32, stats="stats/d2/bb/s1/"))
    assert record.dataset_digest is None and record.models["m/two"].job_id == "2" * 32, "the original is unchanged"
    assert (grown.dataset_digest, grown.num_records) == ("b" * 64, 12)
    assert grown.models["m/two"] == ConceptModelState(job_id="3" * 32, stats="stats/d2/bb/s1/")
    assert grown.models["m/one"] == record.models["m/one"]
    with pytest.raises(ValueError, match="frozen"):
        grown.name = "other"  # type: ignore[misc]


def test_an_old_concept_is_refused_then_migrated_once(tmp_path: Path) -> None:
    world = StoreWorld(tmp_path)
    storage = world.ctx.storage
    storage.put_json(concept_key("forget"), old_concept())
    with pytest.raises(UnmigratedRecord, match="concept concepts/forget.json is stored in format version None"):
        find_concept(world.ctx, "forget")
    assert [c.name for c in concepts_of_any_version(world.ctx)] == ["forget"], "what a dry run reads"

    dry = migrate_concepts(world.ctx, dry_run=True)
    assert dry.changed == [("concepts/forget.json", "format_version None -> 1")] and not dry.refused
    assert storage.get_json(concept_key("forget")) == old_concept(), "a dry run writes nothing"

    done = migrate_concepts(world.ctx)
    assert done.changed == dry.changed
    assert storage.get_json(concept_key("forget")) == {**old_concept(), "format_version": 1}, "only the version added"
    found = find_concept(world.ctx, "forget")
    assert isinstance(found, ConceptRecord) and found.template == "chat" and list_concepts(world.ctx) == [found]
    again = migrate_concepts(world.ctx)
    assert not again.changed and not again.refused, "idempotent"


def test_a_document_that_is_no_concept_is_refused_by_name(tmp_path: Path) -> None:
    world = StoreWorld(tmp_path)
    broken = copy.deepcopy(old_concept())
    del broken["models"]["m/one"]["job_id"]
    world.ctx.storage.put_json(concept_key("broken"), broken)
    done = migrate_concepts(world.ctx)
    assert not done.changed
    assert done.refused == [
        (
            "concepts/broken.json",
            "not a concept this version can read (models.m/one.job_id: Field required): delete it and post it again",
        )
    ]
    assert world.ctx.storage.get_json(concept_key("broken")) == broken, "left as it was"
    assert concepts_of_any_version(world.ctx) == []
