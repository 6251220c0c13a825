"""Model folders are untrusted (issue 11, items 1 and 2): links leading out and shard names used as paths.

Real files and real symbolic links in temporary directories; registrations and variants go through
the session's real server (``live_server``), whose only model root is ``engram_root/models``. Every
secret lives outside that root, and every "refused" case is one the service used to accept.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors import safe_open

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, free_port, wait_concepts_ready, wait_for_job, wait_variant_ready
from service.config import Settings
from service.context import Context
from service.engine.checkpoint import CheckpointReader, directory_digest, inspect_model_dir, load_model, load_tokenizer
from service.engine.checkpoint_write import write_checkpoint, write_delta
from service.engine.layout import ModelLayout
from service.engine.model_file_descriptors import open_model_files
from service.engine.model_files import SIDE_FILES, ModelSourceError, target_file, used_files
from service.errors import InvalidInput, JobFailed
from service.models.loaded import checked_model_files
from service.models.record import MODEL_FORMAT_VERSION, ModelRecord
from service.models.registry import file_fingerprint
from service.models.sources import local_model_dir
from service.storage.keys import model_key
from service.storage.local import LocalStorage
from tests.helpers.api import register_model
from tests.helpers.hub import hub_snapshot

SECRET = b"ENGRAM_API_KEYS=read-key-0123456789abcdef\nAWS_SECRET_ACCESS_KEY=hunter2-hunter2\n"
INDEX = "model.safetensors.index.json"
FACTS = make_facts(24, seed=3)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def outside(engram_root: Path, tiny_llama_dir: Path) -> Path:
    """A directory outside ENGRAM_MODEL_ROOTS: a whole valid checkpoint plus ``environ`` (the secret)."""
    path = engram_root / "outside-safety"
    if not path.exists():
        shutil.copytree(tiny_llama_dir, path)
        (path / "environ").write_bytes(SECRET)
    return path


@pytest.fixture
def folder(model_root: Path, tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Path:
    """A fresh copy of the tiny Llama inside the model root, named after the test."""
    name = "safety-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    path = model_root / name
    if path.exists() or path.is_symlink():
        shutil.rmtree(path)
    shutil.copytree(tiny_llama_dir, path)
    return path


def register(api: httpx.Client, model_id: str, path: Path) -> httpx.Response:
    return api.post("/models", json={"model_id": model_id, "source": f"file://{path}"})


def assert_refused(api: httpx.Client, response: httpx.Response, model_id: str, *mentions: str) -> str:
    """A 422 problem naming every ``mentions``; the model was not registered."""
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    detail = response.json()["detail"]
    for mention in mentions:
        assert mention in detail, detail
    assert SECRET.decode().split("\n")[0] not in detail
    assert api.get(f"/models/{model_id}").status_code == 404
    return detail


def keys_of(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as handle:
        return list(handle.keys())  # noqa: SIM118


def shard_to(folder: Path, shard: str) -> None:
    """Make ``folder`` a sharded checkpoint whose index maps every tensor to ``shard``."""
    keys = keys_of(folder / "model.safetensors")
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(keys, shard)}))
    (folder / "model.safetensors").unlink()


def state(path: Path) -> tuple[bytes, int, int]:
    """Bytes, size and mtime: what a file must keep when the service never opens it for writing."""
    st = path.stat()
    return path.read_bytes(), st.st_size, st.st_mtime_ns


def present_side_files(path: Path) -> set[str]:
    return {name for name in SIDE_FILES if (path / name).is_file()}


def no_edit(_spec: Any) -> None:
    return None


def add_side_junk(path: Path) -> None:
    """Files no variant should carry: a README, secrets, an adapter config, a subfolder, code."""
    (path / "README.md").write_text("# tiny\n" + SECRET.decode())
    (path / "secrets.txt").write_bytes(SECRET)
    (path / "notes.json").write_text(json.dumps({"secret": SECRET.decode()}))
    (path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/etc", "peft_type": "LORA"}))
    (path / "modeling_evil.py").write_text("raise SystemExit('never imported')\n")
    (path / "sub").mkdir()
    (path / "sub" / "tokenizer.json").write_bytes(SECRET)
    # A link that stays inside the folder is followed: generation_config.json is gen.json's content.
    (path / "generation_config.json").rename(path / "gen.json")
    (path / "generation_config.json").symlink_to("gen.json")


# ---------------------------------------------------------------- links leading out: registration


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("secrets.txt", "environ"),  # not a file the service reads: refused anyway
        ("README.md", "environ"),
        ("tokenizer_config.json", "tokenizer_config.json"),  # a valid file, but outside the roots
        ("config.json", "config.json"),
        ("model.safetensors", "model.safetensors"),
        ("generation_config.json", "generation_config.json"),
    ],
)
def test_a_file_linking_out_of_the_folder_is_refused_at_registration(
    api: httpx.Client, folder: Path, outside: Path, name: str, target: str
) -> None:
    link = folder / name
    link.unlink(missing_ok=True)
    link.symlink_to(outside / target)
    model_id = f"safety/link-{name.replace('.', '-')}"
    detail = assert_refused(api, register(api, model_id, folder), model_id, name, "symbolic link")
    assert str(outside) not in detail  # where the link leads is none of the caller's business


def test_a_folder_whose_files_all_link_outside_the_roots_is_refused(
    api: httpx.Client, model_root: Path, outside: Path
) -> None:
    path = model_root / "safety-all-links"
    if not path.exists():
        path.mkdir()
        for file in outside.iterdir():
            if file.name != "environ":
                (path / file.name).symlink_to(file)
    assert_refused(api, register(api, "safety/all-links", path), "safety/all-links", "config.json", "symbolic link")


def test_a_link_to_a_directory_outside_is_refused(api: httpx.Client, folder: Path, outside: Path) -> None:
    (folder / "more").symlink_to(outside, target_is_directory=True)
    assert_refused(api, register(api, "safety/dir-link", folder), "safety/dir-link", "more")


def test_a_dangling_link_in_a_used_name_is_refused(api: httpx.Client, folder: Path) -> None:
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").symlink_to(folder / "nowhere.json")
    assert_refused(api, register(api, "safety/dangling", folder), "safety/dangling", "tokenizer_config.json")


# ---------------------------------------------------------------- shard names: registration


@pytest.mark.parametrize("kind", ["absolute", "parent", "subfolder", "missing", "dot", "not-safetensors", "backslash"])
def test_an_index_shard_name_that_is_not_a_plain_file_in_the_folder_is_refused(
    api: httpx.Client, folder: Path, model_root: Path, kind: str
) -> None:
    # Every sentinel is a valid copy of the weights: before, the service read it (or truncated it).
    weights = (folder / "model.safetensors").read_bytes()
    sentinels: list[Path] = []
    if kind == "absolute":
        sentinel = model_root.parent / f"sentinel-{folder.name}.safetensors"
        shard = str(sentinel)
    elif kind == "parent":
        sentinel = model_root / f"sentinel-{folder.name}.safetensors"
        shard = f"../{sentinel.name}"
    elif kind == "subfolder":
        (folder / "sub").mkdir()
        sentinel = folder / "sub" / "x.safetensors"
        shard = "sub/x.safetensors"
    elif kind == "backslash":
        sentinel = folder / "a\\x.safetensors"  # a legal Linux file name, a path on Windows
        shard = "a\\x.safetensors"
    elif kind == "missing":
        sentinel, shard = folder / "present.safetensors", "missing.safetensors"
    elif kind == "dot":
        sentinel, shard = folder / "present.safetensors", "."
    else:
        sentinel, shard = folder / "model.bin.keep", "model.bin"
        (folder / "model.bin").write_bytes(weights)
        sentinels.append(folder / "model.bin")
    sentinel.write_bytes(weights)
    sentinels.append(sentinel)
    before = {path: state(path) for path in sentinels}
    shard_to(folder, shard)
    model_id = f"safety/shard-{kind}"
    assert_refused(api, register(api, model_id, folder), model_id, INDEX, repr(shard)[1:-1])
    assert {path: state(path) for path in sentinels} == before


def test_an_index_without_a_weight_map_object_is_refused(api: httpx.Client, folder: Path) -> None:
    (folder / INDEX).write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    assert_refused(api, register(api, "safety/bad-index", folder), "safety/bad-index", INDEX)


def test_a_tokenizer_config_naming_fast_tokenizer_files_outside_is_refused(
    api: httpx.Client, folder: Path, outside: Path
) -> None:
    """transformers opens fast_tokenizer_files entries as paths joined to the folder (an absolute one anywhere)."""
    elsewhere = outside / "tokenizer.0.0.1.json"
    shutil.copyfile(outside / "tokenizer.json", elsewhere)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "fast_tokenizer_files": [str(elsewhere)]}))
    assert_refused(api, register(api, "safety/fast-files", folder), "safety/fast-files", "tokenizer_config.json")
    with pytest.raises(ModelSourceError, match="fast_tokenizer_files"):
        load_tokenizer(folder)


# ---------------------------------------------------------------- the engine on its own


def test_writers_never_open_a_shard_named_outside_even_after_registration(folder: Path, model_root: Path) -> None:
    """The probe's attack: the index is changed after registration to name files outside."""
    shutil.copyfile(folder / "model.safetensors", folder / "model-00001.safetensors")
    shard_to(folder, "model-00001.safetensors")
    layout = inspect_model_dir(folder)
    sentinel = model_root.parent / f"victim-{folder.name}.safetensors"
    sentinel.write_bytes((folder / "model-00001.safetensors").read_bytes())
    before = state(sentinel)
    target = folder.parent / f"out-{folder.name}"
    for shard in (str(sentinel), f"../../{sentinel.name}", f"../{folder.name}/../../{sentinel.name}"):
        (folder / INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(layout.key_files, shard)}))
        for write in (
            lambda t: write_checkpoint(folder, t, layout, no_edit, set()),
            lambda t: write_delta(folder, t / "delta.safetensors", layout, no_edit, set(), {}),
        ):
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            with pytest.raises(ModelSourceError, match="names the shard"):
                write(target)
            assert list(target.iterdir()) == []
        assert state(sentinel) == before
    # A layout (the manifest's) naming a path is refused before anything is read.
    forged = ModelLayout.from_json({**layout.to_json(), "key_files": dict.fromkeys(layout.key_files, str(sentinel))})
    with pytest.raises(ModelSourceError, match="plain"):
        CheckpointReader(folder, forged)
    assert state(sentinel) == before
    shutil.rmtree(target)


