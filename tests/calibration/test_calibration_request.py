"""The stored calibration request: IDs as earlier versions gave them, the stored JSON both ways.

The pinned IDs were computed by ``service.calibration.service._request`` as it stood before the
request was typed (commit a12dd1f), from the request as the route handed it on (probes without
nulls, concepts without repeats): a stored calibration keeps its ID only while these stay equal.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from api_schemas import CalibrateRequest
from service.calibration import service
from service.engine.checkpoint import ModelLayout
from service.engine.layers import LayerSpec
from service.universes.service import EditUniverse
from service.universes.spec import Member, UniverseSpec

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MODULES += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LAYERS = [LayerSpec(f"model.layers.{b}.{m}", 32, 32, False, False, b) for b in (0, 1) for m in MODULES]
LAYOUT = ModelLayout("LlamaForCausalLM", 1, [*LAYERS, LayerSpec("lm_head", 32, 64, False, False, None)], {}, {})
MODEL = {"model_id": "demo/tiny", "digest": "d" * 64, "layout": LAYOUT.to_json()}


def stats(dataset: str) -> str:
    return f"stats/{'d' * 64}/{dataset * 64}/{'s' * 64}/"


MEMBERS = (Member("forget", stats("a"), "a" * 64), Member("other", stats("b"), "b" * 64))
MEMBERS += (Member("retain", stats("c"), "c" * 64),)
UNIVERSE = EditUniverse(UniverseSpec("demo/tiny", "d" * 64, MEMBERS, None), {m.name: m.stats for m in MEMBERS}, ["retain"])

PAIRS = [{"prompt": "Q: a? A:", "completion": " b"}, {"prompt": "Q: c? A:", "completion": " d"}]
CHAT = [{"messages": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Me."}]}]
CASES: dict[str, dict[str, Any]] = {
    "defaults": {"concepts": ["forget"], "forget": PAIRS[:1], "retain": PAIRS[1:]},
    "module_sets": {
        "concepts": ["forget", "other", "forget"],
        "forget": PAIRS[:1],
        "retain": PAIRS,
        "module_sets": ["qk_gate", ["v_proj", "o_proj", "v_proj"], "data_weighted"],
        "scalings": ["weight_norm"],
        "budget": 12,
        "alpha_min": 0.1,
        "alpha_max": 2,
        "max_retain_nll_ratio": 1.5,
    },
    "layer_sets_delta": {
        "concepts": ["forget"],
        "forget": PAIRS[:1],
        "retain": PAIRS[1:],
        "module_sets": ["mlp"],
        "layer_sets": [[1, 0], [1]],
        "format": "delta",
    },
    "peft_vllm_messages": {
        "concepts": ["forget"],
        "forget": CHAT,
        "retain": PAIRS,
        "module_sets": ["attention"],
        "format": "peft",
        "lora_target": "vllm",
        "lora_rank": 16,
    },
    "peft": {"concepts": ["forget"], "forget": PAIRS[:1], "retain": PAIRS[1:], "module_sets": ["all"], "format": "peft"},
}
PINNED = {
    "defaults": "3088f179793ccc84801f5b3286264e7b",
    "module_sets": "e8b2cd68db8136c6aa2e4aba6e073907",
    "layer_sets_delta": "50c041de2930d09b735f7cfe70016426",
    "peft_vllm_messages": "e9f382572e75b11802c9bf1394814b10",
    "peft": "fa70cdaef8dedd09109cb26ac918e9c1",
}


def stored_request(case: str) -> dict[str, Any]:
    """What ``submit_calibration`` stores for ``CASES[case]`` (without its job)."""
    body = CalibrateRequest(**CASES[case])
    data = body.model_dump(exclude={"forget", "retain"})
    for split in service.SPLITS:
        data[split] = [p.model_dump(exclude_none=True) for p in getattr(body, split)]
    data["concepts"] = list(dict.fromkeys(data["concepts"]))
    probes = json.dumps({s: data[s] for s in service.SPLITS}, sort_keys=True, ensure_ascii=False).encode()
    space = service._space(LAYOUT, data)
    return service._request(MODEL, data, UNIVERSE, space, hashlib.sha256(probes).hexdigest())


@pytest.mark.parametrize("case", sorted(PINNED))
def test_calibration_ids_are_the_ids_earlier_versions_gave(case: str) -> None:
    assert stored_request(case)["calibration_id"] == PINNED[case]


# What the code before the typed request stored for the case "module_sets", job added.
STORED = {
    "calibration_id": "e8b2cd68db8136c6aa2e4aba6e073907",
    "model_id": "demo/tiny",
    "concepts": ["forget", "other"],
    "term_stats": {"forget": stats("a"), "other": stats("b")},
    "universe_id": "94034935b93d9f9bfe64a94de4bd9bb2",
    "reference": ["retain"],
    "probes_digest": "e0c3adff0b9f3fff09e58ecce00a0a7889ec3b3681428f4d6fc2be09edb44ab5",
    "search": {
        "max_retain_nll_ratio": 1.5,
        "budget": 12,
        "alpha_min": 0.1,
        "alpha_max": 2.0,
        "arms": [
            {
                "module_set": "qk_gate",
                "modules": ["self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj"],
                "layers": None,
                "scaling": "weight_norm",
                "weighted": False,
            },
            {
                "module_set": "v_proj+o_proj",
                "modules": ["v_proj", "o_proj"],
                "layers": None,
                "scaling": "weight_norm",
                "weighted": False,
            },
            {"module_set": "data_weighted", "modules": None, "layers": None, "scaling": "weight_norm", "weighted": True},
        ],
    },
    "skipped_module_sets": [],
    "variant": {"format": "checkpoint", "lora_rank": None, "lora_target": "peft"},
    "job_id": "job-1",
}


def test_the_stored_request_is_the_json_earlier_versions_stored() -> None:
    stored = {**stored_request("module_sets"), "job_id": "job-1"}
    assert json.dumps(stored) == json.dumps(STORED)  # key for key, in order, floats as floats
