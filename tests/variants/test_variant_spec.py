"""The typed variant options: IDs as every earlier version gave them, the stored request both ways.

The pinned IDs (tests/helpers/variant_requests.py) were computed by
``service.variants.service._variant_request`` as it stood before the options were typed (commit
5aefde7), from the options as submit_variant normalised them: a stored variant keeps its ID only
while these stay equal.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from api_schemas import ComposeRequest, EditOptions, UnlearnRequest
from service.engine.errors import EditError
from service.errors import InvalidInput
from service.models.stored import FORMAT_VERSION, UnmigratedRecord
from service.variants.service import edit_options
from service.variants.spec import VariantRequest, VariantSpec
from tests.helpers.variant_requests import CASES, COMPOSE, MODEL, PINNED, UNIVERSE_ID, UNLEARN, stats, universe


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
