"""One pass over the bytes (issue 27): a variant job hashes no checkpoint byte of a registered model
whose files are unchanged, hashes its own files as it writes them (never reading them back), moves
them into the store (a rename on ``file://``), and leaves nothing behind when it fails.

Every file hash of the service goes through :func:`service.engine.checkpoint._sha256_of`: a spy
there counts what was read to be hashed, file by file. The written files' digests are checked
against ``hashlib`` over the stored bytes (an independent computation).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from engram_fixtures.models import make_tiny_llama, make_tokenizer
from service.engine import checkpoint, safetensors_stream
from service.models.record import ModelRecord
from service.storage.base import owner_tag
from service.storage.keys import model_key
from service.storage.local import LocalStorage
from service.variants.service import submit_variant
from tests.helpers.store_world import StoreWorld, text_records

SHARD = "model.safetensors"
MODELS = ("one/llama", "one/changed", "one/legacy")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three registered copies of one tiny Llama (one is changed in place, one loses its recorded
    identity), each with concepts forget / retain published."""
    root = tmp_path_factory.mktemp("one-pass")
    w = StoreWorld(root)
    base = make_tiny_llama(root / "models" / "base", hidden=32, layers=2, seed=0, tokenizer=make_tokenizer())
    paths = {}
    for model_id in MODELS:
        path = root / "models" / model_id.replace("/", "-")
        shutil.copytree(base, path)
        paths[model_id] = path
        w.register(model_id, path)
        w.publish(model_id, "forget", text_records(0, 30))
        w.publish(model_id, "retain", text_records(30, 90))
    return {"world": w, "paths": paths}


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """``(file, bytes)`` of every file hashed by reading it while the test runs."""
    seen: list[tuple[str, int]] = []
    original = checkpoint._sha256_of

    def counting(handle: BinaryIO) -> str:
        seen.append((os.path.realpath(f"/proc/self/fd/{handle.fileno()}"), os.fstat(handle.fileno()).st_size))
        return original(handle)

    monkeypatch.setattr(checkpoint, "_sha256_of", counting)
    return seen


_alpha = iter(-0.9 + 0.01 * k for k in range(1000))  # a new alpha each time: never a stored variant


def _submit(w: StoreWorld, model_id: str, fmt: str = "checkpoint") -> str:
    options = {"scaling": "uniform", "format": fmt, "reference": ["forget", "retain"]}
    view, job = submit_variant(w.ctx, model_id, {"forget": next(_alpha)}, None, options)
    assert job is not None, view
    return str(view.variant_id)


def _run(w: StoreWorld) -> Any:
    [done] = w.run_pending()
    return done


def _keys(w: StoreWorld, variant_id: str) -> list[str]:
    return w.ctx.storage.list(f"variants/{variant_id}/")


def _leftovers(w: StoreWorld) -> list[str]:
    """Temporary files and folders of this process: in the store's ``.tmp`` and in the temp dir."""
    storage = w.ctx.storage
    assert isinstance(storage, LocalStorage)
    in_store = [p.name for p in storage.tmp_dir.iterdir()]
    scratch = [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("engram-variant") and owner_tag() in p]
    return in_store + scratch


