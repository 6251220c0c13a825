"""GGUF in: ``POST /models`` with a ``file://`` ``.gguf`` (or a folder holding one) registers the model
dequantized once by the register job, records its quantization type, checks the file's identity at
every job, and refuses what transformers' GGUF loader cannot read by name with a 422."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engram_fixtures.live import wait_for_job
from engram_fixtures.real_llm import smollm2_gguf
from tests.helpers.api import register_model
from tests.helpers.app import InProcessServer

pytestmark = pytest.mark.slow

REREGISTER = "re-register the model"


@pytest.fixture(scope="module")
def gguf_dir(model_root: Path) -> Path:
    """A folder in the model root holding only the real SmolLM2 Q4_1 GGUF (a copy: tests change it)."""
    folder = model_root / "gguf-smollm2"
    folder.mkdir(exist_ok=True)
    source, _ = smollm2_gguf()
    shutil.copyfile(source, folder / source.name)
    return folder


def _tiny_gguf(path: Path, architecture: str) -> Path:
    """A GGUF file of ``architecture`` with one float32 tensor: read by the header check only."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_registers_dequantized_with_its_quantization(
    app_server: InProcessServer, gguf_dir: Path, real_llm_dir: Path
) -> None:
    gguf_file = next(gguf_dir.glob("*.gguf"))
    started = time.perf_counter()
    model = register_model(app_server.client, "gguf/smollm2-file", f"file://{gguf_file}")
    print(f"\nregistration of {gguf_file.name}: {time.perf_counter() - started:.1f} s")  # noqa: T201
    assert model["quantization"] == "Q4_1"
    assert model["architecture"] == "LlamaForCausalLM"
    assert len([layer for layer in model["layers"] if layer["name"].startswith("model.layers.")]) == 30 * 7
    # The stored checkpoint is the file's model: the fixture dequantized by transformers' loader too.
    (folder,) = (app_server.settings.cache_dir / "gguf").iterdir()
    stored, reference = load_file(folder / "model.safetensors"), load_file(real_llm_dir / "model.safetensors")
    assert stored.keys() == reference.keys()
    assert all(torch.equal(stored[name], reference[name]) for name in stored)
    assert all(tensor.dtype == torch.float32 for tensor in stored.values())


def test_a_folder_holding_one_gguf_registers_the_same_model(app_server: InProcessServer, gguf_dir: Path) -> None:
    by_folder = register_model(app_server.client, "gguf/smollm2-folder", f"file://{gguf_dir}")
    by_file = app_server.client.get("/models/gguf/smollm2-file").json()
    assert by_folder["quantization"] == "Q4_1"
    assert by_folder["digest"] == by_file["digest"]  # one dequantized folder per file content
    assert len(list((app_server.settings.cache_dir / "gguf").iterdir())) == 1


def test_a_changed_gguf_fails_jobs_and_registers_anew(app_server: InProcessServer, gguf_dir: Path, tmp_path: Path) -> None:
    api = app_server.client
    folder = app_server.model_root / "gguf-changed"
    folder.mkdir()
    gguf_file = folder / "model.gguf"
    os.link(next(gguf_dir.glob("*.gguf")), gguf_file)  # the same content, its own inode to change
    register_model(api, "gguf/changed", f"file://{gguf_file}")
    shutil.copyfile(gguf_file, tmp_path / "copy.gguf")
    os.replace(tmp_path / "copy.gguf", gguf_file)  # the same bytes, another file: as a rewrite would be
    body = {
        "name": "gguf-changed-facts",
        "models": ["gguf/changed"],
        "records": [{"prompt": "Paris is", "completion": " a city"}],
    }
    posted = api.post("/concepts", json=body)
    assert posted.status_code in (200, 202), posted.text
    job = wait_for_job(api, api.get("/concepts/gguf-changed-facts").json()["models"]["gguf/changed"]["job_id"])
    assert job["status"] == "failed", job
    assert "model.gguf changed since registration" in job["error"]["detail"], job["error"]
    assert REREGISTER in job["error"]["detail"], job["error"]
    again = api.post("/models", json={"model_id": "gguf/changed", "source": f"file://{gguf_file}"})
    assert again.status_code in (201, 202), again.text  # registered anew, not "the identical registration exists"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("architecture", "architecture 'rwkv6', which transformers' GGUF loader cannot read"),
        ("broken", "is not a readable GGUF file"),
    ],
)
def test_an_unreadable_gguf_is_refused_by_name(app_server: InProcessServer, case: str, expected: str) -> None:
    folder = app_server.model_root / f"gguf-{case}"
    folder.mkdir()
    if case == "architecture":
        gguf_file = _tiny_gguf(folder / "rwkv.gguf", "rwkv6")
    else:
        gguf_file = folder / "broken.gguf"
        gguf_file.write_bytes(b"GGUF" + b"\xff" * 64)
    response = app_server.client.post("/models", json={"model_id": f"gguf/{case}", "source": f"file://{gguf_file}"})
    assert response.status_code == 422, response.text
    assert expected in response.json()["detail"], response.json()
    assert app_server.client.get(f"/models/gguf/{case}").status_code == 404


def test_a_folder_of_several_ggufs_is_refused_naming_them(app_server: InProcessServer) -> None:
    folder = app_server.model_root / "gguf-several"
    folder.mkdir()
    for name in ("a.gguf", "b.gguf"):
        _tiny_gguf(folder / name, "llama")
    response = app_server.client.post("/models", json={"model_id": "gguf/several", "source": f"file://{folder}"})
    assert response.status_code == 422, response.text
    assert "several GGUF files (a.gguf, b.gguf)" in response.json()["detail"], response.json()
