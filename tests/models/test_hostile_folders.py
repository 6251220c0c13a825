"""Hostile model folders found by red-teaming a live server: side files that crashed a request
(a 500) or registered a model no job could load.

Each folder is the tiny Llama copied into the session server's model root and then tampered with;
registrations go through that real server (``api``). Every case here registered (or answered a 500)
before its fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from service.engine.chat import folder_has_chat_template
from service.engine.model_files import MAX_SIDE_JSON_BYTES
from tests.helpers.api import register_model

INDEX = "model.safetensors.index.json"
DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON that Python's parser cannot nest into (RecursionError)


@pytest.fixture
def folder(model_root: Path, tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Path:
    """A fresh copy of the tiny Llama inside the model root, named after the test."""
    path = model_root / ("hostile-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12])
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(tiny_llama_dir, path)
    return path


def model_id_for(path: Path) -> str:
    return f"hostile/{path.name}"


def assert_refused(api: httpx.Client, path: Path, *mentions: str) -> str:
    """Registering ``path`` is a 422 problem naming every ``mentions``, and registers nothing."""
    model_id = model_id_for(path)
    response = api.post("/models", json={"model_id": model_id, "source": f"file://{path}"})
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    detail: str = response.json()["detail"]
    for mention in mentions:
        assert mention in detail, detail
    assert api.get(f"/models/{model_id}").status_code == 404
    return detail


def add_to_json(path: Path, **values: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def make_sharded(path: Path) -> None:
    """Turn ``path`` into a one-shard checkpoint with an index (as transformers saves one)."""
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    from safetensors import safe_open

    with safe_open(str(path / "model-00001-of-00001.safetensors"), framework="pt") as handle:
        keys = list(handle.keys())  # noqa: SIM118
    weight_map = dict.fromkeys(keys, "model-00001-of-00001.safetensors")
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ---------------------------------------------------------------- side JSON that crashed the request


@pytest.mark.parametrize(
    "name", ["config.json", "tokenizer_config.json", INDEX, "generation_config.json", "special_tokens_map.json"]
)
def test_a_side_json_nested_too_deeply_is_a_422_not_a_500(api: httpx.Client, folder: Path, name: str) -> None:
    """Python's JSON parser raises RecursionError (not a ValueError) on deep nesting: it was a 500."""
    if name == INDEX:
        make_sharded(folder)
    (folder / name).write_text(DEEP)
    assert_refused(api, folder, name, "nested")


def test_a_side_json_larger_than_the_limit_is_refused_unread(api: httpx.Client, folder: Path) -> None:
    """A 300 MB config.json registered, with 1.7 GB in the API process; now its size refuses it."""
    config = folder / "config.json"
    with config.open("r+b") as handle:  # sparse: the test writes no gigabytes
        handle.truncate(MAX_SIDE_JSON_BYTES + 1)
    assert_refused(api, folder, "config.json", "larger than")


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json", "special_tokens_map.json"])
def test_a_side_json_that_is_not_an_object_is_refused(api: httpx.Client, folder: Path, name: str) -> None:
    """transformers reads each as a dict: a list registered, then failed every collection."""
    (folder / name).write_text("[1]")
    assert_refused(api, folder, name, "JSON object")


def test_folder_chat_template_check_survives_a_deep_chat_template_json(folder: Path) -> None:
    """POST /concepts with messages reads chat_template.json in the API: a deep one was a 500."""
    (folder / "chat_template.json").write_text(DEEP)
    assert folder_has_chat_template(folder) is None  # unreadable here: the job says why


# ---------------------------------------------------------------- tokenizers no job could load


def test_tokenizer_remote_code_is_refused_at_registration(api: httpx.Client, folder: Path) -> None:
    """An auto_map in tokenizer_config.json asks for remote code: it registered, then every
    collection failed naming a temporary folder of the service."""
    add_to_json(folder / "tokenizer_config.json", auto_map={"AutoTokenizer": ["evil.EvilTok", None]})
    assert_refused(api, folder, "remote code", "tokenizer_config.json")


def test_a_tokenizer_transformers_cannot_load_is_refused_at_registration(api: httpx.Client, folder: Path) -> None:
    """A tokenizer.json without its fields registered; every collection then failed with a KeyError."""
    (folder / "tokenizer.json").write_text("{}")
    detail = assert_refused(api, folder, "tokenizer")
    assert "/engram-model-view-" not in detail  # the service's private folder is none of the caller's business


def test_a_tokenizer_json_nested_too_deeply_is_refused_at_registration(api: httpx.Client, folder: Path) -> None:
    (folder / "tokenizer.json").write_text(DEEP)
    assert_refused(api, folder, "tokenizer")


def test_a_folder_without_tokenizer_files_still_registers(api: httpx.Client, folder: Path) -> None:
    """The tokenizer is checked only when the folder ships one (variants need none)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(folder / name)
    register_model(api, model_id_for(folder), f"file://{folder}")


# ---------------------------------------------------------------- an index no job could load


def test_an_index_without_a_metadata_object_is_refused(api: httpx.Client, folder: Path) -> None:
    """transformers reads ``index["metadata"]`` unconditionally: such an index registered, then
    every collection failed with ``KeyError: 'metadata'``."""
    make_sharded(folder)
    index = json.loads((folder / INDEX).read_text())
    del index["metadata"]
    (folder / INDEX).write_text(json.dumps(index))
    assert_refused(api, folder, INDEX, "metadata")


# ---------------------------------------------------------------- a config that held the job process


@pytest.mark.parametrize("key", ["num_hidden_layers", "n_layer"])
def test_a_config_declaring_more_layers_than_any_model_is_refused_before_building(
    api: httpx.Client, folder: Path, key: str
) -> None:
    """transformers builds every declared layer, even on the meta device: 200 000 held the (only)
    embedded job process for over 8 minutes with 4 GB and growing, and cancelling it did nothing.
    2000 (built in seconds, so that the unfixed service fails this test quickly) is refused too."""
    add_to_json(folder / "config.json", **{key: 2000})
    assert_refused(api, folder, "config.json", "2000 layers")
