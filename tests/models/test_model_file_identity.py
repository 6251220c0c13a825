"""Model files checked at every job against the identity recorded at registration (issue 23, finding 7),
and one tensor stored in two shards refused at registration (issue 23, item 9).

Everything goes through the session's real server (``live_server``: embedded mode, whose job process
keeps its last model loaded between jobs) and real files: each test registers a fresh copy of the
tiny Llama inside the model root, collects and builds a variant while the files are as registered
(so the model is loaded and cached), then changes a shard the way an attacker with write access to
the folder would. On main, the next collection succeeded (the cached model was reused without any
check) and the ones that did check compared sizes and mtimes only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, free_port, wait_concepts_ready, wait_for_job, wait_variant_ready
from service.config import Settings
from service.context import Context
from service.engine.checkpoint import CheckpointReader, combined_digest, file_digests, inspect_model_dir
from service.engine.layout import ModelLayout
from service.engine.model_file_descriptors import ModelFilesChanged, open_model_files, open_without_links
from service.engine.model_files import ModelSourceError
from service.errors import JobFailed
from service.models import loaded
from service.models.loaded import checked_model_files, copy_record
from service.models.record import ModelRecord
from service.storage.local import LocalStorage
from tests.helpers.api import register_model

FACTS = make_facts(24, seed=5)
SHARD = "model.safetensors"
REREGISTER = "re-register the model"


@pytest.fixture(scope="module")
def outside(engram_root: Path) -> Path:
    """A directory outside ENGRAM_MODEL_ROOTS (``engram_root/models``)."""
    path = engram_root / "outside-identity"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture
def folder(model_root: Path, tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Path:
    """A fresh copy of the tiny Llama inside the model root, named after the test."""
    path = model_root / ("identity-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12])
    if path.exists() or path.is_symlink():
        shutil.rmtree(path)
    shutil.copytree(tiny_llama_dir, path)
    return path


def _other_weights(shard: Path) -> bytes:
    """The bytes of ``shard`` with every tensor's data negated: same size, same header, other weights."""
    raw = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        start, end = (8 + length + offset for offset in entry["data_offsets"])
        assert entry["dtype"] == "F32", entry
        values = torch.frombuffer(bytearray(raw[start:end]), dtype=torch.float32)
        raw[start:end] = (-values - 0.5).numpy().tobytes()
    assert len(raw) == shard.stat().st_size
    return bytes(raw)


def _link_to_a_copy_outside(folder: Path, outside: Path) -> None:
    copy = outside / f"{folder.name}-{SHARD}"
    copy.write_bytes(_other_weights(folder / SHARD))
    (folder / SHARD).unlink()
    (folder / SHARD).symlink_to(copy)


def _rewritten_in_place(folder: Path, _outside: Path) -> None:
    data = _other_weights(folder / SHARD)
    with (folder / SHARD).open("r+b") as handle:  # same inode, same size, a new mtime
        handle.write(data)


