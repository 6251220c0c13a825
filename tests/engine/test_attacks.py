"""The attack library (issue 37): quantization round trips, relearning and rephrasing, against
independent computations written here.

- Q8_0/Q4_0/Q4_1 on a tiny Llama equal the gguf package's own round trip of the same tensors, chosen
  here by llama.cpp's rule (decoder 2-D weights and an untied embedding at the type; the head Q8_0 for
  Q8_0 and, for Q4_x, Q6_K, which gguf 0.19.0 cannot write, so kept); norms never change.
- int8 and NF4 rounding on tensors whose answer is worked out by hand.
- relearning is deterministic for a seed and equals a plain AdamW loop written in the test.
- rephrasing renders a prompt/completion probe through the chat template and a chat probe without it.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from transformers import LlamaConfig, LlamaForCausalLM

from engram_fixtures.models import CHAT_TEMPLATE, make_tokenizer
from service.engine.attacks.quantize import (
    NF4_CODE,
    int8_round_trip,
    nf4_round_trip,
    quantize_in_place,
    quantize_plan,
)
from service.engine.attacks.relearn import probe_row, relearned, text_row
from service.engine.attacks.rephrase import as_chat, as_plain, with_answer
from service.engine.chat import last_turn
from service.engine.evaluate import TextProbe, encoded
from service.engine.records import Message
from tests.helpers.attacks import fine_tuned_rows


def tiny_llama(tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so that a quantized norm would show
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def gguf_back(tensor: torch.Tensor, qtype: str) -> torch.Tensor:
    kind = GGMLQuantizationType[qtype]
    return torch.from_numpy(np.array(quants.dequantize(quants.quantize(tensor.numpy(), kind), kind)))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_gguf_round_trip_of_a_tiny_llama_is_the_gguf_packages_on_the_tensors_llama_cpp_quantizes(qtype: str) -> None:
    model = tiny_llama()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    plan = quantize_plan(model, qtype)
    attacked = copy.deepcopy(model)
    quantize_in_place(attacked, plan)
    head_kept = qtype != "Q8_0"  # llama.cpp: Q6_K for the head, which gguf 0.19.0 cannot quantize
    assert ("lm_head.weight" in plan.kept) == head_kept
    rounded = 0
    for name, after in attacked.state_dict().items():
        before = original[name]
        if before.dim() < 2 or (name == "lm_head.weight" and head_kept):
            assert torch.equal(after, before), f"{name} changed"
            continue
        expected_type = "Q8_0" if name == "lm_head.weight" else qtype
        assert torch.equal(after, gguf_back(before, expected_type)), name
        assert not torch.equal(after, before), f"{name} was not rounded"
        rounded += 1
    assert rounded == 2 * 7 + 1 + (0 if head_kept else 1)  # 7 linear weights a layer, the embedding, the head
    assert torch.equal(model.state_dict()["lm_head.weight"], original["lm_head.weight"])  # the model itself untouched


def test_a_tied_embedding_follows_the_heads_rule() -> None:
    model = tiny_llama(tied=True)
    q4 = quantize_plan(model, "Q4_1")
    assert "model.embed_tokens.weight" in q4.kept and "tied" in q4.kept["model.embed_tokens.weight"]
    assert quantize_plan(model, "Q8_0").rounded["model.embed_tokens.weight"] == "Q8_0"


def test_int8_is_per_output_channel_absmax() -> None:
    weight = torch.tensor([[1.0, -0.6, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [0.02, -0.04, 0.01, 0.03]])
    back = int8_round_trip(weight)
    expected_row0 = torch.tensor([127, -76, 32, 0]) / 127.0  # round(w * 127 / 1.0)
    assert torch.allclose(back[0], expected_row0, atol=0, rtol=1e-6)
    assert torch.equal(back[1], torch.zeros(4))  # an all-zero row stays zero (no division by 0)
    scale = 0.04 / 127
    assert torch.allclose(back[2], torch.round(weight[2] / scale) * scale, atol=0, rtol=1e-6)


def test_nf4_rounds_each_block_of_64_to_the_nearest_code_times_its_absmax() -> None:
    weight = torch.zeros(2, 40)  # 80 values: a block of 64 and a padded block of 16
    weight[0, 0], weight[0, 1], weight[0, 2] = 2.0, 0.3, -0.9  # block 1: absmax 2
    weight[1, 30] = -0.5  # block 2 (values 64..79): absmax 0.5
    back = nf4_round_trip(weight)
    assert back.shape == weight.shape
    assert back[0, 0] == 2.0
    assert back[0, 1] == pytest.approx(2 * NF4_CODE[9], abs=1e-7)  # 0.15 -> 0.1609
    assert back[0, 2] == pytest.approx(2 * NF4_CODE[3], abs=1e-7)  # -0.45 -> -0.3949
    assert back[1, 30] == -0.5
    assert int((back != 0).sum()) == 4


def test_torch_types_round_every_linear_but_the_head() -> None:
    plan = quantize_plan(tiny_llama(), "nf4")
    assert set(plan.rounded) == {f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    )}  # fmt: skip
    assert list(plan.kept) == ["lm_head.weight"]
    with pytest.raises(ValueError, match="Q6_K"):
        quantize_plan(tiny_llama(), "Q6_K")


ROWS = [probe_row([1, 5, 7], [9, 11]), probe_row([2, 3], [4, 8, 12]), text_row([3, 4, 5, 6, 7, 8])]


def plain_fine_tuning(model: LlamaForCausalLM, steps: int, lr: float, seed: int) -> LlamaForCausalLM:
    """ROWS as a customer writes them (prompts labelled -100), padded with 0, through the plain AdamW loop."""
    data = [([1, 5, 7, 9, 11], [-100, -100, -100, 9, 11]), ([2, 3, 4, 8, 12], [-100, -100, 4, 8, 12]),
            ([3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8])]  # fmt: skip
    return fine_tuned_rows(model, data, pad=0, steps=steps, lr=lr, seed=seed)


def test_relearning_is_a_plain_adamw_loop_and_the_same_for_a_seed() -> None:
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses: list[float] = []
    first = relearned(model, ROWS, steps=4, lr=1e-3, seed=11, pad_id=0, on_step=lambda _i, loss: losses.append(loss))
    second = relearned(model, ROWS, steps=4, lr=1e-3, seed=11, pad_id=0)
    reference = plain_fine_tuning(model, steps=4, lr=1e-3, seed=11)
    assert len(losses) == 4 and losses[-1] < losses[0]
    for name, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[name]), name
        assert torch.allclose(value, reference.state_dict()[name], atol=1e-7, rtol=0), name
        assert torch.equal(model.state_dict()[name], before[name]), f"the model itself changed: {name}"
    assert not torch.equal(first.state_dict()["lm_head.weight"], before["lm_head.weight"])
    assert not any(p.requires_grad for p in first.parameters()) and not first.training
    with pytest.raises(ValueError, match="steps >= 1"):
        relearned(model, ROWS, steps=0, lr=1e-3, seed=0, pad_id=0)


def test_rephrasing_renders_a_probe_through_the_chat_template_and_a_chat_probe_without_it() -> None:
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    pair = TextProbe("Where was Ada born?", " Quillmoor")
    chat = as_chat(pair)
    user = {"role": "user", "content": "Where was Ada born?"}
    assert chat.messages == [user, {"role": "assistant", "content": "Quillmoor"}]
    ids = encoded(tokenizer, chat).ids
    assert ids == last_turn(tokenizer, [Message("user", "Where was Ada born?"), Message("assistant", "Quillmoor")])
    assert ids != encoded(tokenizer, pair).ids
    plain = as_plain(TextProbe(messages=[{"role": "system", "content": "Be brief."}, *chat.messages]))
    assert (plain.prompt, plain.completion) == ("Be brief.\nWhere was Ada born?", " Quillmoor")
    answer_ids = list(tokenizer(" Quillmoor", add_special_tokens=False)["input_ids"])
    assert (encoded(tokenizer, plain).ids or ([], []))[1] == answer_ids
    assert as_plain(pair) == pair and as_chat(chat) == chat
    assert with_answer(pair, " in Quillmoor").completion == " in Quillmoor"
    assert list(with_answer(chat, "In Quillmoor").messages or [])[-1] == {"role": "assistant", "content": "In Quillmoor"}
