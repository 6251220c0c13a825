"""The typed calibration request: IDs as earlier versions gave them, the stored JSON both ways.

The pinned IDs were computed by ``service.calibration.service._request`` as it stood before the
request was typed (commit a12dd1f; this file's first version called it), from the request as the
route handed it on (probes without nulls, concepts without repeats): a stored calibration keeps its
ID only while these stay equal.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from api_schemas import CalibrateRequest
from service.calibration.goal import goal_spec
from service.calibration.records import MalformedCalibration, read_calibration_result
from service.calibration.request import (
    CalibrationRequest,
    has_messages,
    one_term_each,
    probes_digest,
    stored_probes,
)
from service.calibration.service import request_space
from service.engine.layers import LayerSpec
from service.engine.layout import ModelLayout
from service.models.record import ModelRecord
from service.universes.members import EditUniverse
from service.universes.spec import Member, UniverseSpec

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MODULES += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LAYERS = [LayerSpec(f"model.layers.{b}.{m}", 32, 32, False, False, b) for b in (0, 1) for m in MODULES]
LAYOUT = ModelLayout("LlamaForCausalLM", 1, [*LAYERS, LayerSpec("lm_head", 32, 64, False, False, None)], {}, {})
MODEL = ModelRecord(
    model_id="demo/tiny",
    source="file:///models/demo/tiny",
    path="/models/demo/tiny",
    digest="d" * 64,
    architecture=LAYOUT.architecture,
    num_parameters=LAYOUT.num_parameters,
    layout=LAYOUT,
)


def stats(dataset: str) -> str:
    return f"stats/{'d' * 64}/{dataset * 64}/{'s' * 64}/"


MEMBERS = (Member("forget", stats("a"), "a" * 64), Member("other", stats("b"), "b" * 64))
MEMBERS += (Member("retain", stats("c"), "c" * 64),)
UNIVERSE = EditUniverse(UniverseSpec("demo/tiny", "d" * 64, MEMBERS, None), {m.name: m.stats for m in MEMBERS}, ["retain"])

PAIRS = [{"prompt": "Q: a? A:", "completion": " b"}, {"prompt": "Q: c? A:", "completion": " d"}]
CHAT = [{"messages": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Me."}]}]
CASES: dict[str, dict[str, Any]] = {
    "defaults": {"concepts": ["forget"], "forget": PAIRS[:1], "retain": PAIRS[1:]},
    "module_sets": {
        "concepts": ["forget", "other", "forget"],
        "forget": PAIRS[:1],
        "retain": PAIRS,
        "module_sets": ["qk_gate", ["v_proj", "o_proj", "v_proj"], "data_weighted"],
        "scalings": ["weight_norm"],
        "budget": 12,
        "alpha_min": 0.1,
        "alpha_max": 2,
        "max_retain_nll_ratio": 1.5,
    },
    "layer_sets_delta": {
        "concepts": ["forget"],
        "forget": PAIRS[:1],
        "retain": PAIRS[1:],
        "module_sets": ["mlp"],
        "layer_sets": [[1, 0], [1]],
        "format": "delta",
    },
    "peft_vllm_messages": {
        "concepts": ["forget"],
        "forget": CHAT,
        "retain": PAIRS,
        "module_sets": ["attention"],
        "format": "peft",
        "lora_target": "vllm",
        "lora_rank": 16,
    },
    "peft": {"concepts": ["forget"], "forget": PAIRS[:1], "retain": PAIRS[1:], "module_sets": ["all"], "format": "peft"},
}
PINNED = {
    "defaults": "3088f179793ccc84801f5b3286264e7b",
    "module_sets": "e8b2cd68db8136c6aa2e4aba6e073907",
    "layer_sets_delta": "50c041de2930d09b735f7cfe70016426",
    "peft_vllm_messages": "e9f382572e75b11802c9bf1394814b10",
    "peft": "fa70cdaef8dedd09109cb26ac918e9c1",
}


def request_of(case: str) -> CalibrationRequest:
    """The request ``submit_calibration`` stores for ``CASES[case]`` (without its job)."""
    options = one_term_each(CalibrateRequest(**CASES[case]))
    space = request_space(LAYOUT, options)
    return CalibrationRequest.new(MODEL, options, UNIVERSE, space, probes_digest(stored_probes(options)))


@pytest.mark.parametrize("case", sorted(PINNED))
def test_calibration_ids_are_the_ids_earlier_versions_gave(case: str) -> None:
    assert request_of(case).calibration_id == PINNED[case]


# What the code before the typed request stored for the case "module_sets", job added.
STORED: dict[str, Any] = {
    "calibration_id": "e8b2cd68db8136c6aa2e4aba6e073907",
    "model_id": "demo/tiny",
    "concepts": ["forget", "other"],
    "term_stats": {"forget": stats("a"), "other": stats("b")},
    "universe_id": "94034935b93d9f9bfe64a94de4bd9bb2",
    "reference": ["retain"],
    "probes_digest": "e0c3adff0b9f3fff09e58ecce00a0a7889ec3b3681428f4d6fc2be09edb44ab5",
    "search": {
        "max_retain_nll_ratio": 1.5,
        "budget": 12,
        "alpha_min": 0.1,
        "alpha_max": 2.0,
        "arms": [
            {
                "module_set": "qk_gate",
                "modules": ["self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj"],
                "layers": None,
                "scaling": "weight_norm",
                "weighted": False,
            },
            {
                "module_set": "v_proj+o_proj",
                "modules": ["v_proj", "o_proj"],
                "layers": None,
                "scaling": "weight_norm",
                "weighted": False,
            },
            {"module_set": "data_weighted", "modules": None, "layers": None, "scaling": "weight_norm", "weighted": True},
        ],
    },
    "skipped_module_sets": [],
    "variant": {"format": "checkpoint", "lora_rank": None, "lora_target": "peft"},
    "job_id": "job-1",
}


def test_the_stored_request_is_the_json_earlier_versions_stored() -> None:
    stored = request_of("module_sets").with_job("job-1").to_json()
    assert json.dumps(stored) == json.dumps(STORED)  # key for key, in order, floats as floats


def test_a_stored_request_reads_back_as_it_was_written() -> None:
    for case in CASES:
        request = request_of(case).with_job("job-2")
        assert CalibrationRequest.from_json(json.loads(json.dumps(request.to_json()))) == request


def test_the_job_reads_the_arms_and_the_variant_format_the_request_named() -> None:
    request = CalibrationRequest.from_json(STORED)
    assert [arm.name for arm in request.search.arms] == [
        "qk_gate/weight_norm",
        "v_proj+o_proj/weight_norm",
        "data_weighted/weight_norm",
    ]
    assert [arm.weighted for arm in request.search.arms] == [False, False, True]
    assert request.term_prefixes == [stats("a"), stats("b")]
    settings = request.search.settings()
    assert (settings.limit, settings.budget, settings.alpha_min, settings.alpha_max) == (1.5, 12, 0.1, 2.0)
    assert settings.alpha_start == 1.0  # the paper's α = 1 first, inside the range
    vllm = request_of("peft_vllm_messages").variant
    assert (vllm.format, vllm.lora_rank, vllm.lora_target) == ("peft", 16, "vllm")


def test_alpha_starts_at_the_nearest_end_of_a_range_without_one() -> None:
    low = request_of("defaults").search
    assert low.settings().alpha_start == 1.0
    options = CalibrateRequest(**{**CASES["defaults"], "alpha_min": 1.5, "alpha_max": 3.0})
    above = CalibrationRequest.new(MODEL, options, UNIVERSE, request_space(LAYOUT, options), "0" * 64).search
    assert above.settings().alpha_start == 1.5


def test_probes_are_stored_without_their_nulls_and_conversations_are_noticed() -> None:
    options = CalibrateRequest(**CASES["peft_vllm_messages"])
    assert json.loads(stored_probes(options)) == {"forget": CHAT, "retain": PAIRS}
    assert has_messages(options) and not has_messages(CalibrateRequest(**CASES["defaults"]))


def test_a_request_stored_before_data_weighted_reads_with_unweighted_arms() -> None:
    arms = [{k: v for k, v in arm.items() if k != "weighted"} for arm in STORED["search"]["arms"]]
    older = CalibrationRequest.from_json({**STORED, "search": {**STORED["search"], "arms": arms}})
    assert [arm.weighted for arm in older.search.arms] == [False, False, False]
    assert older.calibration_id == STORED["calibration_id"] and older.job_id == "job-1"


def test_a_stored_request_that_does_not_fit_is_refused_naming_the_calibration_and_the_field() -> None:
    broken = {**STORED, "search": {**STORED["search"], "budget": "many"}}
    with pytest.raises(MalformedCalibration, match=r"e8b2cd68db8136c6aa2e4aba6e073907.*search\.budget"):
        CalibrationRequest.from_json(broken, STORED["calibration_id"])
    with pytest.raises(MalformedCalibration, match="it names calibration e8b2"):
        CalibrationRequest.from_json(STORED, "f" * 32)
    with pytest.raises(MalformedCalibration, match="not an object"):
        read_calibration_result("f" * 32, [1, 2])


def test_an_objective_is_stored_and_named_by_the_id_and_a_request_without_one_is_not_changed() -> None:
    plain = CASES["module_sets"]
    goal = {
        **plain,
        "forget": [{**p, "paraphrased_answer": "x", "perturbed_answers": ["y"]} for p in plain["forget"] * 2],
        "retain": plain["retain"] * 2,
        "objective": {"maximize": "model_utility"},
        "constraints": [{"metric": "retain_nll_ratio", "max": 2.0}],
        "held_out_fraction": 0.5,
    }
    options = CalibrateRequest(**goal)
    space = request_space(LAYOUT, options)
    spec = goal_spec(options, None)
    request = CalibrationRequest.new(MODEL, options, UNIVERSE, space, probes_digest(stored_probes(options)), spec)
    assert request.calibration_id != PINNED["module_sets"]
    stored = json.loads(json.dumps(request.with_job("j").to_json()))
    assert stored["goal"]["objective"] == "model_utility" and stored["goal"]["held_out_fraction"] == 0.5
    assert CalibrationRequest.from_json(stored) == request.with_job("j")
    assert "goal" not in request_of("module_sets").to_json()
    assert set(json.loads(stored_probes(options))) == {"forget", "retain", "holdout", "utility"}


def test_an_arm_s_measured_strengths_are_not_stored_and_an_unknown_arm_key_is_refused() -> None:
    request = request_of("module_sets").with_job("job-1")
    weighted = dataclasses.replace(request.search.arms[2], strengths=(("q_proj", 0.5),))
    measured = request.model_copy(
        update={"search": request.search.model_copy(update={"arms": (*request.search.arms[:2], weighted)})}
    )
    assert json.dumps(measured.to_json()) == json.dumps(STORED)  # the job's measured strengths never reach request.json
    arms = [{**STORED["search"]["arms"][0], "strengths": []}, *STORED["search"]["arms"][1:]]
    with pytest.raises(MalformedCalibration, match=r"search\.arms: .*arm 0 stores strengths"):
        CalibrationRequest.from_json({**STORED, "search": {**STORED["search"], "arms": arms}})
    arms = [{**STORED["search"]["arms"][0], "suffixes": ["q_proj"]}, *STORED["search"]["arms"][1:]]
    with pytest.raises(MalformedCalibration, match=r"search\.arms\.0\.suffixes"):
        CalibrationRequest.from_json({**STORED, "search": {**STORED["search"], "arms": arms}})


IMAGE = "iVBORw0KGgo="


@pytest.mark.parametrize(
    ("changes", "sets"),
    [
        ({}, {"forget": PAIRS, "retain": PAIRS}),
        (
            {"objective": {"maximize": "model_utility"}, "holdout": PAIRS[:1], "utility": {"ra": PAIRS}},
            {"forget": PAIRS, "retain": PAIRS, "holdout": PAIRS[:1], "utility": {"ra": PAIRS}},
        ),
        (
            {
                "forget": [{"image": IMAGE, "label": 1}],
                "retain": [{"image": IMAGE, "label": "cat"}],
                "test": [{"image": IMAGE, "label": 0}],
            },
            {
                "forget": [{"image": IMAGE, "label": 1}],
                "retain": [{"image": IMAGE, "label": "cat"}],
                "test": [{"image": IMAGE, "label": 0}],
            },
        ),
    ],
)
def test_stored_probes_are_the_bytes_of_the_sets_the_request_set(changes: dict[str, Any], sets: dict[str, Any]) -> None:
    """The digest names the calibration: the stored bytes are the sets as sent, keys sorted, UTF-8 as is."""
    options = CalibrateRequest(**{"concepts": ["forget"], "forget": PAIRS, "retain": PAIRS, **changes})
    assert stored_probes(options) == json.dumps(sets, sort_keys=True, ensure_ascii=False).encode()
