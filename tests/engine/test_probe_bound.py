"""Probes are bounded by what the model reads (service/engine/probe_bound.py; issue 35, finding 5).

With the fixtures' byte-level BPE tokenizer and a model context of 128 positions: a probe of 20,000
characters keeps the answer whole and the last prompt tokens (after BOS), within 128 tokens, and
only its last ``bound.chars`` characters are ever tokenized; an answer past the bound is refused
naming the setting, without being tokenized; a probe within the bound encodes exactly as without
it. TOFU's answers share one cut of their prompt. Batches are cut by padded tokens.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from engram_fixtures.models import CHAT_TEMPLATE, make_tokenizer
from service.engine.chat import InProcess, last_turn
from service.engine.evaluate import TextProbe, encode_probe, encoded, token_batches
from service.engine.messages import Message
from service.engine.probe_bound import ProbeBound, ProbeTooLong, probe_bound
from service.engine.tofu_scoring import AnswerRefused, TofuProbe, encoded_tofu
from tests.helpers.long_text import CountingTokenizer, words

CONTEXT = 128  # the tiny Llama's max_position_embeddings
LONG = 20_000


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture
def bound(tokenizer: Any) -> ProbeBound:
    return probe_bound(tokenizer, SimpleNamespace(max_position_embeddings=CONTEXT), 512)


def test_the_bound_is_the_smaller_of_the_context_and_max_length(tokenizer: Any) -> None:
    by_context = probe_bound(tokenizer, SimpleNamespace(max_position_embeddings=CONTEXT), 512)
    assert (by_context.tokens, "max_position_embeddings 128" in by_context.why) == (CONTEXT, True)
    by_setting = probe_bound(tokenizer, SimpleNamespace(max_position_embeddings=4096), 512)
    assert (by_setting.tokens, by_setting.why) == (512, "ENGRAM_MAX_LENGTH 512")
    assert by_setting.remedy == "shorten the answer or raise ENGRAM_MAX_LENGTH"
    unknown = probe_bound(tokenizer, SimpleNamespace(), 64)
    assert unknown.tokens == 64
    longest = max(len(token) for token in tokenizer.get_vocab())
    assert by_context.chars == (CONTEXT + 1) * longest  # record_budget's budget


def test_a_probe_of_20k_characters_keeps_its_answer_and_last_prompt_tokens(tokenizer: Any, bound: ProbeBound) -> None:
    prompt, completion = words(LONG), " Quillmoor"
    counting = CountingTokenizer(tokenizer)
    probe = encoded(counting, TextProbe(prompt, completion), bound=bound)  # type: ignore[arg-type]
    assert probe.ids is not None
    prompt_ids, answer_ids = probe.ids
    assert probe.cut
    assert len(prompt_ids) + len(answer_ids) == CONTEXT
    assert answer_ids == tokenizer(completion, add_special_tokens=False)["input_ids"]  # the answer whole
    whole = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    assert len(whole) > 10 * CONTEXT  # the attack: thousands of tokens
    assert prompt_ids[0] == tokenizer.bos_token_id == whole[0]
    assert prompt_ids[1:] == whole[len(whole) - (len(prompt_ids) - 1) :]  # the tokens next to the answer
    assert counting.longest <= bound.chars < LONG  # the rest was never tokenized


def test_a_probe_within_the_bound_encodes_exactly_as_without_it(tokenizer: Any, bound: ProbeBound) -> None:
    probe = TextProbe(words(60, seed=3), " Quillmoor")
    assert encode_probe(tokenizer, probe, bound=bound) == encode_probe(tokenizer, probe)
    assert not encoded(tokenizer, probe, bound=bound).cut


@pytest.mark.parametrize("chars", [LONG, 600])  # past the character budget, and within it but past 128 tokens
def test_an_answer_past_the_bound_is_refused_naming_the_setting(tokenizer: Any, bound: ProbeBound, chars: int) -> None:
    counting = CountingTokenizer(tokenizer)
    with pytest.raises(ProbeTooLong, match=r"max_position_embeddings 128 \(ENGRAM_MAX_LENGTH is 512\)") as refused:
        encoded(counting, TextProbe("Where was Ada born?", words(chars)), bound=bound)  # type: ignore[arg-type]
    assert str(refused.value).endswith("shorten the answer: the model reads no more")
    assert counting.longest <= bound.chars  # a 20k answer is refused untokenized


def test_a_chat_probe_keeps_its_scored_turn_and_the_tokens_before_it(tokenizer: Any, bound: ProbeBound) -> None:
    messages = [
        {"role": "system", "content": words(LONG, seed=1)},
        {"role": "user", "content": words(LONG, seed=2)},
        {"role": "assistant", "content": " Quillmoor"},
    ]
    counting = CountingTokenizer(tokenizer)
    probe = encoded(counting, TextProbe(messages=messages), InProcess(), bound)  # type: ignore[arg-type]
    assert probe.ids is not None and probe.cut
    prompt_ids, answer_ids = probe.ids
    whole_prompt, whole_answer = last_turn(tokenizer, [Message(m["role"], m["content"]) for m in messages])
    assert answer_ids == whole_answer  # the turn and its end-of-turn token, whole
    assert len(prompt_ids) + len(answer_ids) == CONTEXT
    assert prompt_ids[0] == tokenizer.bos_token_id  # the template's BOS kept
    assert prompt_ids[1:] == whole_prompt[len(whole_prompt) - (len(prompt_ids) - 1) :]
    assert counting.longest <= 2 * bound.chars + 100  # a render's tail (prompt + turn), not 40k characters


def test_tofu_answers_share_one_cut_and_a_long_one_is_refused_by_its_field(tokenizer: Any, bound: ProbeBound) -> None:
    probe = TextProbe(words(LONG), " Quillmoor")
    wrong = (" Vrymfyx", " the small town of Koudro")
    item = encoded_tofu(tokenizer, TofuProbe(probe, " the town of Quillmoor", wrong), None, bound)
    assert item.ids is not None and item.cut and len(item.ids) == 4
    prompts = {tuple(prompt_ids) for prompt_ids, _ in item.ids}
    assert len(prompts) == 1  # every answer scored after the same context
    longest = max(len(answer_ids) for _, answer_ids in item.ids)
    assert len(next(iter(prompts))) + longest == CONTEXT
    with pytest.raises(AnswerRefused, match="ENGRAM_MAX_LENGTH") as refused:
        encoded_tofu(tokenizer, TofuProbe(probe, " Quillmoor", (" Vrymfyx", words(LONG))), None, bound)
    assert refused.value.where == ".perturbed_answers[1]"
    assert isinstance(refused.value.error, ProbeTooLong)


def test_batches_hold_at_most_the_padded_tokens_asked_for() -> None:
    lengths = [10, 12, 100, 30, 30, 30, 500, 5]
    groups = token_batches(lengths, 128, batch_size=16)
    assert [list(g) for g in groups] == [[0, 1], [2], [3, 4, 5], [6], [7]]
    assert all(len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 128 for g in groups)
    assert [len(g) for g in token_batches([4] * 40, 10_000, batch_size=16)] == [16, 16, 8]
