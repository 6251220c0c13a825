"""Every architecture family the README lists, tried through a live server as a user would.

Each family is a tiny random model built offline from its transformers config (no hub). The
script registers it, posts a target and a reference concept, unlearns the target, downloads the
checkpoint variant, loads it back with transformers, runs a forward pass on it and, for a model
that predicts the next token, evaluates it through the API. It prints one line per family: the
editable layers, how many the variant moved, the layers it left as they were (unreached), and any
refusal, as the service worded it. Nothing here is a test: the tests pin a subset of these
families (tests/api/test_architectures.py, test_multimodal.py, tests/engine/test_moe_architectures.py).

    .venv/bin/python -m scripts.architecture_sweep               # every family, about a minute
    .venv/bin/python -m scripts.architecture_sweep qwen2 mamba   # some
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch
import transformers

from engram_fixtures.demo import make_facts
from engram_fixtures.live import download_variant, start_server, stop_server
from engram_fixtures.models import (
    MOE_FAMILIES,
    make_tiny_encoder,
    make_tiny_from_config,
    make_tiny_gemma3_vlm,
    make_tiny_llava,
)

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# family -> (config class, model class, config fields beyond make_tiny_from_config's sizes)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 8}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"head_dim": 8}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 32, "n_layer": 2, "n_head": 4}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {"n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {"n_embd": 32, "n_layer": 2, "n_head": 4}),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"n_layer": 2, "n_head": 4}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {}),
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        {"head_dim": 8, "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 4, "mamba_n_groups": 1},
    ),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 64, "word_embed_proj_dim": 32}),
    "mamba": ("MambaConfig", "MambaForCausalLM", {"state_size": 4, "expand": 2, "conv_kernel": 4}),
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "mamba_d_state": 4,
            "mamba_expand": 2,
            "use_mamba_kernels": False,
        },
    ),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**MOE, "head_dim": 8}),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            **MOE,
            "head_dim": 8,
            "shared_expert_intermediate_size": 32,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "layer_types": ["linear_attention", "full_attention"],
        },
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32, "moe_layer_start_index": 1},
    ),
    "minimax": (
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        {
            "head_dim": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["linear_attention", "full_attention"],
        },
    ),
    "bart": (
        "BartConfig",
        "BartForConditionalGeneration",
        {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64},
    ),
    **MOE_FAMILIES,
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 4, "d_kv": 8},
    ),
}
# Encoders read BERT-style framing; their masked-LM heads are edited like any other layer.
ENCODERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert": ("BertConfig", "BertForMaskedLM", {}),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", {"type_vocab_size": 1}),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", {"dim": 32, "hidden_dim": 64, "n_layers": 2, "n_heads": 4}),
    "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", {}),
}
VISION: dict[str, Callable[[Path], Path]] = {"llava": make_tiny_llava, "gemma3_vlm": make_tiny_gemma3_vlm}

FACTS = make_facts(24, seed=3)
TARGET = [{"text": p + c} for p, c in FACTS[:6]]
REFERENCE = [{"text": p + c} for p, c in FACTS[6:]]


def _build(family: str, path: Path) -> Path:
    if family in VISION:
        return VISION[family](path)
    if family in ENCODERS:
        return make_tiny_encoder(path, *ENCODERS[family])
    config_name, model_name, extra = FAMILIES[family]
    return make_tiny_from_config(path, config_name, model_name, extra)


def _wait(api: httpx.Client, url: str, done: Callable[[dict[str, Any]], bool], timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer: dict[str, Any] = api.get(url).json()
        if done(answer):
            return answer
        time.sleep(0.3)
    raise TimeoutError(url)


def _job_error(api: httpx.Client, job_id: str) -> str:
    error = api.get(f"/jobs/{job_id}").json().get("error") or {}
    return str(error.get("detail", error))[:160]


def _problem(response: httpx.Response) -> str:
    return f"{response.status_code}: {response.json().get('detail', '')[:160]}"


def try_family(api: httpx.Client, family: str, folder: Path, out: Path) -> str:
    """One family through the API; a line saying what happened."""
    model_id = f"sweep/{family}"
    registered = api.post("/models", params={"wait": 60}, json={"model_id": model_id, "source": f"file://{folder}"})
    if registered.status_code not in (200, 201):
        return f"refused at registration, {_problem(registered)}"
    layers = len(registered.json()["layers"])
    for name, role, records in ((f"{family}-t", "target", TARGET), (f"{family}-r", "reference", REFERENCE)):
        posted = api.post("/concepts", json={"name": name, "role": role, "models": [model_id], "records": records})
        if posted.status_code != 202:
            return f"concept refused, {_problem(posted)}"
    for name in (f"{family}-t", f"{family}-r"):
        state = _wait(api, f"/concepts/{name}", lambda c: c["models"][model_id]["status"] in ("ready", "failed"))
        if state["models"][model_id]["status"] == "failed":
            return f"collection failed: {_job_error(api, state['models'][model_id]['job_id'])}"
    submitted = api.post(f"/models/{model_id}/unlearn", json={"concepts": [f"{family}-t"], "reference": [f"{family}-r"]})
    if submitted.status_code not in (200, 202):
        return f"{layers} layers; unlearn refused, {_problem(submitted)}"
    variant = _wait(api, f"/variants/{submitted.json()['variant']['variant_id']}", lambda v: v["status"] != "building")
    if variant["status"] != "ready":
        return f"{layers} layers; variant failed: {_job_error(api, variant['job_id'])}"
    edited = _load_and_compare(folder, download_variant(api, variant, out / family))
    line = f"{layers} layers, {edited} tensors moved, {len(variant['unreached_layers'])} unreached"
    probes = [{"prompt": p, "completion": c} for p, c in FACTS[:2]]
    evaluated = api.post(f"/variants/{variant['variant_id']}/evaluate", params={"wait": 60}, json={"forget": probes})
    status = evaluated.json().get("status", "") if evaluated.status_code == 200 else _problem(evaluated)
    return f"{line}; evaluate {status}"


def _load_and_compare(base: Path, edited: Path) -> int:
    """Tensors that differ between the base and the variant, both loaded by transformers (and a
    forward pass of the variant, which must be finite)."""
    config = transformers.AutoConfig.from_pretrained(edited)
    cls = getattr(transformers, config.architectures[0])
    before, after = cls.from_pretrained(base).eval(), cls.from_pretrained(edited).eval()
    with torch.no_grad():
        logits = after(input_ids=torch.tensor([[3, 5, 7, 9]])).logits
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError(f"{edited}: the variant's forward pass is not finite")
    old, new = before.state_dict(), after.state_dict()
    return sum(not torch.equal(old[k], new[k]) for k in old if k in new)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help="families to try (default: all)")
    args = parser.parse_args(argv)
    everything = [*FAMILIES, *ENCODERS, *VISION]
    chosen = args.families or everything
    unknown = sorted(set(chosen) - set(everything))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(everything)}")
    with tempfile.TemporaryDirectory(prefix="architecture-sweep-") as tmp:
        root = Path(tmp)
        folders = {family: _build(family, root / "models" / family) for family in chosen}
        server = start_server(root / "store", root / "models", root / "server.log")
        try:
            for family in chosen:
                try:
                    line = try_family(server.client, family, folders[family], root / "out")
                except Exception as exc:  # a line for the family, and on to the next
                    line = f"ERROR {type(exc).__name__}: {exc}"[:300]
                print(f"{family:14} {line}", flush=True)  # noqa: T201
        finally:
            stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
