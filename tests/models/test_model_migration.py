"""A registration stored before ``kind`` was recorded (version 1 without it, 0.1.0's without a
version) is refused by name until ``engram-service migrate`` records the kind registration gives the
folder: an image classifier registered then must not read as text (issue 25).

The store is real (file storage); the models are a tiny ResNet and a tiny Llama registered by the
register job's own function; the old records are their registrations as those versions wrote them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from engram_fixtures.models import make_tiny_llama
from engram_fixtures.vision import make_tiny_resnet
from service.models.migrate import migrate_models, registration_of_any_version
from service.models.record import MODEL_FORMAT_VERSION
from service.models.registry import get_model, list_models
from service.models.stored import UnmigratedRecord
from service.storage.keys import model_key
from service.variants.migrate import migrate_store
from tests.helpers.store_world import StoreWorld

IMAGE = "old/resnet"
TEXT = "old/llama"


@pytest.fixture
def world(tmp_path: Path) -> StoreWorld:
    w = StoreWorld(tmp_path)
    w.register(IMAGE, make_tiny_resnet(tmp_path / "models" / "resnet", seed=0))
    w.register(TEXT, make_tiny_llama(tmp_path / "models" / "llama", hidden=32, layers=2, seed=0))
    return w


def as_version_1(stored: dict[str, Any]) -> dict[str, Any]:
    """A registration as version 1 wrote it before kinds (commit f9474c4 added ``kind``)."""
    return {**{k: v for k, v in stored.items() if k != "kind"}, "format_version": 1}


def as_0_1_0(stored: dict[str, Any]) -> dict[str, Any]:
    """A registration as 0.1.0 wrote it: no version, no kind."""
    return {k: v for k, v in stored.items() if k not in ("kind", "format_version")}


@pytest.mark.parametrize("old_format", [as_version_1, as_0_1_0])
def test_models_registered_before_kinds_are_refused_then_migrated_to_the_kind_registration_gives(
    world: StoreWorld, old_format: Any
) -> None:
    current = {m: world.ctx.storage.get_json(model_key(m)) for m in (IMAGE, TEXT)}
    assert (current[IMAGE]["kind"], current[TEXT]["kind"]) == ("image", "text")
    assert current[IMAGE]["format_version"] == MODEL_FORMAT_VERSION == 2
    for model_id, stored in current.items():
        world.ctx.storage.put_json(model_key(model_id), old_format(stored))

    # Read as it is, the old image registration would be a text model: refused by name instead.
    with pytest.raises(UnmigratedRecord, match=rf"model registration {model_key(IMAGE)} .*engram-service migrate"):
        get_model(world.ctx, IMAGE)
    assert list_models(world.ctx) == [], "a listing leaves each out (a warning names it); reading one refuses it"
    dry = registration_of_any_version(world.ctx, IMAGE)
    assert dry is not None and dry.kind == "image"  # what a dry run reads, before anything is rewritten

    done = migrate_store(world.ctx)
    assert done.refused == []
    assert dict(done.changed) == {
        model_key(IMAGE): f"format_version {old_format(current[IMAGE]).get('format_version')!r} -> 2, "
        "kind 'image' from its config.json",
        model_key(TEXT): f"format_version {old_format(current[TEXT]).get('format_version')!r} -> 2, "
        "kind 'text' from its config.json",
    }
    for model_id, stored in current.items():  # byte for byte what registering now writes
        assert world.ctx.storage.get_json(model_key(model_id)) == stored
    assert get_model(world.ctx, IMAGE).kind == "image" and get_model(world.ctx, TEXT).kind == "text"
    assert migrate_models(world.ctx).changed == []  # once


def test_an_old_registration_whose_folder_cannot_say_is_refused_by_name_and_left_as_it_was(world: StoreWorld) -> None:
    stored = world.ctx.storage.get_json(model_key(IMAGE))
    old = as_version_1(stored)
    world.ctx.storage.put_json(model_key(IMAGE), old)
    shutil.rmtree(stored["path"])

    done = migrate_models(world.ctx)
    ((key, why),) = done.refused
    assert key == model_key(IMAGE)
    assert f"its folder {stored['path']} cannot say" in why and "config.json" in why and "register it again" in why
    assert world.ctx.storage.get_json(model_key(IMAGE)) == old
    assert registration_of_any_version(world.ctx, IMAGE) is None
    with pytest.raises(UnmigratedRecord, match="engram-service migrate"):
        get_model(world.ctx, IMAGE)


def test_an_image_folder_without_its_processor_config_is_refused_as_registration_refuses_it(world: StoreWorld) -> None:
    stored = world.ctx.storage.get_json(model_key(IMAGE))
    world.ctx.storage.put_json(model_key(IMAGE), as_0_1_0(stored))
    (Path(stored["path"]) / "preprocessor_config.json").unlink()

    ((key, why),) = migrate_models(world.ctx).refused
    assert key == model_key(IMAGE) and "preprocessor_config.json" in why and "register it again" in why


def test_a_version_1_registration_that_recorded_its_kind_keeps_it(world: StoreWorld) -> None:
    stored = world.ctx.storage.get_json(model_key(IMAGE))
    world.ctx.storage.put_json(model_key(IMAGE), {**stored, "format_version": 1})
    shutil.rmtree(stored["path"])  # the kind recorded is the registration's: the folder is not read

    done = migrate_models(world.ctx)
    assert done.refused == [] and dict(done.changed) == {model_key(IMAGE): "format_version 1 -> 2"}
    assert world.ctx.storage.get_json(model_key(IMAGE)) == stored


def test_a_registration_of_a_newer_version_is_refused_naming_an_upgrade(world: StoreWorld) -> None:
    stored = world.ctx.storage.get_json(model_key(TEXT))
    world.ctx.storage.put_json(model_key(TEXT), {**stored, "format_version": 3})
    with pytest.raises(UnmigratedRecord, match=r"format version 3, not 2: data written by a newer version"):
        get_model(world.ctx, TEXT)
