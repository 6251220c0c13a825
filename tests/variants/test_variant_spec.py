"""The typed variant options: IDs as every earlier version gave them, the stored request both ways.

The pinned IDs were computed by ``service.variants.service._variant_request`` as it stood before the
options were typed (commit 5aefde7), from the options as submit_variant normalised them: a stored
variant keeps its ID only while these stay equal.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from api_schemas import ComposeRequest, EditOptions, UnlearnRequest
from service.engine.errors import EditError
from service.engine.layout import ModelLayout
from service.errors import InvalidInput
from service.models.record import ModelRecord
from service.models.stored import FORMAT_VERSION, UnmigratedRecord
from service.universes.members import EditUniverse
from service.universes.spec import Member, UniverseSpec
from service.variants.service import edit_options
from service.variants.spec import VariantRequest, VariantSpec

MODEL = ModelRecord(
    model_id="demo/tiny",
    source="file:///models/demo/tiny",
    path="/models/demo/tiny",
    digest="d" * 64,
    architecture="LlamaForCausalLM",
    num_parameters=0,
    layout=ModelLayout("LlamaForCausalLM", 0, [], {}, {}),  # the request never reads it
)
UNIVERSE_ID = "94034935b93d9f9bfe64a94de4bd9bb2"


def stats(dataset: str) -> str:
    return f"stats/{'d' * 64}/{dataset * 64}/{'s' * 64}/"


def universe(rcond: float | None = None) -> EditUniverse:
    members = (
        Member("forget", stats("a"), "a" * 64),
        Member("other", stats("b"), "b" * 64),
        Member("retain", stats("c"), "c" * 64),
    )
    spec = UniverseSpec("demo/tiny", "d" * 64, members, rcond)
    return EditUniverse(spec, {m.name: m.stats for m in members}, ["retain"])


UNLEARN = ({"forget": -1.0}, 1.0, None)
COMPOSE = ({"forget": 2.0, "other": -0.5}, None, 0.01)
CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "weight_norm_modules_layers_delta": {
        "scaling": "weight_norm",
        "modules": ["v_proj", "q_proj"],
        "layers": [2, 0],
        "format": "delta",
    },
    "peft": {"format": "peft"},
    "peft_rank": {"format": "peft", "lora_rank": 8},
    "peft_vllm": {"format": "peft", "lora_target": "vllm"},
    "peft_vllm_rank": {"format": "peft", "lora_target": "vllm", "lora_rank": 64},
    "strengths": {"module_strengths": {"v_proj": 0.5, "q_proj": 2.0, "o_proj": 1.0}},
    "strengths_all_one": {"module_strengths": {"q_proj": 1.0}},
    "peft_strengths_modules": {
        "format": "peft",
        "modules": ["mlp.down_proj"],
        "module_strengths": {"down_proj": 0.25},
        "scaling": "weight_norm",
    },
}
PINNED = {
    "defaults/unlearn": "c347123fec9faf672c0c48d8f5a45521",
    "defaults/compose": "6ee50d97f6312a21b6274aa7d4e39a61",
    "weight_norm_modules_layers_delta/unlearn": "0ee112ff8a96cadf63082705f5086d06",
    "weight_norm_modules_layers_delta/compose": "c740bacaa34868fa7acd6190839a8a26",
    "peft/unlearn": "d52ee09b85ea9a995012976d595af460",
    "peft/compose": "8285b887428745ccdbeb4e5c49ca3ca0",
    "peft_rank/unlearn": "5da35ef44399c319b3d0b49948dd1b05",
    "peft_rank/compose": "5c05a5afc33154debe8c13587bc31234",
    "peft_vllm/unlearn": "70e93ade3facf5a42ce2a3694382e09e",
    "peft_vllm/compose": "b53bb1bc19f88c3e176d17c6bb6101d5",
    "peft_vllm_rank/unlearn": "571e493a3c704e7bc1cea049c976ec1b",
    "peft_vllm_rank/compose": "c0cf4d919c079e9e11aec69118f05323",
    "strengths/unlearn": "8800a6ff2811fe7058d87f2a3e39f9de",
    "strengths/compose": "96b64c62babbb6458a193fda79d64581",
    "strengths_all_one/unlearn": "c347123fec9faf672c0c48d8f5a45521",
    "strengths_all_one/compose": "6ee50d97f6312a21b6274aa7d4e39a61",
    "peft_strengths_modules/unlearn": "b251d67ecd4d20d6c365b112897b9612",
    "peft_strengths_modules/compose": "2a748e73aadaf7e0826b4219990e15ab",
}


def request_of(
    options: dict[str, Any], kind: tuple[dict[str, float], float | None, float | None] = UNLEARN
) -> VariantRequest:
    terms, alpha, rcond = kind
    return VariantRequest.new(MODEL, terms, alpha, VariantSpec.from_options(EditOptions(**options)), universe(rcond))


@pytest.mark.parametrize("case", sorted(PINNED))
def test_variant_ids_are_the_ids_earlier_versions_gave(case: str) -> None:
    name, kind = case.split("/")
    assert request_of(CASES[name], UNLEARN if kind == "unlearn" else COMPOSE).variant_id == PINNED[case]


# What the code before the typed options stored for the case "peft_vllm_rank" (unlearn), job added.
STORED = {
    "variant_id": "571e493a3c704e7bc1cea049c976ec1b",
    "model_id": "demo/tiny",
    "terms": {"forget": -1.0},
    "alpha": 1.0,
    "reference": ["retain"],
    "scaling": "uniform",
    "modules": None,
    "layers": None,
    "format": "peft",
    "rcond": None,
    "lora_rank": 64,
    "lora_target": "vllm",
    "module_strengths": None,
    "term_stats": {"forget": stats("a"), "other": stats("b"), "retain": stats("c")},
    "universe_id": UNIVERSE_ID,
    "universe_stats": [stats("a"), stats("b"), stats("c")],
    "job_id": "job-1",
}


def test_the_stored_request_is_the_json_earlier_versions_stored() -> None:
    """The same keys in the same order, after the record's format version."""
    stored = request_of(CASES["peft_vllm_rank"]).with_job("job-1").model_dump(mode="json")
    assert stored == {"format_version": FORMAT_VERSION, **STORED}
    assert list(stored) == ["format_version", *STORED]