@pytest.mark.parametrize("fmt", ["checkpoint", "delta"])
def test_a_variant_of_an_unchanged_model_hashes_nothing_and_records_the_digests_of_what_it_wrote(
    world: dict[str, Any], hashed: list[tuple[str, int]], fmt: str
) -> None:
    w: StoreWorld = world["world"]
    variant_id = _submit(w, "one/llama", fmt)
    done = _run(w)
    assert done.status == "succeeded", done
    assert hashed == [], "a job read files to hash them: the model's (known identity) or its own output"
    manifest = w.ctx.storage.get_json(f"variants/{variant_id}/manifest.json")
    stored = {f"variants/{variant_id}/files/{f['path']}": f for f in manifest["files"]}
    assert sorted(stored) == [k for k in _keys(w, variant_id) if "/files/" in k]
    assert (SHARD if fmt == "checkpoint" else "delta.safetensors") in {f["path"] for f in manifest["files"]}
    for key, entry in stored.items():
        data = w.ctx.storage.get_bytes(key)
        assert entry["size"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest(), key
    assert _leftovers(w) == []


def test_the_stream_writer_hashes_exactly_the_bytes_it_writes(tmp_path: Path) -> None:
    """Produced tensors, kernel-copied ones and the header: the sink's digest is the file's."""
    import torch
    from safetensors.torch import load_file, save_file

    source = tmp_path / "source.safetensors"
    save_file({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}, str(source))
    entries, _ = safetensors_stream.read_header(source)
    planned = [
        safetensors_stream.Planned("a", entries["a"], source, lambda: torch.full((2, 3), 7.0)),
        safetensors_stream.Planned("b", entries["b"], source),
    ]
    target, sink = tmp_path / "out.safetensors", safetensors_stream.HashingSink()
    safetensors_stream.write_streaming(target, planned, {"format": "pt"}, sink)
    data = target.read_bytes()
    assert sink.written() == safetensors_stream.WrittenFile(len(data), hashlib.sha256(data).hexdigest())
    loaded = load_file(str(target))
    assert torch.equal(loaded["a"], torch.full((2, 3), 7.0)) and torch.equal(
        loaded["b"], torch.ones(5, dtype=torch.bfloat16)
    )


def _rewrite_in_place_keeping_size_and_mtime(shard: Path) -> None:
    """Other weights in the same inode, same size, the mtime set back: only the ctime tells."""
    before = shard.stat()
    raw = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    start = 8 + length
    raw[start:] = bytes(b ^ 0x55 for b in raw[start:])
    with shard.open("r+b") as handle:
        handle.write(raw)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = shard.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


# What was asked, kept when a build fails: the request and its provenance (who, when, labels); nothing of the variant.
ASKED = ("provenance.json", "request.json")


def test_a_model_file_changed_in_place_is_still_caught(world: dict[str, Any], hashed: list[tuple[str, int]]) -> None:
    w: StoreWorld = world["world"]
    _submit(w, "one/changed")
    assert _run(w).status == "succeeded"
    _rewrite_in_place_keeping_size_and_mtime(world["paths"]["one/changed"] / SHARD)
    variant_id = _submit(w, "one/changed")
    done = _run(w)
    assert done.status == "failed", done
    assert done.error is not None and SHARD in done.error.detail and "re-register the model" in done.error.detail
    assert _keys(w, variant_id) == [f"variants/{variant_id}/{name}" for name in ASKED]
    assert hashed == [], "caught by identity, without hashing"
    assert _leftovers(w) == []


def test_a_registration_without_identity_is_hashed_once_then_checked_by_identity(
    world: dict[str, Any], hashed: list[tuple[str, int]]
) -> None:
    w: StoreWorld = world["world"]
    key = model_key("one/legacy")
    record = ModelRecord.model_validate(w.ctx.storage.get_json(key))
    w.ctx.storage.put_json(key, record.model_copy(update={"identity": None}).to_json())  # as older registrations
    _submit(w, "one/legacy")
    assert _run(w).status == "succeeded"
    folder = os.path.realpath(world["paths"]["one/legacy"])
    first = [name for name, _ in hashed]
    assert os.path.join(folder, SHARD) in first, hashed  # the content decided, once
    assert ModelRecord.model_validate(w.ctx.storage.get_json(key)).registered_identity() is not None
    hashed.clear()
    _submit(w, "one/legacy")
    assert _run(w).status == "succeeded"
    assert hashed == [], "the identity recorded on the first full check is what the next job checks"


def _fail_mid_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard's first produced tensor is half written when the writer fails."""
    original = safetensors_stream._write_all

    def half_then_fail(out: BinaryIO, data: bytes | memoryview, sink: Any = None) -> None:
        view = memoryview(data).cast("B")
        if view.nbytes > 1024:
            original(out, view[: view.nbytes // 2], sink)
            raise OSError("the disk went away mid-write")
        original(out, view, sink)

    monkeypatch.setattr(safetensors_stream, "_write_all", half_then_fail)


def _fail_publishing_the_second_file(monkeypatch: pytest.MonkeyPatch) -> None:
    original, moved = LocalStorage.move_file, list[str]()

    def second_fails(self: LocalStorage, key: str, source: Path) -> None:
        if moved:
            raise OSError("the store went away mid-publish")
        moved.append(key)
        original(self, key, source)

    monkeypatch.setattr(LocalStorage, "move_file", second_fails)


def _fail_the_manifest(monkeypatch: pytest.MonkeyPatch) -> None:
    original = LocalStorage.put_json

    def refuse_manifests(self: LocalStorage, key: str, value: Any) -> None:
        if key.endswith("/manifest.json") and key.startswith("variants/"):
            raise OSError("the store went away before the manifest")
        original(self, key, value)

    monkeypatch.setattr(LocalStorage, "put_json", refuse_manifests)


FAILURES: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "mid-write": _fail_mid_write,
    "mid-publish": _fail_publishing_the_second_file,
    "at-the-manifest": _fail_the_manifest,
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failure_leaves_no_partial_artifact_and_no_temporary_file(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    w: StoreWorld = world["world"]
    variant_id = _submit(w, "one/llama")
    with monkeypatch.context() as patch:
        FAILURES[failure](patch)
        done = _run(w)
    assert done.status == "failed", done
    assert "went away" in (done.error.detail if done.error else ""), done
    kept = [f"variants/{variant_id}/{name}" for name in ASKED]
    assert _keys(w, variant_id) == kept, "no file and no manifest of the variant"
    assert _leftovers(w) == []