def _rewritten_in_place_mtime_restored(folder: Path, _outside: Path) -> None:
    before = (folder / SHARD).stat()
    _rewritten_in_place(folder, _outside)
    os.utime(folder / SHARD, ns=(before.st_atime_ns, before.st_mtime_ns))  # only the ctime tells now
    after = (folder / SHARD).stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def _renamed_over(folder: Path, _outside: Path) -> None:
    before = (folder / SHARD).stat()
    staged = folder / ".staged"
    staged.write_bytes(_other_weights(folder / SHARD))
    os.utime(staged, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size and mtime: a new inode only
    os.replace(staged, folder / SHARD)


ATTACKS: dict[str, Callable[[Path, Path], None]] = {
    "link-out": _link_to_a_copy_outside,
    "in-place": _rewritten_in_place,
    "in-place-mtime-restored": _rewritten_in_place_mtime_restored,
    "renamed-over": _renamed_over,
}


def _register(api: httpx.Client, model_id: str, folder: Path) -> httpx.Response:
    return api.post("/models", json={"model_id": model_id, "source": f"file://{folder}"})


def _collect(api: httpx.Client, model_id: str, name: str, facts: list[tuple[str, str]]) -> str:
    """Post a concept on ``model_id``; its collection job's ID."""
    body = {"name": name, "models": [model_id], "records": [{"prompt": p, "completion": c} for p, c in facts]}
    posted = api.post("/concepts", json=body)
    assert posted.status_code in (200, 202), posted.text
    concept = api.get(f"/concepts/{name}").json()
    return str(concept["models"][model_id]["job_id"])


def _assert_failed_naming_the_file(api: httpx.Client, job_id: str) -> None:
    job = wait_for_job(api, job_id)
    assert job["status"] == "failed", job
    detail = job["error"]["detail"]
    assert SHARD in detail and REREGISTER in detail, detail


def _published_statistics(server: LiveServer, digest: str) -> set[Path]:
    return {p for p in (server.storage_dir / "stats" / digest).rglob("*") if p.is_file()}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_shard_changed_after_registration_fails_every_next_job(
    live_server: LiveServer, folder: Path, outside: Path, attack: str
) -> None:
    api = live_server.client
    model_id = f"identity/{attack}"
    digest = register_model(api, model_id, f"file://{folder}")["digest"]
    names = {role: f"identity-{attack}-{role}" for role in ("forget", "retain", "late")}
    jobs = [_collect(api, model_id, names["forget"], FACTS[:4]), _collect(api, model_id, names["retain"], FACTS[4:12])]
    wait_concepts_ready(api, [names["forget"], names["retain"]], model_id)
    body = {"concepts": [names["forget"]], "reference": [names["forget"], names["retain"]]}
    first = api.post(f"/models/{model_id}/unlearn", json=body)
    assert first.status_code in (200, 202), first.text
    wait_variant_ready(api, first.json()["variant"]["variant_id"])  # as registered: the model is loaded now
    published = _published_statistics(live_server, digest)
    assert len(jobs) == 2 and published

    ATTACKS[attack](folder, outside)

    # The next collection (its model cached in the job process) and the next variant build both fail,
    # naming the shard; nothing is published.
    _assert_failed_naming_the_file(api, _collect(api, model_id, names["late"], FACTS[12:20]))
    assert api.get(f"/concepts/{names['late']}").json()["models"][model_id]["status"] == "failed"
    again = api.post(f"/models/{model_id}/unlearn", json={**body, "alpha": 0.5})
    assert again.status_code == 202, again.text
    _assert_failed_naming_the_file(api, again.json()["job"]["job_id"])
    assert api.get(f"/variants/{again.json()['variant']['variant_id']}").json()["status"] != "ready"
    assert _published_statistics(live_server, digest) == published

    # Re-registering (the same request again) registers the files as they are now: other weights.
    renewed = _register(api, model_id, folder)
    if attack == "link-out":  # a shard leading out of the folder is refused, as at any registration
        assert renewed.status_code == 422, renewed.text
        assert SHARD in renewed.json()["detail"]
        assert api.get(f"/models/{model_id}").json()["digest"] == digest
        return
    assert renewed.status_code == 201, renewed.text
    assert renewed.json()["digest"] != digest
    assert _register(api, model_id, folder).status_code == 200  # unchanged since: the same registration


def test_what_the_identity_sees_and_what_re_registering_does(live_server: LiveServer, folder: Path) -> None:
    """Reading a file (its atime) or adding one the service does not use changes nothing; a ``chmod``
    (a new ctime, the same bytes) fails the next job like any change of identity, and posting the
    registration again, as the job says, registers the files as they are (the same digest here)."""
    api = live_server.client
    model_id = "identity/chmod"
    registered = register_model(api, model_id, f"file://{folder}")
    (folder / SHARD).read_bytes()
    (folder / "README.md").write_text("not a file the service uses")
    assert _register(api, model_id, folder).status_code == 200
    job = wait_for_job(api, _collect(api, model_id, "identity-chmod", FACTS[:6]))
    assert job["status"] == "succeeded", job
    os.chmod(folder / SHARD, 0o600)
    _assert_failed_naming_the_file(api, _collect(api, model_id, "identity-chmod-late", FACTS[6:12]))
    renewed = _register(api, model_id, folder)
    assert renewed.status_code == 201, renewed.text
    assert renewed.json()["digest"] == registered["digest"]
    job = wait_for_job(api, _collect(api, model_id, "identity-chmod-again", FACTS[12:18]))
    assert job["status"] == "succeeded", job


# ---------------------------------------------------------------- one tensor in two shards


def _two_shards_with_a_duplicate(folder: Path, key: str) -> tuple[str, str]:
    """Split the checkpoint into two shards, ``key`` stored in both with different values."""
    tensors = load_file(str(folder / SHARD))
    keys = sorted(tensors)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    half = len(keys) // 2
    shard_of = {k: first if i < half else second for i, k in enumerate(keys)}
    assert shard_of[key] == first
    save_file({k: tensors[k] for k in keys if shard_of[k] == first}, str(folder / first), metadata={"format": "pt"})
    later = {k: tensors[k] for k in keys if shard_of[k] == second}
    later[key] = tensors[key] + 1.0  # the copy transformers would not load, and a variant would edit too
    save_file(later, str(folder / second), metadata={"format": "pt"})
    (folder / SHARD).unlink()
    index = {"metadata": {"total_size": 0}, "weight_map": shard_of}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return first, second


def test_a_tensor_stored_in_two_shards_is_refused_at_registration(live_server: LiveServer, folder: Path) -> None:
    api = live_server.client
    key = sorted(load_file(str(folder / SHARD)))[0]
    first, second = _two_shards_with_a_duplicate(folder, key)
    model_id = "identity/duplicate-tensor"
    response = _register(api, model_id, folder)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    detail = response.json()["detail"]
    assert key in detail and first in detail and second in detail, detail
    assert api.get(f"/models/{model_id}").status_code == 404


# ---------------------------------------------------------------- the descriptors themselves


def test_reads_go_through_the_descriptor_checked_not_the_name(folder: Path, outside: Path) -> None:
    """A shard swapped for other weights after the files were opened and checked is never read: the
    descriptor's path still reads the checked file. (Unlinking that file changed its ctime, so a
    reader that checks after each read refuses to go on, and a job opening the folder afresh sees a
    new file.)"""
    layout = inspect_model_dir(folder)
    key = layout.weight_keys[layout.layers[0].name]
    original = load_file(str(folder / SHARD))[key]
    with open_model_files(folder) as files:
        reader = CheckpointReader(files, layout)
        _renamed_over(folder, outside)
        assert not torch.equal(load_file(str(folder / SHARD))[key], original)  # the name holds other weights now
        assert torch.equal(load_file(str(files.path(SHARD)))[key], original)
        with pytest.raises(ModelFilesChanged, match=SHARD):
            reader.tensor(key)
        with pytest.raises(ModelFilesChanged, match=f"{SHARD} is not the file registered.*inode"):
            open_model_files(folder).check(files.identity())


def test_a_shard_written_while_a_job_reads_it_fails_the_read_and_the_job(folder: Path, outside: Path) -> None:
    """A model loaded on the CPU maps its shards (transformers with safetensors), so a write in place
    while a job runs changes the weights it uses: each checkpoint read checks its shard afterwards,
    a variant's writer checks every file before it finishes, and the jobs that run a loaded model
    check again before they publish (``check_model_unchanged``)."""
    layout = inspect_model_dir(folder)
    key = layout.weight_keys[layout.layers[0].name]
    with open_model_files(folder) as files:
        reader = CheckpointReader(files, layout)
        reader.tensor(key)
        _rewritten_in_place(folder, outside)
        with pytest.raises(ModelFilesChanged, match=f"{SHARD} was written.*{REREGISTER}"):
            reader.tensor(key)
        with pytest.raises(ModelFilesChanged, match=SHARD):
            files.check_unchanged()


def test_a_link_put_into_the_path_or_a_fifo_in_place_of_a_file_is_refused_without_blocking(
    folder: Path, outside: Path
) -> None:
    """What :func:`open_without_links` refuses when the folder changes between its checks and the open."""
    real = (folder / SHARD).resolve()
    linked_parent = outside / f"{folder.name}-link"
    linked_parent.symlink_to(folder, target_is_directory=True)
    with pytest.raises(ModelSourceError, match="symbolic link"):
        open_without_links(linked_parent / SHARD, SHARD)
    fifo = outside / f"{folder.name}.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ModelSourceError, match="not a regular file"):
        open_without_links(fifo, SHARD)  # no writer: a blocking open would hang here
    os.close(open_without_links(real, SHARD))


def test_a_remote_models_private_copy_is_hashed_once_per_machine_then_checked_by_identity(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``s3://`` model's copy on this machine (another machine's registration recorded other inodes):
    its content is checked once, then its identity; a copy changed since fails naming the file.
    ``file_digests`` is replaced by a spy that refuses, only to show the second job hashes nothing."""
    source = "s3://bucket/models/identity/"
    cache = tmp_path / "cache"
    copy = cache / "s3" / hashlib.sha256(source.encode()).hexdigest()
    shutil.copytree(tiny_llama_dir, copy)
    unreachable = f"http://127.0.0.1:{free_port()}"  # the cached copy is used: S3 is never asked
    settings = Settings(cache_dir=cache, s3_endpoint_url=unreachable, model_buckets="bucket")
    store, lock = LocalStorage(tmp_path / "store"), threading.RLock()
    ctx = Context(settings=settings, storage=store, jobs=None, dispatch=None, lock=lock)  # type: ignore[arg-type]
    with open_model_files(copy) as files:
        sums = file_digests(files)
    manifest = ModelRecord(
        model_id="identity/s3",
        source=source,
        path=str(copy),
        digest=combined_digest(sums),
        file_sha256=sums,
        architecture="LlamaForCausalLM",
        num_parameters=0,
        layout=ModelLayout("LlamaForCausalLM", 0, [], {}, {}),  # not read by the check
    )
    with checked_model_files(ctx, manifest) as files:
        assert files.folder == copy
    assert copy_record(ctx, copy).is_file()

    def no_hashing(_files: object) -> dict[str, str]:
        raise AssertionError("a job hashed a checkpoint whose identity is known")

    monkeypatch.setattr(loaded, "file_digests", no_hashing)
    checked_model_files(ctx, manifest).close()
    monkeypatch.undo()
    _rewritten_in_place_mtime_restored(copy, tmp_path)
    with pytest.raises(JobFailed, match=f"{SHARD} has other content.*{REREGISTER}"):
        checked_model_files(ctx, manifest)