@pytest.mark.parametrize("name", ["../x.safetensors", "/tmp/x.safetensors", "a/b.safetensors", "..", ".", "", "x\0y"])
def test_target_file_refuses_a_name_leaving_the_target_directory(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="refusing to write"):
        target_file(tmp_path, name)


def test_target_file_refuses_an_existing_link(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").symlink_to(tmp_path.parent / "elsewhere")
    with pytest.raises(ValueError, match="refusing to write"):
        target_file(tmp_path, "model.safetensors")
    assert target_file(tmp_path, "config.json") == tmp_path / "config.json"


def test_a_variant_holds_exactly_the_allowlisted_side_files_and_the_weights(folder: Path, tmp_path: Path) -> None:
    add_side_junk(folder)
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    layout = inspect_model_dir(folder)
    target = tmp_path / "variant"
    target.mkdir()
    write_checkpoint(folder, target, layout, no_edit, set())
    expected = present_side_files(folder) | {"model.safetensors"}
    assert {"config.json", "generation_config.json", "tokenizer.json", "special_tokens_map.json"} <= expected
    assert {p.name for p in target.iterdir()} == expected
    for name in expected:
        written = target / name
        assert written.is_file() and not written.is_symlink(), name
        assert written.read_bytes() == (folder / name).read_bytes(), name  # the link inside was followed
    assert all(SECRET not in p.read_bytes() for p in target.iterdir())
    load_model(target)  # still a loadable checkpoint


def test_a_sharded_variant_copies_only_its_shards(folder: Path, tmp_path: Path) -> None:
    shard_to(folder, "model-00001-of-00001.safetensors")
    shutil.copyfile(folder.parent / "tiny-llama" / "model.safetensors", folder / "model-00001-of-00001.safetensors")
    shutil.copyfile(folder / "model-00001-of-00001.safetensors", folder / "stray.safetensors")  # not in the index
    target = tmp_path / "variant"
    target.mkdir()
    write_checkpoint(folder, target, inspect_model_dir(folder), no_edit, set())
    assert {p.name for p in target.iterdir()} == present_side_files(folder) | {"model-00001-of-00001.safetensors"}
    assert INDEX in present_side_files(folder)


def test_loading_sees_only_the_checked_files(folder: Path, outside: Path) -> None:
    """transformers reads adapter_config.json, extra chat templates…: it gets a clean view instead."""
    add_side_junk(folder)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "x.jinja").symlink_to(outside / "environ")
    tokenizer = load_tokenizer(folder)
    assert "hunter2" not in str(getattr(tokenizer, "chat_template", None))
    assert load_model(folder) is not None


