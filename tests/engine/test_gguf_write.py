"""GGUF out, the writer (``service.engine.gguf_write``): the real SmolLM2-135M checkpoint written as
GGUF loads with transformers' GGUF loader and answers as the safetensors checkpoint does, within the
quantization's error; what the writer cannot map is refused by name."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engram_fixtures.real_llm import KNOWN_FACTS
from service.engine.gguf_write import GgufWriteError, check_gguf_writable, default_gguf_quantization, write_gguf

pytestmark = pytest.mark.slow

# Largest |logit difference| over the facts' prompts against the float32 checkpoint: F16 rounds each
# weight to 11 significant bits (measured 0.031 on 2026-11-29), Q8_0 to 8-bit blocks (measured 0.89);
# the bounds leave ~3x and ~1.7x room for another BLAS. The greedy answers must not change at all.
LOGIT_TOLERANCE = {"F16": 0.1, "Q8_0": 1.5}


def _answers_and_logits(model: torch.nn.Module, tokenizer: Any) -> tuple[dict[str, str], list[torch.Tensor]]:
    answers, logits = {}, []
    for prompt, answer in KNOWN_FACTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        length = len(tokenizer(answer, add_special_tokens=False).input_ids)
        with torch.no_grad():
            logits.append(model(**inputs).logits[0])
            output = model.generate(**inputs, max_new_tokens=length, do_sample=False)
        answers[prompt] = tokenizer.decode(output[0, inputs.input_ids.shape[1] :])
    return answers, logits


@pytest.fixture(scope="module")
def reference(real_llm_dir: Path) -> tuple[dict[str, str], list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(real_llm_dir).eval()
    return _answers_and_logits(model, AutoTokenizer.from_pretrained(real_llm_dir))


@pytest.mark.parametrize("quantization", ["F16", "Q8_0"])
def test_the_written_gguf_loads_and_answers_as_the_checkpoint(
    real_llm_dir: Path, tmp_path: Path, reference: tuple[dict[str, str], list[torch.Tensor]], quantization: str
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    counts = write_gguf(real_llm_dir, tmp_path / "model.gguf", quantization, "smollm2-test")
    seconds = time.perf_counter() - started
    assert counts == {quantization: 30 * 7 + 1, "F32": 30 * 2 + 1}  # matrices and the embedding; norms stay float32
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(real_llm_dir).chat_template
    answers, logits = _answers_and_logits(model, tokenizer)
    expected_answers, expected_logits = reference
    assert answers == expected_answers == dict(KNOWN_FACTS)
    difference = max((a - b).abs().max().item() for a, b in zip(logits, expected_logits, strict=True))
    size = (tmp_path / "model.gguf").stat().st_size
    print(f"\n{quantization}: written in {seconds:.1f} s, {size} bytes, max |logit diff| {difference:.3f}")  # noqa: T201
    assert difference <= LOGIT_TOLERANCE[quantization]


@pytest.mark.parametrize("tied", [True, False])
def test_a_float32_gguf_is_the_checkpoint_exactly_tied_head_or_not(tmp_path: Path, tied: bool) -> None:
    """F32 rounds nothing: the loader's model equals the checkpoint's, so the names, the q/k permutation
    (4 heads) and the head (an edited tied head is stored untied: ``output.weight``) are all right."""
    from transformers import AutoModelForCausalLM

    from engram_fixtures.models import make_tiny_llama

    folder = make_tiny_llama(tmp_path / "tiny", hidden=64, layers=2, tie_word_embeddings=tied)
    counts = write_gguf(folder, tmp_path / "tiny.gguf", "F32", "tiny")
    assert counts == {"F32": 2 * 9 + 2 + (0 if tied else 1)}
    expected = AutoModelForCausalLM.from_pretrained(folder).eval()
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    assert loaded.config.tie_word_embeddings is tied
    tokens = torch.tensor([[1, 5, 9, 22, 3, 140]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, expected(tokens).logits)


def test_what_the_writer_cannot_map_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(GgufWriteError, match=r"writes LlamaForCausalLM only; this model is GPT2LMHeadModel"):
        check_gguf_writable({"architectures": ["GPT2LMHeadModel"]}, "F16")
    with pytest.raises(GgufWriteError, match=r"writes LlamaForCausalLM only; this model is MixtralForCausalLM"):
        check_gguf_writable({"architectures": ["MixtralForCausalLM"]}, "Q8_0")
    with pytest.raises(GgufWriteError, match=r"gguf quantization 'Q5_K' is not one of F32, F16, BF16, Q8_0, Q4_0, Q4_1"):
        check_gguf_writable({"architectures": ["LlamaForCausalLM"]}, "Q5_K")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(GgufWriteError, match="this model is LlamaForSequenceClassification"):
        write_gguf(tmp_path, tmp_path / "out.gguf", "F16", "classifier")
    assert not (tmp_path / "out.gguf").exists()


def test_the_default_quantization_is_the_sources_where_it_can_be_written() -> None:
    assert default_gguf_quantization("Q4_1") == "Q4_1"
    assert default_gguf_quantization("Q8_0") == "Q8_0"
    assert default_gguf_quantization("Q4_K") == "F16"  # the writer has no K-quant
    assert default_gguf_quantization(None) == "F16"  # a safetensors checkpoint
