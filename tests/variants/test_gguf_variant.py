"""GGUF out through the API (issue 36): ``"format": "gguf"`` writes a variant as one ``.gguf`` file.

One live app for the module (``tests.helpers.app``, its own job process) with tiny models: a Llama
(hidden 64, so every matrix row splits into whole 32-blocks), the same Llama written as a Q8_0
``.gguf`` and registered from it, a Mixtral (a mixture of experts), a ResNet image classifier and a
Llama whose tokenizer is word-level (not BPE). What is checked:

- an unlearn with format gguf (F32) writes ``model.gguf`` (listed in the variant's files with its
  sha256), which transformers' GGUF loader reads into a model whose logits equal those of the
  checkpoint variant of the same request within 1e-5; Q8_0 equal to the checkpoint with its matrices round-tripped through
  the gguf package's Q8_0 (within 1e-5) and within :data:`Q8_0_TOLERANCE` of the checkpoint's;
- format and quantization are part of the variant ID (checkpoint, F32, Q8_0 are three variants);
  without gguf_quantization the type is the model's own (Q8_0 for the model registered from a Q8_0
  ``.gguf``), else F16, and naming that default gives the same variant;
- what the writer cannot map is a 422 naming it at submit (the Mixtral, the classifier, the
  word-level tokenizer), as is gguf_quantization without format gguf; evaluating or generating with
  a gguf variant is a 422 pointing to its checkpoint variant (the jobs load no GGUF file);
- in the job (through the real job body on a store world), a failure of the GGUF writer leaves no
  file of the variant, no manifest and no scratch folder.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engram_fixtures.demo import make_facts
from engram_fixtures.live import download_variant, wait_concepts_ready, wait_variant_ready
from engram_fixtures.models import make_tiny_llama, make_tiny_mixtral, make_tokenizer
from engram_fixtures.vision import make_tiny_resnet
from service.engine.gguf_rules import GgufWriteError
from service.engine.gguf_write import write_gguf
from service.variants.service import submit_variant, variant_view
from tests.helpers.api import assert_problem, register_model
from tests.helpers.app import InProcessServer, in_process_server
from tests.helpers.store_world import StoreWorld, text_records

LLAMA, FROM_GGUF, MOE, CLASSIFIER, WORDLEVEL = "gguf/llama", "gguf/from-q8", "gguf/moe", "gguf/resnet", "gguf/wordlevel"
FACTS = make_facts(24, seed=3)
RECORDS = [{"prompt": p, "completion": c} for p, c in FACTS]
UNLEARN = {"concepts": ["gg-forget"], "reference": ["gg-forget", "gg-retain"], "alpha": 0.8}
# Largest |logit difference| to the checkpoint variant: F32 rounds nothing (measured 0: the loader's
# float32 model is the checkpoint's). Q8_0 stores each 32-block of a row at 8 bits: on this random
# tiny model (hidden 64, max |logit| 1.57) measured 0.060, 3.8% of the largest logit (2026-11-29), and
# exactly (0) what the gguf package's own Q8_0 round trip of the checkpoint's matrices gives; the
# bound, relative to the largest logit, leaves 2x room.
F32_TOLERANCE = 1e-5
Q8_0_TOLERANCE = 0.08


def _word_level_tokenizer() -> Any:
    """A fast tokenizer whose ``tokenizer.json`` model is WordLevel: a vocabulary of whole words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for p, c in FACTS for w in (p + c).split()})
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    root = tmp_path_factory.mktemp("gguf-models")
    tokenizer = make_tokenizer()
    llama = make_tiny_llama(root / "llama", hidden=64, layers=2, tie_word_embeddings=True, tokenizer=tokenizer)
    write_gguf(llama, root / "llama-q8.gguf", "Q8_0", "tiny-q8")
    make_tiny_mixtral(root / "moe", tokenizer=tokenizer)
    make_tiny_resnet(root / "resnet")
    make_tiny_llama(root / "wordlevel", hidden=64, layers=2, tokenizer=_word_level_tokenizer())
    with in_process_server(tmp_path_factory.mktemp("gguf-server"), root) as app:
        yield app