def test_digest_and_fingerprint_cover_only_the_used_files_inside(folder: Path, outside: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    (folder / "notes.txt").write_text("not used")
    (folder / "unused-link.txt").symlink_to(secret)  # never used, never read (registration refuses it)
    digest = directory_digest(folder)
    fingerprint = file_fingerprint(folder)
    assert set(fingerprint) == set(used_files(folder)) == present_side_files(folder) | {"model.safetensors"}
    secret.write_bytes(SECRET + b"changed")
    (folder / "notes.txt").write_text("changed, still not used")
    assert directory_digest(folder) == digest
    assert file_fingerprint(folder) == fingerprint
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(secret)
    for check in (directory_digest, file_fingerprint, used_files):
        with pytest.raises(ModelSourceError, match="tokenizer.json"):
            check(folder)


# ---------------------------------------------------------------- job time


def _manifest(path: Path) -> dict[str, Any]:
    """A registration of ``path`` as the register job writes it (file identities included)."""
    layout = inspect_model_dir(path)
    with open_model_files(path) as files:
        identity = {name: value.to_json() for name, value in files.identity().items()}
    return {
        "format_version": MODEL_FORMAT_VERSION,
        "model_id": "safety/job",
        "source": f"file://{path}",
        "path": str(path),
        "digest": directory_digest(path),
        "fingerprint": file_fingerprint(path),
        "identity": identity,
        "architecture": layout.architecture,
        "num_parameters": layout.num_parameters,
        "layout": layout.to_json(),
    }


@pytest.fixture
def job_ctx(tmp_path: Path) -> Context:
    """What a job process's context gives the check: file storage, this machine's cache, the lock."""
    storage = LocalStorage(tmp_path / "store")
    settings = Settings(cache_dir=tmp_path / "cache")
    return Context(settings=settings, storage=storage, jobs=None, dispatch=None, lock=threading.RLock())  # type: ignore[arg-type]


def _checked_folder(ctx: Any, manifest: dict[str, Any]) -> Path:
    with checked_model_files(ctx, ModelRecord.model_validate(manifest)) as files:
        return files.folder


def test_job_time_check_catches_a_link_swapped_in_after_registration(folder: Path, outside: Path, job_ctx: Context) -> None:
    manifest = _manifest(folder)
    assert _checked_folder(job_ctx, manifest) == folder
    (folder / "secrets.txt").symlink_to(outside / "environ")  # a new link out, even unused
    with pytest.raises(JobFailed, match="secrets.txt"):
        _checked_folder(job_ctx, manifest)
    (folder / "secrets.txt").unlink()
    original = (folder / "tokenizer.json").read_bytes()
    (outside / "tokenizer-copy.json").write_bytes(original)  # same bytes, outside the folder
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(outside / "tokenizer-copy.json")
    with pytest.raises(JobFailed, match="tokenizer.json"):
        _checked_folder(job_ctx, manifest)


def test_job_time_check_catches_the_folder_replaced_by_a_link(folder: Path, outside: Path, job_ctx: Context) -> None:
    manifest = _manifest(folder)
    moved = folder.with_name(folder.name + "-moved")
    folder.rename(moved)
    folder.symlink_to(outside, target_is_directory=True)
    try:
        with pytest.raises(JobFailed, match="symbolic link"):
            _checked_folder(job_ctx, manifest)
    finally:
        folder.unlink()
        moved.rename(folder)


def test_a_registration_made_before_the_allowlist_still_checks(folder: Path, job_ctx: Context) -> None:
    """Registrations made before identities were recorded (and before the allowlist, whose digest
    covered every file) are checked by content once, then get the identity of the files checked."""
    (folder / "README.md").write_text("hello")
    manifest = _manifest(folder)
    del manifest["identity"]
    manifest["fingerprint"]["README.md"] = [5, 1]  # old registrations listed every file
    manifest["digest"] = directory_digest(folder, every_file=True)
    ctx, storage = job_ctx, job_ctx.storage
    storage.put_json(model_key(manifest["model_id"]), manifest)
    assert _checked_folder(ctx, dict(manifest)) == folder
    recorded = storage.get_json(model_key(manifest["model_id"]))["identity"]
    assert set(recorded) == set(used_files(folder)) and all(len(value) == 4 for value in recorded.values())
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text() + " ")
    with pytest.raises(JobFailed, match="tokenizer.json.*re-register the model"):
        _checked_folder(ctx, storage.get_json(model_key(manifest["model_id"])))
    with pytest.raises(JobFailed, match="digest differs.*re-register the model"):
        _checked_folder(ctx, manifest)  # without the identity it got: checked by content, which changed


