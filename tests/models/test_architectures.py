"""GPT-2 (Conv1D, biased, tied head), BERT (biased Linear encoder), GPT-NeoX (the head stored
under its old name ``embed_out``) and the causal families of ``CAUSAL_FAMILIES`` (fused QKV, biased
QKV, parallel blocks, a tied scaled-embedding head, learned positions) through the same API path.

The downloaded checkpoint must equal the engine's own computation from in-process statistics, keep
the tied embedding untouched, and load with transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

from engram_fixtures.demo import make_facts
from engram_fixtures.live import wait_concepts_ready, wait_variant_ready
from engram_fixtures.models import (
    CAUSAL_FAMILIES,
    make_tiny_bert,
    make_tiny_causal_lm,
    make_tiny_gpt2,
    make_tiny_gpt_neox,
)
from service.engine.checkpoint import CheckpointReader, inspect_model_dir
from service.engine.collect import collect_statistics
from service.engine.compose import EngramAlgebra, layer_edits, layer_scales
from service.engine.records import Record, encode_record, make_batches, pad_token_id
from tests.helpers.api import register_model

FACTS = make_facts(24, seed=3)
TARGET = [{"text": p + c} for p, c in FACTS[:6]]
REFERENCE = [{"text": p + c} for p, c in FACTS[6:]]

CASES = {
    "gpt2": (make_tiny_gpt2, AutoModelForCausalLM, "transformer.wte.weight"),
    "bert": (make_tiny_bert, AutoModelForMaskedLM, "bert.embeddings.word_embeddings.weight"),
    "gpt_neox": (make_tiny_gpt_neox, AutoModelForCausalLM, "gpt_neox.embed_in.weight"),
    "phi3": (partial(make_tiny_causal_lm, family="phi3"), AutoModelForCausalLM, "model.embed_tokens.weight"),
    "qwen2": (partial(make_tiny_causal_lm, family="qwen2"), AutoModelForCausalLM, "model.embed_tokens.weight"),
    "falcon": (partial(make_tiny_causal_lm, family="falcon"), AutoModelForCausalLM, "transformer.word_embeddings.weight"),
    "gemma3": (partial(make_tiny_causal_lm, family="gemma3"), AutoModelForCausalLM, "model.embed_tokens.weight"),
    "opt": (partial(make_tiny_causal_lm, family="opt"), AutoModelForCausalLM, "model.decoder.embed_tokens.weight"),
}
assert set(CAUSAL_FAMILIES) <= set(CASES)


def _engine_edits(model_dir: Path, loader: Callable, scaling: str) -> dict[str, torch.Tensor]:
    """The expected variant: statistics collected in-process, edits from the engine directly."""
    model, tokenizer = loader.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    layout = inspect_model_dir(model_dir)

    def stats(records: list[dict[str, str]]) -> object:
        examples = [encode_record(tokenizer, Record.from_mapping(r, i), 512) for i, r in enumerate(records)]
        return collect_statistics(model, make_batches(examples, 8, pad_token_id(tokenizer)), layout.layers)

    target, reference = stats(TARGET), stats(REFERENCE)
    algebra = EngramAlgebra([(-1.0, target)], [target, reference])
    reader = CheckpointReader(model_dir, layout)
    scales = layer_scales(layout.layers, algebra, reader.layer_weights, scaling)
    return {e.spec.name: e.weight for e in layer_edits(layout.layers, algebra, reader.layer_weights, scales)}


def _registered(api: httpx.Client, model_root: Path, arch: str) -> tuple[Path, str]:
    """The tiny model of ``arch`` registered with its target and reference concepts collected
    (posting both again is idempotent): its folder and model ID."""
    model_dir = model_root / f"arch-{arch}"
    if not model_dir.exists():
        CASES[arch][0](model_dir)
    model_id = f"arch/{arch}"
    register_model(api, model_id, f"file://{model_dir}", existing_ok=True)
    for name, role, records in ((f"{arch}-t", "target", TARGET), (f"{arch}-r", "reference", REFERENCE)):
        body = {"name": name, "role": role, "models": [model_id], "records": records}
        assert api.post("/concepts", json=body).status_code == 202
    wait_concepts_ready(api, [f"{arch}-t", f"{arch}-r"], model_id)
    return model_dir, model_id


@pytest.mark.parametrize("arch", sorted(CASES))
@pytest.mark.parametrize("scaling", ["uniform", "weight_norm"])
def test_architecture_unlearns_through_the_api(
    arch: str, scaling: str, api: httpx.Client, model_root: Path, tmp_path: Path
) -> None:
    _, loader, embedding_key = CASES[arch]
    model_dir, model_id = _registered(api, model_root, arch)

    request = {"concepts": [f"{arch}-t"], "reference": [f"{arch}-r"], "alpha": 1.0, "scaling": scaling}
    submitted = api.post(f"/models/{model_id}/unlearn", json=request)
    assert submitted.status_code in (200, 202), submitted.text
    variant = wait_variant_ready(api, submitted.json()["variant"]["variant_id"])
    out = tmp_path / "variant"
    out.mkdir()
    for entry in variant["files"]:
        (out / entry["path"]).write_bytes(api.get(f"/variants/{variant['variant_id']}/files/{entry['path']}").content)

    base = loader.from_pretrained(model_dir).eval()
    edited = loader.from_pretrained(out).eval()
    expected = _engine_edits(model_dir, loader, scaling)
    edited_modules = dict(edited.named_modules())
    for name, weight in expected.items():
        assert torch.allclose(edited_modules[name].weight.detach(), weight, rtol=1e-5, atol=1e-6), name
    base_params, edited_params = dict(base.named_parameters()), dict(edited.named_parameters())
    # The tied embedding is never edited, even though the head that shares it was.
    assert torch.equal(edited_params[embedding_key], base_params[embedding_key])
    assert edited.get_output_embeddings().weight.data_ptr() != edited.get_input_embeddings().weight.data_ptr()
    # The head is edited, whatever name the checkpoint stores it under.
    head = next(n for n, m in base.named_modules() if m is base.get_output_embeddings())
    assert head in expected
    changed = [n for n in expected if not torch.equal(edited_modules[n].weight, dict(base.named_modules())[n].weight)]
    assert len(changed) == len(expected), "every selected layer moved"


@pytest.mark.parametrize("arch", sorted(a for a, case in CASES.items() if case[1] is AutoModelForCausalLM))
def test_a_causal_variant_is_evaluated_whatever_its_class_is_called(arch: str, api: httpx.Client, model_root: Path) -> None:
    """Evaluation takes any model that predicts the next token (GPT-2's class is ``GPT2LMHeadModel``)."""
    _, model_id = _registered(api, model_root, arch)
    request = {"concepts": [f"{arch}-t"], "reference": [f"{arch}-r"], "alpha": 1.0, "scaling": "uniform"}
    variant = api.post(f"/models/{model_id}/unlearn", json=request)
    assert variant.status_code in (200, 202), variant.text  # built by the test above, or now
    variant_id = wait_variant_ready(api, variant.json()["variant"]["variant_id"])["variant_id"]
    probes = [{"prompt": p, "completion": c} for p, c in FACTS[:2]]
    answer = api.post(f"/variants/{variant_id}/evaluate", params={"wait": 60}, json={"forget": probes, "retain": probes})
    assert answer.status_code == 200, answer.text
    job = answer.json()
    assert job["status"] == "succeeded", job["error"]
    assert job["result"]["summary"]["variant"]["forget"]["n"] == 2


def test_a_masked_lm_is_refused_evaluation_before_any_job(api: httpx.Client, model_root: Path) -> None:
    """BERT predicts masked tokens, not the next one: evaluate, generate and calibrate are a 422 at
    once (recorded at registration), not a job that fails later."""
    _, model_id = _registered(api, model_root, "bert")
    request = {"concepts": ["bert-t"], "reference": ["bert-r"], "alpha": 1.0, "scaling": "uniform"}
    variant = api.post(f"/models/{model_id}/unlearn", json=request)
    variant_id = wait_variant_ready(api, variant.json()["variant"]["variant_id"])["variant_id"]
    probes = [{"prompt": p, "completion": c} for p, c in FACTS[:2]]
    jobs_before = {job["job_id"] for job in api.get("/jobs").json()}
    answers = [
        api.post(f"/variants/{variant_id}/evaluate", json={"forget": probes}),
        api.post(f"/variants/{variant_id}/generate", json={"prompt": "Paris is"}),
        api.post(f"/models/{model_id}/calibrate", json={"concepts": ["bert-t"], "forget": probes, "retain": probes}),
    ]
    for answer in answers:
        assert answer.status_code == 422, answer.text
        assert "predicts the next token" in answer.json()["detail"] and "BertForMaskedLM" in answer.json()["detail"]
    assert {job["job_id"] for job in api.get("/jobs").json()} == jobs_before  # nothing queued
