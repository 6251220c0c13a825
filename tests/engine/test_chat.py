"""Chat records: validation, their canonical stored form, the counting rule and its prefix check.

The counted tokens of a conversation are, for each assistant message ``i``, those of
``render(messages[:i+1])`` beyond ``render(messages[:i], add_generation_prompt=True)``; templates
that break the prefix property are refused naming the record, never counted approximately.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from engram_fixtures.models import CHAT_TEMPLATE, make_tokenizer
from service.datasets.spool import record_line
from service.engine.chat import NoChatTemplate, encode_chat, generation_prompt, last_turn
from service.engine.evaluate import TextProbe, encode_probe
from service.engine.records import Message, Record, RecordError, encode_record

# Llama-3-like headers: special markers as text, an end-of-turn token, a default system prompt.
LLAMA3_LIKE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|system|>\nYou are helpful.</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Drops every assistant turn but the last (as reasoning templates drop past thinking).
REWRITING = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def chat(*turns: tuple[str, str]) -> tuple[Message, ...]:
    return tuple(Message(role, content) for role, content in turns)


TWO_TURNS = chat(
    ("system", "Be brief."),
    ("user", "Where was Kymthai born?"),
    ("assistant", "Papa"),
    ("user", "And Brasmym?"),
    ("assistant", " Zürich"),
)


def spans(tokenizer: Any, ids: list[int], counted: list[bool]) -> list[str]:
    """The counted runs, decoded."""
    runs, run = [], []
    for token, flag in zip(ids, counted, strict=True):
        if flag:
            run.append(token)
        elif run:
            runs.append(tokenizer.decode(run))
            run = []
    if run:
        runs.append(tokenizer.decode(run))
    return runs


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, LLAMA3_LIKE])
def test_each_assistant_turn_counts_its_content_and_its_closing_token(tokenizer: Any, template: str) -> None:
    tokenizer.chat_template = template
    try:
        ids, counted = encode_chat(tokenizer, TWO_TURNS)
        whole = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in TWO_TURNS], tokenize=True, return_dict=False
        )
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE
    assert spans(tokenizer, ids, counted) == ["Papa</s>", " Zürich</s>"]
    assert ids == whole  # the model reads the whole render, system prompt and user turns included


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, LLAMA3_LIKE])
def test_counted_tokens_are_the_papers_tofu_answer_tokens(tokenizer: Any, template: str) -> None:
    """ai-engram's TOFU benchmark (the paper's LLM experiment, on Llama-3.2-1B-Instruct) renders each
    question/answer with the chat template and a system prompt and collects only the tokens from the
    generation prompt's end on (``labels != IGNORE``): the answer and the end-of-turn token. The rule
    counts exactly those, neither fewer (the end-of-turn token stays counted) nor more (no header)."""
    from engram.benchmarks.tofu import IGNORE, SYSTEM, _preprocess

    tokenizer.chat_template = template
    try:
        for question, answer in (("Where was Kymthai born?", "Papa"), ("And Brasmym?", " Zürich, in 1970.")):
            oracle = _preprocess(tokenizer, question, answer)
            ids, counted = encode_chat(tokenizer, chat(("system", SYSTEM), ("user", question), ("assistant", answer)))
            assert ids == oracle["input_ids"]
            assert counted == [label != IGNORE for label in oracle["labels"]]
            assert spans(tokenizer, ids, counted) == [answer + "</s>"]
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE


def test_encode_record_truncates_and_renders_pairs_under_template_chat(tokenizer: Any) -> None:
    record = Record.from_mapping({"messages": [{"role": m.role, "content": m.content} for m in TWO_TURNS]}, 0)
    full = encode_record(tokenizer, record, 512)
    cut = encode_record(tokenizer, record, 20)
    assert cut.input_ids == full.input_ids[:20] and cut.counted == full.counted[:20]
    pair = Record(prompt="Q: Where? A:", completion=" Papa")
    as_chat = encode_record(tokenizer, pair, 512, template="chat")
    one_turn = encode_record(tokenizer, Record(messages=chat(("user", "Q: Where? A:"), ("assistant", " Papa"))), 512)
    assert as_chat == one_turn
    assert as_chat != encode_record(tokenizer, pair, 512)  # without the option: raw, as before
    with pytest.raises(RecordError, match="record 3: a text record"):
        encode_record(tokenizer, Record(text="plain"), 512, template="chat", index=3)


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_record(tokenizer: Any) -> None:
    tokenizer.chat_template = REWRITING
    record = Record(messages=TWO_TURNS)
    try:
        with pytest.raises(RecordError, match=r"record 7: .*prefix property.*messages\[:3\]"):
            encode_record(tokenizer, record, 512, index=7)
        # A single assistant turn is rendered consistently by it: accepted.
        ids, counted = encode_chat(tokenizer, TWO_TURNS[:3])
        assert spans(tokenizer, ids, counted) == ["Papa</s>"]
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE


def test_no_chat_template_is_said(tokenizer: Any) -> None:
    tokenizer.chat_template = None
    try:
        with pytest.raises(NoChatTemplate, match="no chat template"):
            encode_chat(tokenizer, TWO_TURNS)
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE


def test_probe_and_generation_prompt(tokenizer: Any) -> None:
    prompt_ids, answer_ids = last_turn(tokenizer, TWO_TURNS)
    ids, counted = encode_chat(tokenizer, TWO_TURNS)
    assert prompt_ids + answer_ids == ids  # the last turn's tokens end the render
    assert tokenizer.decode(answer_ids) == " Zürich</s>"
    assert generation_prompt(tokenizer, TWO_TURNS[:-1]) == prompt_ids
    probe = TextProbe(messages=[{"role": m.role, "content": m.content} for m in TWO_TURNS])
    assert encode_probe(tokenizer, probe) == (prompt_ids, answer_ids)
    # The last assistant turn is scored; what follows it is not read.
    assert last_turn(tokenizer, (*TWO_TURNS, Message("user", "Thanks!"))) == (prompt_ids, answer_ids)
    assert tokenizer.decode(last_turn(tokenizer, TWO_TURNS[:-1])[1]) == "Papa</s>"
    with pytest.raises(RecordError, match="no assistant message"):
        last_turn(tokenizer, TWO_TURNS[:2])


def test_messages_are_stored_in_their_canonical_form() -> None:
    raw = {"messages": [{"content": "Q?", "role": "user"}, {"role": "assistant", "content": "A ☃"}]}
    line = record_line(Record.from_mapping(raw, 0))
    assert line == '{"messages": [{"content": "Q?", "role": "user"}, {"content": "A ☃", "role": "assistant"}]}\n'.encode()
    assert json.loads(line) == raw


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": "hi"}, "non-empty list"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
        ({"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]}, "message 0"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}, "message 1 has role 'bot'"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}, "non-empty content"),
        (
            {"messages": [{"role": "user", "content": 1}, {"role": "assistant", "content": "y"}]},
            "'content' must be a string",
        ),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}, "no 'content'"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            r"message 0 is a tool-call turn \('tool_calls'\)",
        ),
        ({"messages": [{"role": "user", "content": "\ud800"}, {"role": "assistant", "content": "y"}]}, "lone surrogate"),
        ({"messages": [{"role": "user", "content": "x"}], "prompt": "p"}, "exactly one of"),
    ],
)
def test_bad_messages_are_named(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(RecordError, match=message):
        Record.from_mapping(raw, 4)