def test_a_stored_request_reads_back_as_it_was_written() -> None:
    for options in CASES.values():
        for kind in (UNLEARN, COMPOSE):
            request = request_of(options, kind).with_job("job-2")
            stored = json.loads(json.dumps(request.model_dump(mode="json")))
            assert VariantRequest.stored("variants/x/request.json", stored) == request


def test_strengths_are_stored_sorted_without_their_ones() -> None:
    stored = request_of(CASES["strengths"]).model_dump(mode="json")
    assert list(stored["module_strengths"].items()) == [("q_proj", 2.0), ("v_proj", 0.5)]
    assert request_of(CASES["strengths_all_one"]).model_dump(mode="json")["module_strengths"] is None


# A request as the first versions stored it: no format_version, lora_rank, lora_target,
# module_strengths or universe_id (tests/variants/test_migrate.py migrates one).
OLDEST = {
    "variant_id": "0123456789abcdef0123456789abcdef",
    "model_id": "demo/tiny",
    "terms": {"forget": -1.0},
    "alpha": 1.0,
    "reference": ["retain"],
    "scaling": "weight_norm",
    "modules": ["q_proj"],
    "layers": None,
    "rcond": 0.001,
    "format": "peft",
    "term_stats": {"forget": stats("a")},
    "universe_stats": [stats("a"), stats("c")],
    "job_id": "job-0",
}


def test_a_request_stored_before_the_format_version_is_refused_naming_the_migration() -> None:
    with pytest.raises(UnmigratedRecord, match="variant request variants/x/request.json .*engram-service migrate"):
        VariantRequest.stored("variants/x/request.json", OLDEST)


def test_lora_target_belongs_to_peft_variants_only() -> None:
    assert VariantSpec.from_options(EditOptions(format="delta")).lora_target is None
    assert VariantSpec.from_options(EditOptions(format="peft")).lora_target == "peft"
    assert VariantSpec.from_options(EditOptions(format="peft", lora_target="vllm")).adapter_target == "vllm"


def test_an_unknown_stored_lora_target_fails_the_build_by_name() -> None:
    with pytest.raises(EditError, match="unknown lora_target 'tgi'"):
        _ = VariantSpec(format="peft", lora_target="tgi").adapter_target


def test_modules_and_layers_keep_the_request_order() -> None:
    spec = VariantSpec.from_options(EditOptions(modules=["v_proj", "q_proj"], layers=[2, 0]))
    assert (spec.modules, spec.layers) == (("v_proj", "q_proj"), (2, 0))


def test_the_spec_reads_unlearn_and_compose_requests_alike() -> None:
    options = {"scaling": "weight_norm", "format": "peft", "lora_rank": 8, "module_strengths": {"q_proj": 0.5}}
    unlearn = VariantSpec.from_options(UnlearnRequest(concepts=["forget"], **options))
    compose = VariantSpec.from_options(ComposeRequest(terms={"forget": -1.0}, **options))
    assert unlearn == compose == VariantSpec.from_options(EditOptions(**options))


def test_edit_options_given_as_fields_are_validated_as_the_wire_validates_them() -> None:
    assert edit_options({"format": "peft"}) == EditOptions(format="peft")
    request = UnlearnRequest(concepts=["forget"], format="delta")
    assert edit_options(request) is request
    with pytest.raises(InvalidInput, match=r"scaling: Input should be 'uniform' or 'weight_norm'"):
        edit_options({"scaling": "cubic"})
    with pytest.raises(InvalidInput, match="lora_rank 24 is not a rank vLLM serves"):
        edit_options({"format": "peft", "lora_target": "vllm", "lora_rank": 24})
