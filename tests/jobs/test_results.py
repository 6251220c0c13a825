"""A job's result as its body returns it (``service.jobs.results``) and as the runner stores it
(``service.execution.runner.stored_result``): the kind's model, dumped once with the fields the
body set.

The stored JSON is what the bodies stored when they returned the JSON object themselves: each case
below is such an object, spelled as the body built it before (the same keys, in the same order, with
the same JSON types), and the stored form must be the same bytes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from api_schemas.evaluation import GeneratedText, GenerationResult
from service.execution.kinds import KINDS
from service.execution.runner import stored_result
from service.jobs.results import RESULTS, CollectResult, MapResult, RegisterResult, UniverseResult, VariantResult

pytestmark = pytest.mark.fast

REPORT = {
    "records": 3,
    "truncated": {"max_length": 64, "records": 1, "tokens": 12, "first": [2]},
    "uncounted": {"records": 0, "first": []},
}
# What each body returned before it returned its model (the variant body still returns it).
OLD_BODY_JSON: dict[str, list[dict[str, Any]]] = {
    "collect": [
        {"tokens": 118, "stats": "stats/m/c/abc/", "reused": False, "seconds": 1.234, **REPORT},
        {"tokens": 118, "stats": "stats/m/c/abc/", "reused": True, **REPORT},
        {"tokens": 118, "stats": "stats/m/c/abc/", "reused": True},  # statistics from before the report
    ],
    "variant": [
        {"variant_id": "v" * 16, "reused": True},
        {
            "variant_id": "v" * 16,
            "reused": False,
            "layers": 4,
            "seconds": 0.5,
            "universe_built_s": None,
            "steps": {"request": 0.01, "upload": 0.2, "manifest": 0.003},
        },
        {"variant_id": "v" * 16, "reused": False, "layers": 4, "seconds": 2.0, "universe_built_s": 1.25, "steps": {}},
    ],
    "universe": [{"universe_id": "u" * 16, "reused": False, "bytes": 4096, "seconds": {"groups": 0.5, "eigh": 1.0}}],
    "map": [{"map_id": "m" * 16, "model_id": "t/llama", "concepts": ["a", "b"], "reused": True}],
    "register": [{"model_id": "t/llama", "digest": "d" * 64, "created": False}],
}


def stored_bytes(kind: str, returned: Any) -> str:
    return json.dumps(stored_result(KINDS[kind], kind, returned))  # type: ignore[index]


@pytest.mark.parametrize(("kind", "case"), [(k, i) for k, cases in OLD_BODY_JSON.items() for i in range(len(cases))])
def test_the_stored_result_is_the_json_the_body_returned_before(kind: str, case: int) -> None:
    old = OLD_BODY_JSON[kind][case]
    model = RESULTS[kind].model_validate(old)  # type: ignore[index]
    assert stored_bytes(kind, model) == json.dumps(old), "a model the body returns"
    assert stored_bytes(kind, old) == json.dumps(old), "the JSON object a body still returns"


def test_a_body_built_model_stores_only_the_fields_it_set() -> None:
    assert stored_result(KINDS["variant"], "variant", VariantResult(variant_id="v", reused=True)) == {
        "variant_id": "v",
        "reused": True,
    }
    universe = UniverseResult(universe_id="u", reused=True, bytes=0, seconds={})
    assert json.dumps(stored_result(KINDS["universe"], "universe", universe)) == (
        '{"universe_id": "u", "reused": true, "bytes": 0, "seconds": {}}'
    )
    made = MapResult(map_id="m", model_id="t/x", concepts=("a",), reused=False)
    assert stored_result(KINDS["map"], "map", made)["concepts"] == ["a"], "a tuple is stored as the list it was"
    # generate: messages only when they were sent (the body used to dump with exclude_unset itself)
    text = GeneratedText(text="hi", token_ids=[1, 2])
    generated = GenerationResult(variant_id="v", prompt="p", outputs={"variant": text})
    assert "messages" not in stored_result(KINDS["generate"], "generate", generated)
    with_messages = generated.model_copy(update={"messages": [{"role": "user", "content": "p"}]})
    assert stored_result(KINDS["generate"], "generate", with_messages)["messages"] == [{"role": "user", "content": "p"}]


def test_a_result_of_another_kind_or_shape_fails_naming_it() -> None:
    register = RegisterResult(model_id="t/x", digest="d", created=True)
    with pytest.raises(TypeError, match="the map job's body returned a RegisterResult, not a MapResult"):
        stored_result(KINDS["map"], "map", register)
    with pytest.raises(ValidationError, match="layers"):
        stored_result(KINDS["variant"], "variant", {"variant_id": "v", "reused": False, "layers": "four"})
    with pytest.raises(ValidationError, match="unknown"):
        stored_result(KINDS["register"], "register", {"model_id": "t/x", "digest": "d", "created": True, "unknown": 1})


def test_a_collection_reuse_keeps_a_report_key_an_older_version_stored() -> None:
    old = {"tokens": 1, "stats": "s/", "reused": True, "records": 1, "cut_records": 0}
    assert stored_result(KINDS["collect"], "collect", CollectResult.model_validate(old)) == old


def test_every_kind_names_its_result_model() -> None:
    assert {kind: k.result for kind, k in KINDS.items()} == RESULTS
