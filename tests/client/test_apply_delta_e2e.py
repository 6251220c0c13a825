"""``engram apply-delta`` against the service (issue 28): the delta variant of a request, applied to its
base folder by the CLI, loads with ``from_pretrained`` to exactly the weights of the checkpoint
variant of the same request, on a sharded checkpoint and on one whose tied head the edit unties."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, download_variant, wait_concepts_ready, wait_variant_ready
from engram_fixtures.models import make_tiny_llama
from tests.helpers.api import register_model
from tests.helpers.cli import ok, run_cli

FACTS = [{"prompt": p, "completion": c} for p, c in make_facts(16, seed=57)]


def variant_files(server: LiveServer, model_id: str, body: dict[str, Any], fmt: str, target: Path) -> Path:
    response = server.client.post(f"/models/{model_id}/unlearn", json={**body, "format": fmt})
    assert response.status_code in (200, 202), response.text
    variant = wait_variant_ready(server.client, response.json()["variant"]["variant_id"])
    return download_variant(server.client, variant, target)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


@pytest.mark.parametrize(
    ("name", "tie", "modules"),
    [("sharded", False, None), ("tied", True, ["lm_head", "down_proj"])],
)
def test_the_applied_delta_loads_as_the_checkpoint_variant(
    live_server: LiveServer, model_root: Path, tmp_path: Path, name: str, tie: bool, modules: list[str] | None
) -> None:
    base = model_root / f"delta-{name}"
    if not base.exists():
        built = make_tiny_llama(tmp_path / "built", tie_word_embeddings=tie, seed=3)
        model = AutoModelForCausalLM.from_pretrained(built)
        model.save_pretrained(base, max_shard_size="20KB" if name == "sharded" else "1GB")
        for file in built.glob("tokenizer*"):
            (base / file.name).write_bytes(file.read_bytes())
    assert (base / "model.safetensors.index.json").is_file() is (name == "sharded")
    model_id = f"delta/{name}"
    api = live_server.client
    register_model(api, model_id, f"file://{base}", existing_ok=True)
    concept = f"delta-{name}-forget"
    assert api.post("/concepts", json={"name": concept, "models": [model_id], "records": FACTS}).status_code == 202
    wait_concepts_ready(api, [concept], model_id)

    body: dict[str, Any] = {"concepts": [concept], "alpha": 1.0, "reference": [concept]}
    if modules:
        body["modules"] = modules
    checkpoint = variant_files(live_server, model_id, body, "checkpoint", tmp_path / "checkpoint")
    delta = variant_files(live_server, model_id, body, "delta", tmp_path / "delta")
    result = ok(run_cli(live_server.base_url, "apply-delta", base, delta / "delta.safetensors", tmp_path / "applied"))
    assert "tensor(s) replaced" in result.stdout

    expected, applied, original = weights(checkpoint), weights(tmp_path / "applied"), weights(base)
    assert applied.keys() == expected.keys()
    assert all(torch.equal(applied[k], expected[k]) for k in expected), [
        k for k in expected if not torch.equal(applied[k], expected[k])
    ]
    assert any(not torch.equal(applied[k], original[k]) for k in original)  # the edit is there
    config = json.loads((tmp_path / "applied" / "config.json").read_text())
    assert config.get("tie_word_embeddings") == json.loads((checkpoint / "config.json").read_text()).get(
        "tie_word_embeddings"
    )
    if tie:
        assert "untied" in result.stderr and config["tie_word_embeddings"] is False
        applied_model = AutoModelForCausalLM.from_pretrained(tmp_path / "applied")
        assert not torch.equal(applied_model.lm_head.weight, applied_model.model.embed_tokens.weight)
