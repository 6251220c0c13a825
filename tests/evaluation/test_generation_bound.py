"""A generation's prompt is bounded by what the model reads (service/evaluation/generation.py; issue 35, finding 5).

With the fixtures' byte-level BPE tokenizer (and its chat template) and a model context of 128
positions: a prompt of 19,990 characters, as text or as messages, keeps its BOS and its last tokens,
``context − max_new_tokens`` in all, and only its tail is tokenized; ``max_new_tokens`` that leaves
no position for a prompt is refused naming the context.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from engram_fixtures.models import CHAT_TEMPLATE, make_tokenizer
from service.engine.chat import InProcess, generation_prompt
from service.engine.messages import Message
from service.engine.probe_bound import probe_bound
from service.errors import JobFailed
from service.evaluation.generation import bounded_prompt, prompt_room
from tests.helpers.long_text import CountingTokenizer, words

CONFIG = SimpleNamespace(max_position_embeddings=128)
LONG = 19_990


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_a_19990_character_prompt_keeps_its_bos_and_last_tokens(tokenizer: Any) -> None:
    bound = probe_bound(tokenizer, CONFIG, 512)
    room = prompt_room(bound, CONFIG, max_new_tokens=8)
    assert room == 120  # the context less the tokens generated
    prompt = words(LONG, seed=1)
    counting = CountingTokenizer(tokenizer)
    ids, truncated = bounded_prompt(counting, room, bound, prompt=prompt)
    whole = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    assert truncated and len(ids) == room
    assert ids[0] == tokenizer.bos_token_id and ids[1:] == whole[len(whole) - (room - 1) :]
    assert counting.longest <= bound.chars < LONG
    short, cut = bounded_prompt(tokenizer, room, bound, prompt="Where was Ada born?")
    assert (short, cut) == (tokenizer("Where was Ada born?", add_special_tokens=True)["input_ids"], False)


def test_messages_of_19990_characters_keep_the_generation_prompt_and_the_last_tokens(tokenizer: Any) -> None:
    bound = probe_bound(tokenizer, CONFIG, 512)
    room = prompt_room(bound, CONFIG, max_new_tokens=8)
    messages = [Message("system", words(LONG, seed=2)), Message("user", words(LONG, seed=3))]
    counting = CountingTokenizer(tokenizer)
    ids, truncated = bounded_prompt(counting, room, bound, messages=messages, renderer=InProcess())
    whole = generation_prompt(tokenizer, messages)
    assert truncated and len(ids) == room
    assert ids[0] == tokenizer.bos_token_id and ids[1:] == whole[len(whole) - (room - 1) :]
    assert tokenizer.decode(ids[-20:]).endswith("<|assistant|>\n")  # the generation prompt, last
    assert counting.longest <= bound.chars + 100


def test_max_new_tokens_that_leaves_no_prompt_is_refused_naming_the_context(tokenizer: Any) -> None:
    bound = probe_bound(tokenizer, CONFIG, 512)
    with pytest.raises(JobFailed, match=r"max_new_tokens 128 leaves no room .* context of 128 tokens.*at most 127"):
        prompt_room(bound, CONFIG, max_new_tokens=128)
    unstated = SimpleNamespace()  # a config that states no context: the setting alone
    assert prompt_room(probe_bound(tokenizer, unstated, 512), unstated, max_new_tokens=1024) == 512
