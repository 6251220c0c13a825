"""Vision-language models under text concepts: the language model is edited, the vision side is not.

Text records never run a vision tower or its projector: those layers get no statistics because the
forward pass never called them ("unreached"), so every engram there is zero. The variant leaves them
byte for byte as they were and names them (``unreached_layers``); an edit of nothing but them is a
409. The edited layers equal the engine's own computation from in-process statistics.

A layer whose module runs but whose weight is used without calling it (Mamba's ``dt_proj``) is not
unreached: its input exists, unseen, so an edit that needs it is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoTokenizer

from engram_fixtures.demo import make_facts
from engram_fixtures.live import download_variant, wait_concepts_ready, wait_for_job, wait_variant_ready
from engram_fixtures.models import make_tiny_gemma3_vlm, make_tiny_llava, make_tiny_mamba
from service.engine.checkpoint import CheckpointReader, inspect_model_dir
from service.engine.collect import collect_statistics
from service.engine.compose import EngramAlgebra, layer_edits, layer_scales
from service.engine.experts import unsupported_experts
from service.engine.records import Record, encode_record, make_batches, pad_token_id
from tests.helpers.api import register_model

FACTS = make_facts(24, seed=5)
TARGET = [{"text": p + c} for p, c in FACTS[:6]]
REFERENCE = [{"text": p + c} for p, c in FACTS[6:]]
VISION = ("vision_tower", "multi_modal_projector")

CASES: dict[str, Callable[[Path], Path]] = {"llava": make_tiny_llava, "gemma3": make_tiny_gemma3_vlm}


def _is_vision(name: str) -> bool:
    return any(part in name.split(".") for part in VISION)


def _engine_edits(model_dir: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The expected edits of the reached layers, and the layers collection never reached."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    layout = inspect_model_dir(model_dir)

    def stats(records: list[dict[str, str]]) -> object:
        examples = [encode_record(tokenizer, Record.from_mapping(r, i), 512) for i, r in enumerate(records)]
        return collect_statistics(model, make_batches(examples, 8, pad_token_id(tokenizer)), layout.layers)

    target, reference = stats(TARGET), stats(REFERENCE)
    reached = [spec for spec in layout.layers if spec.name not in target.unreached]  # type: ignore[attr-defined]
    algebra = EngramAlgebra([(-1.0, target)], [target, reference])
    reader = CheckpointReader(model_dir, layout)
    scales = layer_scales(reached, algebra, reader.layer_weights, "uniform")
    edits = {e.spec.name: e.weight for e in layer_edits(reached, algebra, reader.layer_weights, scales)}
    return edits, list(target.unreached)  # type: ignore[attr-defined]


@pytest.mark.parametrize("arch", sorted(CASES))
def test_a_vision_language_model_is_edited_where_text_reaches(
    arch: str, api: httpx.Client, model_root: Path, tmp_path: Path
) -> None:
    model_dir = model_root / f"vlm-{arch}"
    if not model_dir.exists():
        CASES[arch](model_dir)
    model_id = f"vlm/{arch}"
    registered = register_model(api, model_id, f"file://{model_dir}", existing_ok=True)
    names = [layer["name"] for layer in registered["layers"]]
    assert any(_is_vision(n) for n in names), "the vision side is listed among the model's layers"
    for name, role, records in ((f"{arch}-vt", "target", TARGET), (f"{arch}-vr", "reference", REFERENCE)):
        body = {"name": name, "role": role, "models": [model_id], "records": records}
        assert api.post("/concepts", json=body).status_code == 202
    wait_concepts_ready(api, [f"{arch}-vt", f"{arch}-vr"], model_id)

    # An edit of nothing but unreached layers would change nothing: refused by name.
    only_vision = {"concepts": [f"{arch}-vt"], "reference": [f"{arch}-vr"], "modules": ["fc1", "fc2"]}
    refused = api.post(f"/models/{model_id}/unlearn", json=only_vision)
    assert refused.status_code == 409, refused.text
    assert "no concept of the edit reaches" in refused.json()["detail"]

    request = {"concepts": [f"{arch}-vt"], "reference": [f"{arch}-vr"], "alpha": 1.0}
    submitted = api.post(f"/models/{model_id}/unlearn", json=request)
    assert submitted.status_code in (200, 202), submitted.text
    variant = wait_variant_ready(api, submitted.json()["variant"]["variant_id"])
    expected, unreached = _engine_edits(model_dir)
    assert unreached and all(_is_vision(n) for n in unreached)
    assert sorted(variant["unreached_layers"]) == sorted(unreached)
    assert not any(_is_vision(n) for n in expected) and "lm_head" in expected

    out = download_variant(api, variant, tmp_path / "variant")
    base, edited = load_file(str(model_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(base) <= set(edited)  # plus the head of a tied model, written untied
    layout = inspect_model_dir(model_dir)
    for name in unreached:  # written as they were, bit for bit
        key = layout.weight_keys[name]
        assert torch.equal(edited[key], base[key]), name
    loaded = dict(AutoModelForImageTextToText.from_pretrained(out).named_modules())
    for name, weight in expected.items():
        assert not torch.equal(weight, base[layout.weight_keys[name]].to(weight.dtype)), f"{name} moved"
        assert torch.allclose(loaded[name].weight.detach(), weight, rtol=1e-5, atol=1e-6), name

    # The biased vision layers are never edited, so a vLLM adapter (no lora_bias) is fine.
    adapter = api.post(f"/models/{model_id}/unlearn", json={**request, "format": "peft", "lora_target": "vllm"})
    assert adapter.status_code in (200, 202), adapter.text
    adapter_view = wait_variant_ready(api, adapter.json()["variant"]["variant_id"])
    assert sorted(adapter_view["unreached_layers"]) == sorted(unreached)
    # Calibration evaluates candidates of the reached layers only, so a vLLM adapter is fine there too.
    probes = [{"prompt": p, "completion": c} for p, c in FACTS[:2]]
    calibrate = {
        "concepts": [f"{arch}-vt"],
        "reference": [f"{arch}-vr"],
        "forget": probes,
        "retain": [{"prompt": p, "completion": c} for p, c in FACTS[6:8]],
        "budget": 2,
        "scalings": ["uniform"],
        "module_sets": ["all"],
        "format": "peft",
        "lora_target": "vllm",
    }
    started = api.post(f"/models/{model_id}/calibrate", json=calibrate)
    assert started.status_code in (200, 202), started.text
    job = wait_for_job(api, started.json()["job"]["job_id"], timeout=180)
    assert job["status"] == "succeeded", job["error"]
    # The map draws the layers that have an engram.
    drawn = api.get(f"/models/{model_id}/engram-map", params={"concepts": f"{arch}-vt", "wait": 60})
    assert drawn.status_code == 200, drawn.text
    assert sorted(layer["name"] for layer in drawn.json()["layers"]) == sorted(expected)


def test_a_single_pooling_probe_is_not_taken_for_packed_experts(tmp_path: Path) -> None:
    """SigLIP's ``head.probe`` is [1, 1, D]: three dimensions, one slice, not a ParallelExperts pack."""
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(make_tiny_gemma3_vlm(tmp_path / "g"))
    assert any(name.endswith("head.probe") for name, _ in model.named_parameters())
    assert unsupported_experts(model) == []