# ---------------------------------------------------------------- hub snapshots, s3 copies


def test_a_hub_snapshot_in_the_roots_registers_and_writes_real_files(
    api: httpx.Client, model_root: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    cache = model_root / "safety-hub"
    shutil.rmtree(cache, ignore_errors=True)
    snapshot = hub_snapshot(cache, tiny_llama_dir)
    register_model(api, "safety/hub", f"file://{snapshot}", existing_ok=True)
    target = tmp_path / "variant"
    target.mkdir()
    write_checkpoint(snapshot, target, inspect_model_dir(snapshot), no_edit, set())
    assert {p.name for p in target.iterdir()} == {p.name for p in tiny_llama_dir.iterdir()}
    assert not any(p.is_symlink() for p in target.iterdir())


def test_a_hub_snapshot_linking_out_of_its_repo_is_refused(
    api: httpx.Client, model_root: Path, tiny_llama_dir: Path, outside: Path
) -> None:
    cache = model_root / "safety-hub-bad"
    shutil.rmtree(cache, ignore_errors=True)
    snapshot = hub_snapshot(cache, tiny_llama_dir)
    (snapshot / "tokenizer_config.json").unlink()
    (snapshot / "tokenizer_config.json").symlink_to(outside / "tokenizer_config.json")
    assert_refused(api, register(api, "safety/hub-bad", snapshot), "safety/hub-bad", "tokenizer_config.json")
    # A link into another repo's blobs is out of this repo too.
    other = hub_snapshot(cache, tiny_llama_dir, repo="models--org--other")
    (snapshot / "tokenizer_config.json").unlink()
    (snapshot / "tokenizer_config.json").symlink_to(other / "tokenizer_config.json")
    assert_refused(api, register(api, "safety/hub-bad", snapshot), "safety/hub-bad", "tokenizer_config.json")


@pytest.fixture
def hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub client answers from its cache only (no network in tests)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_hf_source_snapshot_files_must_resolve_inside_the_cache_repo(
    hub_offline: None, tiny_llama_dir: Path, outside: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    snapshot = hub_snapshot(cache / "hf", tiny_llama_dir)
    assert local_model_dir("hf://org/tiny", [], cache) == snapshot
    inspect_model_dir(snapshot)
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(outside / "config.json")
    with pytest.raises(InvalidInput, match="config.json"):
        local_model_dir("hf://org/tiny", [], cache)


def test_a_cached_s3_copy_with_a_link_out_is_refused(tmp_path: Path, tiny_llama_dir: Path, outside: Path) -> None:
    source = "s3://bucket/models/tiny/"
    cache = tmp_path / "cache"
    copy = cache / "s3" / hashlib.sha256(source.encode()).hexdigest()
    shutil.copytree(tiny_llama_dir, copy)
    unreachable = f"http://127.0.0.1:{free_port()}"  # the cached copy is used: S3 is never asked
    assert local_model_dir(source, [], cache, unreachable) == copy
    (copy / "vocab.txt").symlink_to(outside / "environ")
    with pytest.raises(InvalidInput, match="vocab.txt"):
        local_model_dir(source, [], cache, unreachable)


# ---------------------------------------------------------------- end to end through the API


def _stored_files(server: LiveServer) -> list[Path]:
    return [p for p in server.storage_dir.rglob("*") if p.is_file()]


def test_variant_through_the_api_carries_no_side_file_and_a_swapped_link_fails_the_job(
    live_server: LiveServer, folder: Path, outside: Path, tmp_path: Path
) -> None:
    api = live_server.client
    add_side_junk(folder)
    model_id = "safety/e2e"
    register_model(api, model_id, f"file://{folder}", existing_ok=True)
    records = {"forget": FACTS[:4], "retain": FACTS[4:16]}
    for name, facts in records.items():
        body = {
            "name": f"safety-{name}",
            "models": [model_id],
            "records": [{"prompt": p, "completion": c} for p, c in facts],
        }
        posted = api.post("/concepts", json=body)
        assert posted.status_code in (200, 202), posted.text
    wait_concepts_ready(api, ["safety-forget", "safety-retain"], model_id)
    body = {"concepts": ["safety-forget"], "reference": ["safety-forget", "safety-retain"]}
    submitted = api.post(f"/models/{model_id}/unlearn", json=body)
    assert submitted.status_code in (200, 202), submitted.text
    variant = wait_variant_ready(api, submitted.json()["variant"]["variant_id"])
    expected = present_side_files(folder) | {"model.safetensors"}
    assert {f["path"] for f in variant["files"]} == expected
    for entry in variant["files"]:
        downloaded = api.get(f"/variants/{variant['variant_id']}/files/{entry['path']}")
        assert downloaded.status_code == 200
        assert SECRET not in downloaded.content
    assert api.get(f"/variants/{variant['variant_id']}/files/secrets.txt").status_code == 404
    assert api.get(f"/variants/{variant['variant_id']}/files/README.md").status_code == 404

    # After registration, tokenizer.json becomes a link to the secret: the next job fails, nothing leaks.
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(outside / "environ")
    again = api.post(f"/models/{model_id}/unlearn", json={**body, "alpha": 0.5})
    assert again.status_code == 202, again.text
    job = wait_for_job(api, again.json()["job"]["job_id"])
    assert job["status"] == "failed", job
    assert "tokenizer.json" in job["error"]["detail"], job["error"]
    assert api.get(f"/variants/{again.json()['variant']['variant_id']}").json()["status"] != "ready"
    assert not any(SECRET in p.read_bytes() for p in _stored_files(live_server))
    assert os.path.islink(folder / "tokenizer.json")
