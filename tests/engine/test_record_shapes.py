"""Records in the wild's shapes read as canonical records (:mod:`service.engine.record_shapes`), below HTTP.

The live server's view of the same rules (inline, upload, JSONL and Parquet references, compared
token for token) is ``tests/api/test_dataset_formats.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from engram_fixtures.models import make_tokenizer
from service.datasets.parquet import _plain
from service.engine.records import Record, RecordError, encode_record

ANSWER = {"role": "assistant", "content": "yes"}


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        pytest.param(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]},
                    ANSWER,
                ]
            },
            {"messages": [{"role": "user", "content": "a\n"}, ANSWER]},
            id="parts-joined-in-order",
        ),
        pytest.param(
            {"conversations": [{"role": "user", "content": "q"}, ANSWER]},
            {"messages": [{"role": "user", "content": "q"}, ANSWER]},
            id="conversations-of-openai-turns",
        ),
        pytest.param(
            {"messages": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "yes"}]},
            {"messages": [{"role": "user", "content": "q"}, ANSWER]},
            id="sharegpt-turns-under-messages",
        ),
        pytest.param(
            {"instruction": "Do it.", "output": "done"}, {"prompt": "Do it.", "completion": "done"}, id="alpaca-no-input"
        ),
        pytest.param(
            {"instruction": "Do it.", "input": None, "output": "done"},
            {"prompt": "Do it.", "completion": "done"},
            id="alpaca-null-input",
        ),
        pytest.param(
            {"instruction": "Do it.", "input": "  ", "output": "done"},
            {"prompt": "Do it.", "completion": "done"},
            id="alpaca-blank-input",
        ),
    ],
)
def test_a_shape_is_read_as_its_canonical_record(raw: dict[str, Any], canonical: dict[str, Any]) -> None:
    assert Record.from_mapping(raw, 0).to_json() == canonical


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "x"}]},
            r"message 0: 'value' must be",
        ),
        ({"conversations": [{"from": "human", "value": "q", "weight": 0}, {"from": "gpt", "value": "x"}]}, r"\['weight'\]"),
        ({"messages": [{"role": "user", "content": []}, ANSWER]}, "empty list of content parts"),
        ({"messages": [{"role": "user", "content": [{"text": "q"}]}, ANSWER]}, "content part 0 has no 'type'"),
        ({"messages": [{"role": "user", "content": ["q"]}, ANSWER]}, "content part 0 is not a JSON object"),
        ({"messages": [{"role": "user", "content": "q", "name": ""}, ANSWER]}, "'name' must be a non-empty string"),
        (
            {"messages": [{"role": "tool", "content": "42", "tool_call_id": "1"}, ANSWER]},
            "tool-call turn \\('tool_call_id'\\)",
        ),
        ({"instruction": "x", "input": 3, "output": "y"}, "'input' must be a string"),
        ({"instruction": "x", "prompt": "p", "completion": "c"}, "exactly one of"),
    ],
)
def test_a_shape_that_cannot_be_read_is_named(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(RecordError, match=f"dataset line 9(: | )?.*{message}"):
        Record.from_mapping(raw, "dataset line 9")


def test_a_name_reaches_a_template_that_renders_it() -> None:
    tokenizer = make_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}{% if m['name'] %} {{ m['name'] }}{% endif %}|>\n"
        "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    named = Record.from_mapping({"messages": [{"role": "user", "content": "q", "name": "ada"}, ANSWER]}, 0)
    anonymous = Record.from_mapping({"messages": [{"role": "user", "content": "q"}, ANSWER]}, 0)
    with_name, without = encode_record(tokenizer, named, 512), encode_record(tokenizer, anonymous, 512)
    assert with_name.input_ids != without.input_ids
    assert sum(with_name.counted) == sum(without.counted)  # the assistant turn is the same


def test_parquet_structs_lose_their_null_fields_at_every_depth() -> None:
    row = [{"role": "user", "name": None, "content": [{"type": "text", "text": "q", "image_url": None}]}]
    assert _plain(row) == [{"role": "user", "content": [{"type": "text", "text": "q"}]}]
