"""``lora_target: "vllm"`` through the variant service: what is refused (by name, before anything is
written), what the variant says, and that adapters for peft keep the IDs they had.

The adapter files themselves (rank, alpha, keys, kept energy) are checked in tests/engine/test_lora.py,
and the forgetting they serve in tests/e2e/test_peft_tofu.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from safetensors.torch import load_file

from api_schemas import VLLM_LORA_RANKS, ComposeRequest, UnlearnRequest, Variant
from engram_fixtures.models import make_tiny_gpt2, make_tiny_llama, make_tokenizer
from service.errors import InvalidInput
from service.universes.records import current_pointer
from tests.helpers.store_world import StoreWorld, text_records
from tests.helpers.variants import run_variant

LLAMA, GPT2 = "vllm/llama", "vllm/gpt2"
VLLM = {"scaling": "uniform", "format": "peft", "lora_target": "vllm"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> StoreWorld:
    root = tmp_path_factory.mktemp("vllm-adapter")
    w = StoreWorld(root)
    tokenizer = make_tokenizer()
    w.register(LLAMA, make_tiny_llama(root / "models" / "llama", hidden=32, layers=2, seed=0, tokenizer=tokenizer))
    w.register(GPT2, make_tiny_gpt2(root / "models" / "gpt2", hidden=32, layers=2, seed=0, tokenizer=tokenizer))
    for model_id in (LLAMA, GPT2):
        w.publish(model_id, "forget", text_records(0, 20))
        w.publish(model_id, "retain", text_records(20, 60))
    return w


def unlearn(w: StoreWorld, model_id: str, **options: Any) -> Variant:
    """Submit, run the build when there is one; the variant as it is then."""
    return run_variant(w, model_id, {"forget": -1.0}, 1.0, options)


def stored_files(w: StoreWorld) -> set[str]:
    root = w.root / "store"
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def adapter_files(w: StoreWorld, variant_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    files = f"variants/{variant_id}/files"
    tensors = load_file(str(w.ctx.storage.local_path(f"{files}/adapter_model.safetensors")))
    return w.ctx.storage.get_json(f"{files}/adapter_config.json"), tensors


def test_a_vllm_adapter_of_layers_with_a_bias_is_refused_by_name_and_writes_nothing(world: StoreWorld) -> None:
    before = stored_files(world)
    with pytest.raises(InvalidInput) as refused:
        unlearn(world, GPT2, **VLLM)
    detail = refused.value.detail
    for block in (0, 1):
        for suffix in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            assert f"transformer.h.{block}.{suffix}" in detail
    assert "lora_bias" in detail and '"modules": ["lm_head"]' in detail and '"checkpoint"' in detail
    with pytest.raises(InvalidInput, match=r"transformer\.h\.1\.attn\.c_attn") as one_block:
        unlearn(world, GPT2, **VLLM, layers=[1])
    assert "transformer.h.0." not in one_block.value.detail
    assert stored_files(world) == before and current_pointer(world.ctx, GPT2) is None


@pytest.mark.parametrize(
    ("options", "mention"),
    [
        ({"format": "checkpoint"}, 'format "peft" only'),
        ({"format": "delta"}, 'format "peft" only'),
        ({"lora_rank": 24}, "8, 16, 32, 64, 128, 256, 320, 512"),
        ({"lora_rank": 1024}, "lora_rank 1024"),
    ],
)
def test_a_vllm_request_vllm_cannot_serve_is_refused(world: StoreWorld, options: dict[str, Any], mention: str) -> None:
    before = stored_files(world)
    with pytest.raises(InvalidInput, match=mention):
        unlearn(world, LLAMA, **{**VLLM, **options})
    assert stored_files(world) == before


def test_the_bias_free_layers_of_a_biased_model_make_a_vllm_adapter(world: StoreWorld) -> None:
    variant = unlearn(world, GPT2, **VLLM, modules=["lm_head"])
    config, tensors = adapter_files(world, variant.variant_id)
    r = variant.lora["r"]
    assert r in VLLM_LORA_RANKS and (config["r"], config["lora_alpha"], config["lora_bias"]) == (r, r, False)
    assert sorted(tensors) == ["base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"]


def test_a_vllm_variant_names_its_target_rank_and_kept_energy(world: StoreWorld) -> None:
    views = [unlearn(world, LLAMA, **o) for o in ({**VLLM, "lora_target": "peft"}, VLLM, {**VLLM, "lora_rank": 8})]
    capped = views[2]
    assert len({v.variant_id for v in views}) == 3
    assert [v.lora_target for v in views] == ["peft", "vllm", "vllm"]
    assert [v.lora_rank for v in views] == [None, None, 8]
    auto_report, capped_report = views[1].lora, views[2].lora
    kept = max(layer["kept_rank"] for layer in auto_report["layers"].values())
    assert auto_report["r"] == min(r for r in VLLM_LORA_RANKS if r >= kept) and auto_report["lora_target"] == "vllm"
    assert auto_report["totals"]["truncated_layers"] == 0 and auto_report["totals"]["kept_energy"] > 1 - 1e-9
    assert capped_report["r"] == 8 and capped_report["totals"]["truncated_layers"] > 0
    assert all(0.0 < layer["kept_energy"] <= 1.0 for layer in capped_report["layers"].values())
    assert capped_report["totals"]["kept_energy"] < 1.0
    config, _ = adapter_files(world, capped.variant_id)
    assert (config["r"], config["lora_alpha"], config["rank_pattern"]) == (8, 8, {})


def test_peft_adapters_keep_their_ids(world: StoreWorld) -> None:
    """A request without lora_target (as stored before it existed) is the same variant as "peft"."""
    options = {"scaling": "uniform", "format": "peft"}
    assert unlearn(world, LLAMA, **options).variant_id == unlearn(world, LLAMA, **options, lora_target="peft").variant_id
    checkpoint = {"scaling": "uniform", "format": "checkpoint"}
    assert unlearn(world, LLAMA, **checkpoint).lora_target is None


def test_the_request_model_states_vllm_ranks() -> None:
    with pytest.raises(ValidationError, match="lora_rank 24 is not a rank vLLM serves"):
        UnlearnRequest(concepts=["x"], format="peft", lora_target="vllm", lora_rank=24)
    with pytest.raises(ValidationError, match="lora_target"):
        ComposeRequest(terms={"x": 1.0}, format="peft", lora_target="tgi")  # type: ignore[arg-type]
    assert UnlearnRequest(concepts=["x"], format="peft", lora_target="vllm", lora_rank=320).lora_rank == 320
    assert UnlearnRequest(concepts=["x"], format="peft", lora_rank=24).lora_target == "peft"  # any rank for peft
    rule = UnlearnRequest.model_json_schema()["allOf"][0]
    assert rule["if"]["properties"]["lora_target"] == {"const": "vllm"}
    assert rule["then"]["properties"]["format"] == {"const": "peft"}
    assert rule["then"]["properties"]["lora_rank"]["anyOf"][0]["enum"] == list(VLLM_LORA_RANKS)
