"""A universe built on S3 storage (a real SeaweedFS server) equals the one built on file storage:
rows read by byte range (only the header and one tensor cross the wire), factors kept from this
process's own decomposition or downloaded into its cache for the engrams, group shapes in the
manifest read from the part records.

Tolerance: the same process, the same inputs: factors and engrams bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from service.config import Settings
from service.context import Context
from service.engine.stats_io import load_statistics
from service.jobs.store import JobStore
from service.storage.keys import engram_key, group_key, universe_prefix
from service.storage.s3 import S3Storage
from service.universes.build import ensure_universe
from service.universes.factors import load_factors, stored_rows
from service.universes.service import submit_universe
from tests.helpers.s3 import SeaweedServer
from tests.helpers.store_world import StoreWorld, text_records


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two one-record concepts on a tiny Llama (hidden 64, MLP 128): the MLP input is decomposed from
    rows, the others from sums; the universe recorded, not built."""
    root = tmp_path_factory.mktemp("universe-s3")
    w = StoreWorld(root)
    w.tiny_llama("s/llama", {"one": text_records(2, 3), "two": text_records(3, 4)}, hidden=64, seed=3)
    view, job = submit_universe(w.ctx, "s/llama", None, None)
    assert job is not None
    return {"world": w, "universe_id": view.universe_id}


@pytest.fixture
def s3_ctx(world: dict[str, Any], seaweed: SeaweedServer, s3_bucket: str, tmp_path: Path) -> Context:
    """A context on S3 holding every object of the file store (nothing of the universe built)."""
    w: StoreWorld = world["world"]
    storage = S3Storage(seaweed.client(), s3_bucket, "universe/")
    for key in w.ctx.storage.list(""):
        if not key.startswith(universe_prefix(world["universe_id"])) or key.endswith("request.json"):
            storage.put_file(key, w.ctx.storage.local_path(key))
    settings = Settings(storage_url=f"s3://{s3_bucket}/universe", model_roots=str(w.root / "models"), cache_dir=tmp_path)
    return Context(settings=settings, storage=storage, jobs=JobStore(storage), dispatch=None, lock=None)


def test_rows_are_read_by_byte_range(world: dict[str, Any], s3_ctx: Context) -> None:
    w: StoreWorld = world["world"]
    key = w.ctx.storage.get_json("concepts/one.json")["models"]["s/llama"]["stats"] + "statistics.safetensors"
    expected = load_statistics(w.ctx.storage.local_path(key))
    assert expected.factors, "one record: groups are stored as rows"
    for group, rows in expected.factors.items():
        assert torch.equal(stored_rows(s3_ctx.storage, key, group), rows), group


def test_a_universe_built_on_s3_equals_the_file_storage_build(world: dict[str, Any], s3_ctx: Context) -> None:
    w: StoreWorld = world["world"]
    uid = world["universe_id"]
    built, existed = ensure_universe(s3_ctx, uid)
    on_s3 = built.to_json()
    assert not existed
    on_files = ensure_universe(w.ctx, uid)[0].to_json()
    assert {g: i["source"] for g, i in on_s3["groups"].items()} == {g: i["source"] for g, i in on_files["groups"].items()}
    assert "rows" in {i["source"] for i in on_s3["groups"].values()}
    shape = ("dim", "rank", "explicit", "bytes", "layers")
    for group, info in on_s3["groups"].items():
        assert {k: info[k] for k in shape} == {k: on_files["groups"][group][k] for k in shape}, group
        ours = load_factors(_download(s3_ctx, group_key(uid, group), w.root / "dl"))
        theirs = load_factors(w.ctx.storage.local_path(group_key(uid, group)))
        assert torch.equal(ours.inverse_eigenvalues, theirs.inverse_eigenvalues), group
    assert on_s3["bytes"] == on_files["bytes"] and on_s3["engrams"] == on_files["engrams"]
    # Another builder (nothing of its own decomposition at hand) computes the members from the
    # published factors, downloaded into its cache.
    for member in on_s3["engrams"]:
        for suffix in (".safetensors", ".json"):
            s3_ctx.storage.delete(engram_key(uid, member, suffix))
    s3_ctx.storage.delete(universe_prefix(uid) + "manifest.json")
    again, existed = ensure_universe(s3_ctx, uid)
    assert not existed and again.to_json()["engrams"] == on_s3["engrams"]
    assert len(list((s3_ctx.settings.cache_dir / "universes").glob("*.safetensors"))) == len(on_s3["groups"])
    for member in on_s3["engrams"]:
        with (
            safe_open(str(_download(s3_ctx, engram_key(uid, member), w.root / "dl")), "pt") as ours,
            safe_open(str(w.ctx.storage.local_path(engram_key(uid, member))), "pt") as theirs,
        ):
            for layer in on_s3["layers"]:
                assert torch.equal(ours.get_tensor(layer), theirs.get_tensor(layer)), (member, layer)


def _download(ctx: Context, key: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / key.replace("/", "_")
    ctx.storage.download(key, target)
    return target
