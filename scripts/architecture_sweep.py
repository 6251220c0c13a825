"""Every architecture family the README lists, tried through a live server as a user would.

Each family is a tiny random model built offline from its transformers config (no hub). The
script registers it, posts a target and a reference concept, unlearns the target, downloads the
checkpoint variant, loads it back with transformers, runs a forward pass on it and, for a model
that predicts the next token, evaluates it through the API. It prints one line per family: the
editable layers, how many the variant moved, the layers it left as they were (unreached), and any
refusal, as the service worded it. The tests pin a subset of these families
(tests/api/test_architectures.py, test_multimodal.py, tests/engine/test_moe_architectures.py), and
tests/e2e/test_image_sweep.py runs the image part whole.

The image part: every ``…ForImageClassification`` family transformers has (ViT, DeiT, BEiT, Swin,
ConvNeXt, ResNet, RegNet, EfficientNet, MobileNetV1/V2, the CLIP and SigLIP vision towers; built by
:mod:`engram_fixtures.image_families`), with image records (base64 PNGs) for concepts. Its line says
``edited`` (the layers, how many are convs, the tensors the variant moved, its logits finite) or
``refused`` with the service's reason; either way the layers the service does not edit (a depthwise
conv) are counted and the first one's reason quoted.

    .venv/bin/python -m scripts.architecture_sweep               # every family, a few minutes
    .venv/bin/python -m scripts.architecture_sweep qwen2 mamba   # some
    .venv/bin/python -m scripts.architecture_sweep --images      # the image families only
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import transformers
from PIL import Image

from engram_fixtures.demo import make_facts
from engram_fixtures.image_families import IMAGE_FAMILIES, IMAGE_SIDE, make_tiny_image_classifier
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


def _pictures(count: int, seed: int, tint: int) -> list[dict[str, str]]:
    """Image records: random PNGs of the model's side, their red channel raised by ``tint``."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        pixels = rng.integers(0, 256 - tint, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
        pixels[..., 0] += np.uint8(tint)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        records.append({"image": base64.b64encode(buffer.getvalue()).decode()})
    return records


IMAGE_TARGET, IMAGE_REFERENCE = _pictures(6, seed=1, tint=120), _pictures(18, seed=2, tint=0)


def _build(family: str, path: Path) -> Path:
    if family in IMAGE_FAMILIES:
        return make_tiny_image_classifier(family, path)
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


def try_image_family(api: httpx.Client, family: str, folder: Path, out: Path) -> str:
    """One image family through the API: ``edited …`` or ``refused …``, and the layers left unedited."""
    model_id = f"sweep/{family}"
    # a short wait, then the job: the client's read timeout is 60 s, and a busy machine may take longer
    registered = api.post("/models", params={"wait": 20}, json={"model_id": model_id, "source": f"file://{folder}"})
    if registered.status_code == 202:  # a busy machine: the registration job outlasted the wait
        job = _wait(api, f"/jobs/{registered.json()['job_id']}", lambda j: j["status"] in ("succeeded", "failed"))
        if job["status"] != "succeeded":
            return f"refused at registration: {_job_error(api, job['job_id'])}"
        registered = api.get(f"/models/{model_id}")
    if registered.status_code not in (200, 201):
        return f"refused at registration, {_problem(registered)}"
    model = registered.json()
    layers, refused = model["layers"], model.get("refused_layers") or {}
    convs = sum(1 for layer in layers if layer.get("kernel"))
    unedited = f"; {len(refused)} layers not edited ({next(iter(refused.values()))})" if refused else ""
    names = (f"{family}-t", f"{family}-r")
    for name, role, records in zip(names, ("target", "reference"), (IMAGE_TARGET, IMAGE_REFERENCE), strict=True):
        posted = api.post("/concepts", json={"name": name, "role": role, "models": [model_id], "records": records})
        if posted.status_code != 202:
            return f"refused: concept {_problem(posted)}{unedited}"
    for name in names:
        state = _wait(api, f"/concepts/{name}", lambda c: c["models"][model_id]["status"] in ("ready", "failed"))
        if state["models"][model_id]["status"] == "failed":
            return f"refused: collection failed: {_job_error(api, state['models'][model_id]['job_id'])}{unedited}"
    submitted = api.post(f"/models/{model_id}/unlearn", json={"concepts": [names[0]], "reference": [names[1]]})
    if submitted.status_code not in (200, 202):
        return f"refused: unlearn {_problem(submitted)}{unedited}"
    variant = _wait(api, f"/variants/{submitted.json()['variant']['variant_id']}", lambda v: v["status"] != "building")
    if variant["status"] != "ready":
        return f"refused: variant failed: {_job_error(api, variant['job_id'])}{unedited}"
    moved = _load_and_compare_images(folder, download_variant(api, variant, out / family))
    return f"edited: {len(layers)} layers ({convs} conv), {moved} tensors moved{unedited}"


def _load_and_compare_images(base: Path, edited: Path) -> int:
    """Tensors the variant moved (both loaded by transformers); its logits on an image must be finite."""
    before = transformers.AutoModelForImageClassification.from_pretrained(base).eval()
    after = transformers.AutoModelForImageClassification.from_pretrained(edited).eval()
    with torch.no_grad():
        logits = after(pixel_values=torch.randn(1, 3, IMAGE_SIDE, IMAGE_SIDE)).logits
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError(f"{edited}: the variant's forward pass is not finite")
    old, new = before.state_dict(), after.state_dict()
    return sum(not torch.equal(old[k], new[k]) for k in old if k in new)


def try_family(api: httpx.Client, family: str, folder: Path, out: Path) -> str:
    """One family through the API; a line saying what happened."""
    if family in IMAGE_FAMILIES:
        return try_image_family(api, family, folder, out)
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
    parser.add_argument("--images", action="store_true", help="the image classifier families only")
    args = parser.parse_args(argv)
    everything = [*FAMILIES, *ENCODERS, *VISION, *IMAGE_FAMILIES]
    chosen = args.families or (list(IMAGE_FAMILIES) if args.images else everything)
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