@pytest.fixture(scope="module")
def llama(server: InProcessServer) -> InProcessServer:
    """The Llama and the model registered from its Q8_0 ``.gguf``, both with the two concepts."""
    api = server.client
    register_model(api, LLAMA, f"file://{server.model_root / 'llama'}")
    shown = register_model(api, FROM_GGUF, f"file://{server.model_root / 'llama-q8.gguf'}")
    assert shown["quantization"] == "Q8_0", shown
    for name, records, role in (("gg-forget", RECORDS[:8], "target"), ("gg-retain", RECORDS[8:], "reference")):
        body = {"name": name, "models": [LLAMA, FROM_GGUF], "records": records, "role": role}
        response = api.post("/concepts", json=body)
        assert response.status_code == 202, response.text
    wait_concepts_ready(api, ["gg-forget", "gg-retain"], LLAMA)
    wait_concepts_ready(api, ["gg-forget", "gg-retain"], FROM_GGUF)
    return server


def _unlearn(server: InProcessServer, model_id: str, **options: Any) -> dict[str, Any]:
    response = server.client.post(f"/models/{model_id}/unlearn", json={**UNLEARN, **options})
    assert response.status_code in (200, 202), response.text
    return wait_variant_ready(server.client, response.json()["variant"]["variant_id"], timeout=300)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _q8_0_round_trip(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every matrix whose rows split into 32-blocks quantized to Q8_0 and back by the
    gguf package (what the writer stores; vectors stay float32): an independent reference."""
    from gguf import GGMLQuantizationType, quants

    with torch.no_grad():
        for parameter in model.parameters():
            data = parameter.detach().numpy()
            if data.ndim == 2 and data.shape[-1] % 32 == 0:
                quantized = quants.quantize(data, GGMLQuantizationType.Q8_0)
                parameter.copy_(torch.from_numpy(quants.dequantize(quantized, GGMLQuantizationType.Q8_0)))
    return model


def _loaded_gguf(server: InProcessServer, variant: dict[str, Any], target: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    assert [f["path"] for f in variant["files"]] == ["model.gguf"], variant["files"]
    download_variant(server.client, variant, target)
    digest = hashlib.sha256((target / "model.gguf").read_bytes()).hexdigest()
    assert digest == variant["files"][0]["sha256"]  # the manifest's digest is the file's
    return AutoModelForCausalLM.from_pretrained(str(target), gguf_file="model.gguf", dtype=torch.float32).eval()


def test_a_gguf_variant_loads_and_answers_as_the_checkpoint_variant(llama: InProcessServer, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint = _unlearn(llama, LLAMA)
    f32 = _unlearn(llama, LLAMA, format="gguf", gguf_quantization="F32")
    q8 = _unlearn(llama, LLAMA, format="gguf", gguf_quantization="Q8_0")
    ids = {checkpoint["variant_id"], f32["variant_id"], q8["variant_id"]}
    assert len(ids) == 3, ids  # format and quantization are part of the identity
    assert (f32["format"], f32["gguf_quantization"], q8["gguf_quantization"]) == ("gguf", "F32", "Q8_0")
    assert checkpoint["gguf_quantization"] is None
    folder = download_variant(llama.client, checkpoint, tmp_path / "checkpoint")
    expected = _logits(AutoModelForCausalLM.from_pretrained(folder).eval())
    round_tripped = _logits(_q8_0_round_trip(AutoModelForCausalLM.from_pretrained(folder).eval()))
    base = _logits(AutoModelForCausalLM.from_pretrained(llama.model_root / "llama").eval())
    assert (expected - base).abs().max().item() > 1e-3  # the edit changed the answers: the comparison means something
    f32_difference = (_logits(_loaded_gguf(llama, f32, tmp_path / "f32")) - expected).abs().max().item()
    q8_difference = (_logits(_loaded_gguf(llama, q8, tmp_path / "q8")) - expected).abs().max().item()
    q8_model = _loaded_gguf(llama, q8, tmp_path / "q8")
    q8_difference = (_logits(q8_model) - expected).abs().max().item()
    q8_exact = (_logits(q8_model) - round_tripped).abs().max().item()
    scale = expected.abs().max().item()
    print(  # noqa: T201
        f"\nmax |logit diff| to the checkpoint variant: F32 {f32_difference:.2e}, Q8_0 {q8_difference:.4f} "
        f"(max |logit| {scale:.3f}); Q8_0 to the checkpoint with its matrices round-tripped: {q8_exact:.2e}"
    )
    assert f32_difference <= F32_TOLERANCE
    assert q8_exact <= F32_TOLERANCE  # the Q8_0 file's only error is the quantization's
    assert q8_difference <= Q8_0_TOLERANCE * scale


def test_the_default_quantization_is_the_models_own_else_f16(llama: InProcessServer) -> None:
    default = _unlearn(llama, LLAMA, format="gguf")
    assert default["gguf_quantization"] == "F16", default
    assert _unlearn(llama, LLAMA, format="gguf", gguf_quantization="F16")["variant_id"] == default["variant_id"]
    from_gguf = _unlearn(llama, FROM_GGUF, format="gguf")
    assert from_gguf["gguf_quantization"] == "Q8_0", from_gguf  # the type of the .gguf it was registered from


@pytest.mark.parametrize(
    ("model_id", "folder", "mentions"),
    [
        (MOE, "moe", ["MixtralForCausalLM", "LlamaForCausalLM only", 'format "checkpoint"']),
        (CLASSIFIER, "resnet", ["ResNetForImageClassification", "LlamaForCausalLM only"]),
        (WORDLEVEL, "wordlevel", ["byte-level BPE", "'WordLevel'"]),
    ],
    ids=["moe", "image-classifier", "word-level-tokenizer"],
)
def test_what_gguf_cannot_write_is_refused_at_submit_by_name(
    server: InProcessServer, model_id: str, folder: str, mentions: list[str]
) -> None:
    register_model(server.client, model_id, f"file://{server.model_root / folder}", existing_ok=True)
    response = server.client.post(f"/models/{model_id}/unlearn", json={"concepts": ["any"], "format": "gguf"})
    assert_problem(response, 422, model_id, *mentions)
    assert server.client.get("/variants", params={"model_id": model_id}).json() == []


def test_a_gguf_quantization_needs_format_gguf(server: InProcessServer) -> None:
    response = server.client.post(f"/models/{LLAMA}/unlearn", json={"concepts": ["any"], "gguf_quantization": "Q8_0"})
    assert_problem(response, 422, 'gguf_quantization applies to format "gguf" only')
    body = {"concepts": ["any"], "format": "gguf", "gguf_quantization": "Q5_K"}
    assert_problem(server.client.post(f"/models/{LLAMA}/unlearn", json=body), 422, "gguf_quantization")


def test_evaluating_or_generating_with_a_gguf_variant_is_refused_by_name(llama: InProcessServer) -> None:
    variant = _unlearn(llama, LLAMA, format="gguf", gguf_quantization="Q8_0")
    vid = variant["variant_id"]
    probes = {"forget": RECORDS[:2], "retain": RECORDS[8:10]}
    refused = llama.client.post(f"/variants/{vid}/evaluate", json=probes)
    assert_problem(refused, 422, vid, 'format "gguf"', 'format "checkpoint"', "evaluation")
    refused = llama.client.post(f"/variants/{vid}/generate", json={"prompt": FACTS[0][0], "max_new_tokens": 2})
    assert_problem(refused, 422, vid, 'format "gguf"', "generation")
    checkpoint = _unlearn(llama, LLAMA)["variant_id"]  # a gguf variant as the retain model: loaded too
    tofu = {**probes, "metrics": ["forget_truth_ratio"], "retain_model": vid}
    assert_problem(llama.client.post(f"/variants/{checkpoint}/evaluate", json=tofu), 422, vid, 'format "gguf"')


# ---------------------------------------------------------------- the job, on a store world


def test_a_failed_gguf_write_leaves_no_partial_variant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF writer fails after writing part of its file (a stand-in: a real failure, a full disk,
    cannot be had on demand): the job fails naming it; nothing of the variant is stored, and the
    scratch checkpoint and the staging folder are gone."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    world = StoreWorld(tmp_path / "world")
    world.tiny_llama("w/llama", {"forget": text_records(0, 20), "retain": text_records(20, 60)}, hidden=64)
    seen: list[Path] = []

    def failing_write(folder: Path, out: Path, quantization: str, name: str) -> dict[str, int]:
        assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
        seen.append(folder)
        out.write_bytes(b"GGUF partial")
        raise GgufWriteError("injected: the disk is full")

    monkeypatch.setattr("service.engine.gguf_write.write_gguf", failing_write)
    options = {"format": "gguf", "gguf_quantization": "Q8_0", "reference": ["forget", "retain"]}
    view, job = submit_variant(world.ctx, "w/llama", {"forget": -0.8}, 0.8, options)
    assert job is not None
    [done] = world.run_pending()
    assert done.status == "failed" and "injected: the disk is full" in str(done.error), done
    assert variant_view(world.ctx, view.variant_id).status == "failed"
    stored = sorted(p.name for p in (tmp_path / "world" / "store" / "variants" / view.variant_id).rglob("*") if p.is_file())
    # what was asked (the request and its provenance: who, when, labels) is kept; nothing of the variant
    assert stored == ["provenance.json", "request.json"], stored
    assert seen and not seen[0].exists()  # the scratch checkpoint went with the job
    assert list(scratch.iterdir()) == []
