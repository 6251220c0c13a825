"""Variant requests without a store: a model record, a three-member universe, and the option sets
whose variant IDs are pinned (tests/variants/test_variant_spec.py, test_variant_plan.py).

The pinned IDs were computed by ``service.variants.service._variant_request`` as it stood before the
options were typed (commit 5aefde7), from the options as submit_variant normalised them: a stored
variant keeps its ID only while these stay equal.
"""

from __future__ import annotations

from typing import Any

from service.engine.layout import ModelLayout
from service.models.record import ModelRecord
from service.universes.members import EditUniverse
from service.universes.spec import Member, UniverseSpec

MODEL = ModelRecord(
    model_id="demo/tiny",
    source="file:///models/demo/tiny",
    path="/models/demo/tiny",
    digest="d" * 64,
    architecture="LlamaForCausalLM",
    num_parameters=0,
    layout=ModelLayout("LlamaForCausalLM", 0, [], {}, {}),  # the request never reads it
)
UNIVERSE_ID = "94034935b93d9f9bfe64a94de4bd9bb2"


def stats(dataset: str) -> str:
    return f"stats/{'d' * 64}/{dataset * 64}/{'s' * 64}/"


def universe(rcond: float | None = None) -> EditUniverse:
    members = (
        Member("forget", stats("a"), "a" * 64),
        Member("other", stats("b"), "b" * 64),
        Member("retain", stats("c"), "c" * 64),
    )
    spec = UniverseSpec("demo/tiny", "d" * 64, members, rcond)
    return EditUniverse(spec, {m.name: m.stats for m in members}, ["retain"])


UNLEARN = ({"forget": -1.0}, 1.0, None)
COMPOSE = ({"forget": 2.0, "other": -0.5}, None, 0.01)
CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "weight_norm_modules_layers_delta": {
        "scaling": "weight_norm",
        "modules": ["v_proj", "q_proj"],
        "layers": [2, 0],
        "format": "delta",
    },
    "peft": {"format": "peft"},
    "peft_rank": {"format": "peft", "lora_rank": 8},
    "peft_vllm": {"format": "peft", "lora_target": "vllm"},
    "peft_vllm_rank": {"format": "peft", "lora_target": "vllm", "lora_rank": 64},
    "strengths": {"module_strengths": {"v_proj": 0.5, "q_proj": 2.0, "o_proj": 1.0}},
    "strengths_all_one": {"module_strengths": {"q_proj": 1.0}},
    "peft_strengths_modules": {
        "format": "peft",
        "modules": ["mlp.down_proj"],
        "module_strengths": {"down_proj": 0.25},
        "scaling": "weight_norm",
    },
}
PINNED = {
    "defaults/unlearn": "c347123fec9faf672c0c48d8f5a45521",
    "defaults/compose": "6ee50d97f6312a21b6274aa7d4e39a61",
    "weight_norm_modules_layers_delta/unlearn": "0ee112ff8a96cadf63082705f5086d06",
    "weight_norm_modules_layers_delta/compose": "c740bacaa34868fa7acd6190839a8a26",
    "peft/unlearn": "d52ee09b85ea9a995012976d595af460",
    "peft/compose": "8285b887428745ccdbeb4e5c49ca3ca0",
    "peft_rank/unlearn": "5da35ef44399c319b3d0b49948dd1b05",
    "peft_rank/compose": "5c05a5afc33154debe8c13587bc31234",
    "peft_vllm/unlearn": "70e93ade3facf5a42ce2a3694382e09e",
    "peft_vllm/compose": "b53bb1bc19f88c3e176d17c6bb6101d5",
    "peft_vllm_rank/unlearn": "571e493a3c704e7bc1cea049c976ec1b",
    "peft_vllm_rank/compose": "c0cf4d919c079e9e11aec69118f05323",
    "strengths/unlearn": "8800a6ff2811fe7058d87f2a3e39f9de",
    "strengths/compose": "96b64c62babbb6458a193fda79d64581",
    "strengths_all_one/unlearn": "c347123fec9faf672c0c48d8f5a45521",
    "strengths_all_one/compose": "6ee50d97f6312a21b6274aa7d4e39a61",
    "peft_strengths_modules/unlearn": "b251d67ecd4d20d6c365b112897b9612",
    "peft_strengths_modules/compose": "2a748e73aadaf7e0826b4219990e15ab",
}