def test_a_bypassed_layer_is_refused_by_name_and_the_others_edit(api: httpx.Client, model_root: Path) -> None:
    model_dir = model_root / "mamba"
    if not model_dir.exists():
        make_tiny_mamba(model_dir)
    model_id = "ssm/mamba"
    register_model(api, model_id, f"file://{model_dir}", existing_ok=True)
    for name, role, records in (("mamba-t", "target", TARGET), ("mamba-r", "reference", REFERENCE)):
        assert (
            api.post("/concepts", json={"name": name, "role": role, "models": [model_id], "records": records}).status_code
            == 202
        )
    wait_concepts_ready(api, ["mamba-t", "mamba-r"], model_id)
    request = {"concepts": ["mamba-t"], "reference": ["mamba-r"]}
    refused = api.post(f"/models/{model_id}/unlearn", json=request)
    assert refused.status_code == 409, refused.text
    assert "dt_proj" in refused.json()["detail"]
    chosen = {**request, "modules": ["in_proj", "x_proj", "out_proj", "lm_head"]}
    submitted = api.post(f"/models/{model_id}/unlearn", json=chosen)
    assert submitted.status_code in (200, 202), submitted.text
    variant = wait_variant_ready(api, submitted.json()["variant"]["variant_id"])
    assert variant["unreached_layers"] == []
