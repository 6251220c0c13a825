"""The count of a JSON body's values from its bytes (service.api.json_cost), against the decoder's."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from service.api.json_cost import check_json_values, json_values, json_values_at_most
from service.errors import PayloadTooLarge


def decoded_values(value: Any) -> int:
    """The values json.loads makes: the root, each array element, each object member's value."""
    if isinstance(value, dict):
        return 1 + sum(decoded_values(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(decoded_values(v) for v in value)
    return 1


TRICKY = [
    "1",
    '"x"',
    "[]",
    "{}",
    '[""]',
    '{"":""}',
    ' [ { } , [ ] , "" ,\n\t{ } ] ',
    '[[[[]]],[[],{}], {"x": [ ]}]',
    '{"a":"x:,[{\\"q","b":[1,2.5e-3,-3,true,false,null,"\\\\"],"c":{"d":{}}}',
    '{"records":[{"text":"a, b: [c"},{"prompt":"p","completion":"q"}],"models":["m/x"]}',
    '["\\"", "\\\\\\"", "é, ü: [", "\\u00e9,"]',
    '["\\\\", ",", "\\\\\\\\", "[", "a\\\\\\\\\\"b"]',
]


@pytest.mark.parametrize("document", TRICKY)
def test_the_count_is_the_decoders(document: str) -> None:
    body = document.encode()
    expected = decoded_values(json.loads(body))
    assert json_values(body) == expected
    assert all(json_values(body, piece) == expected for piece in (1, 2, 3, 5))  # pieces split strings and pairs
    assert json_values_at_most(body) >= expected


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice('ab,:[]{}"\\ \n\té') for _ in range(rng.randrange(6)))


def random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.choice([True, False, None, 0, -1.5e-3, 12345])
    if kind in (1, 2, 3):
        return random_text(rng)
    if kind in (4, 5):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {random_text(rng): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def test_the_count_is_the_decoders_on_random_documents() -> None:
    rng = random.Random(35)
    for _ in range(500):
        document = random_value(rng, 0)
        body = json.dumps(document, indent=rng.choice([None, 1]), ensure_ascii=rng.random() < 0.5).encode()
        expected = decoded_values(json.loads(body))
        assert json_values(body) == expected, body
        assert json_values(body, rng.randrange(1, 16)) == expected, body
        assert json_values_at_most(body) >= expected, body


def test_past_the_limit_it_is_a_413_naming_the_setting_and_what_to_send() -> None:
    body = b"[" + b"{}," * 2000 + b"{}]"
    check_json_values(body, 2002, "/concepts")  # exactly at the limit: the array and its 2,001 objects
    with pytest.raises(PayloadTooLarge) as refused:
        check_json_values(body, 2001, "/concepts")
    assert "2,002 JSON values" in str(refused.value)
    assert "ENGRAM_MAX_JSON_VALUES" in str(refused.value)
    assert "multipart JSONL 'dataset' upload" in str(refused.value)
    with pytest.raises(PayloadTooLarge, match="split the request"):
        check_json_values(body, 2001, "/models")
