"""The model registration as a typed record: the stored JSON keeps its keys, reads back equal, and
its layout is parsed once, when the record is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engram_fixtures.models import make_tiny_llama
from service.engine.layout import ModelLayout
from service.models.record import MODEL_FORMAT_VERSION, ModelRecord
from service.models.registry import get_model, model_view
from service.models.stored import UnmigratedRecord
from service.storage.keys import model_key
from tests.helpers.store_world import StoreWorld

MODEL = "rec/llama"
# What registrations stored before the record was typed (commit d1c47c7); plus the version.
KEYS = [
    "model_id",
    "source",
    "path",
    "digest",
    "file_sha256",
    "identity",
    "fingerprint",
    "architecture",
    "kind",
    "num_parameters",
    "layout",
    "registered_at",
]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> StoreWorld:
    root = tmp_path_factory.mktemp("record")
    w = StoreWorld(root)
    w.register(MODEL, make_tiny_llama(root / "models" / "llama", hidden=32, layers=2, seed=0))
    return w


def test_the_stored_registration_keeps_its_keys_and_reads_back_equal(world: StoreWorld) -> None:
    stored = world.ctx.storage.get_json(model_key(MODEL))
    assert set(stored) == {"format_version", *KEYS} and stored["format_version"] == MODEL_FORMAT_VERSION
    record = get_model(world.ctx, MODEL)
    assert json.loads(json.dumps(record.to_json())) == stored
    assert ModelRecord.model_validate(stored) == record


def test_the_layout_is_parsed_once_when_the_record_is_read(world: StoreWorld) -> None:
    stored = world.ctx.storage.get_json(model_key(MODEL))
    record = get_model(world.ctx, MODEL)
    assert isinstance(record.layout, ModelLayout) and record.layout is record.layout
    assert record.layout == ModelLayout.from_json(stored["layout"])


def test_the_view_is_the_one_earlier_versions_answered(world: StoreWorld) -> None:
    stored = world.ctx.storage.get_json(model_key(MODEL))
    layers = [{k: s[k] for k in ("name", "in_features", "out_features", "bias")} for s in stored["layout"]["layers"]]
    keys = ("model_id", "source", "digest", "architecture", "num_parameters")
    expected = {
        **{k: stored[k] for k in keys},
        "layers": layers,
        "layers_not_in_checkpoint": stored["layout"]["unstored_layers"],
        # added for image models (issue 25): a text model has no refused layer and no kernel
        "refused_layers": {},
        "kind": "text",
        "quantization": None,  # added for GGUF models (issue 36): a safetensors checkpoint has none
    }
    view = model_view(get_model(world.ctx, MODEL))
    assert view == expected and list(view) == list(expected)


def test_a_registration_without_its_version_is_refused_naming_the_migration(world: StoreWorld, tmp_path: Path) -> None:
    stored = world.ctx.storage.get_json(model_key(MODEL))
    old = {k: v for k, v in stored.items() if k != "format_version"}
    world.ctx.storage.put_json(model_key("rec/old"), old)
    with pytest.raises(UnmigratedRecord, match=r"model registration models/rec%2Fold\.json .*engram-service migrate"):
        get_model(world.ctx, "rec/old")
    assert UnmigratedRecord("x", "k", None).status == 503
