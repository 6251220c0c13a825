"""``module_strengths``: a per-module-type factor on the edit strength, through the real job bodies.

A layer whose name ends with a listed suffix is edited with ``c_k · f_l · s`` (the longest matching
suffix wins), others with ``c_k · f_l``. Held to tests/engine/test_compose.py's bars against the
float64 formula, as tests/variants/test_variant_build.py holds the variants without it.
"""

from __future__ import annotations

from typing import Any

import pytest

from service.engine.layers import module_strength, with_module_strengths
from service.errors import InvalidInput
from service.variants.service import submit_variant
from tests.helpers.algebra import WEIGHT_TOL
from tests.helpers.store_world import StoreWorld
from tests.helpers.variants import ALPHA, assert_matches, build, manifest_of, reference_edit
from tests.helpers.variants import world as world  # noqa: PLC0414  (the shared module-scoped fixture)

STRENGTHS = {"q_proj": 2.0, "mlp.gate_proj": 0.25, "gate_proj": 3.0, "down_proj": 0.5}


def test_the_longest_matching_suffix_gives_a_layers_factor() -> None:
    assert module_strength("model.layers.0.mlp.gate_proj", STRENGTHS) == 0.25  # not gate_proj's 3.0
    assert module_strength("model.layers.1.self_attn.q_proj", STRENGTHS) == 2.0
    assert module_strength("model.layers.1.self_attn.k_proj", STRENGTHS) == 1.0
    assert module_strength("model.layers.1.self_attn.xq_proj", STRENGTHS) == 1.0  # a suffix is a whole segment
    assert module_strength("lm_head", None) == 1.0
    assert with_module_strengths({"a.q_proj": 0.5, "a.v_proj": 0.7}, {"q_proj": 2.0}) == {"a.q_proj": 1.0, "a.v_proj": 0.7}


@pytest.mark.parametrize("scaling", ["uniform", "weight_norm"])
def test_a_variant_with_strengths_equals_the_float64_formula(world: dict[str, Any], scaling: str) -> None:
    """``W + Σ_k c_k · f_l · s_l · E_k``: W-Norm's f_l first, then the module's factor."""
    w: StoreWorld = world["world"]
    terms = {"forget": -ALPHA}
    variant = build(w, "v/llama", terms, reference=["forget", "retain"], scaling=scaling, module_strengths=STRENGTHS)
    assert variant.module_strengths == dict(sorted(STRENGTHS.items()))
    engrams, scales = reference_edit(world, "v/llama", terms, ["forget", "retain"], scaling)
    expected = {n: scales[n] * module_strength(n, STRENGTHS) * e for n, e in engrams.items()}
    assert any(module_strength(n, STRENGTHS) != 1.0 for n in expected), "the fixture has layers the strengths reach"
    assert_matches(world, "v/llama", variant, expected, WEIGHT_TOL)
    written = manifest_of(w, variant)["scales"]
    assert written == pytest.approx({n: scales[n] * module_strength(n, STRENGTHS) for n in scales}, rel=1e-6)


def test_strengths_of_one_leave_the_variant_as_it_was(world: dict[str, Any]) -> None:
    w: StoreWorld = world["world"]
    plain = build(w, "v/llama", {"forget": -ALPHA}, reference=["forget", "retain"])
    ones = build(w, "v/llama", {"forget": -ALPHA}, reference=["forget", "retain"], module_strengths={"q_proj": 1.0})
    other = build(w, "v/llama", {"forget": -ALPHA}, reference=["forget", "retain"], module_strengths={"q_proj": 1.5})
    assert ones.variant_id == plain.variant_id and ones.module_strengths is None
    assert other.variant_id != plain.variant_id


def test_a_suffix_matching_no_edited_layer_is_refused_by_name(world: dict[str, Any]) -> None:
    w: StoreWorld = world["world"]
    variants_before = set(w.ctx.storage.list("variants/"))
    options = {"scaling": "uniform", "format": "checkpoint", "reference": ["forget", "retain"]}
    with pytest.raises(InvalidInput, match="module_strengths: suffix.*q_prj"):
        submit_variant(w.ctx, "v/llama", {"forget": -ALPHA}, None, {**options, "module_strengths": {"q_prj": 2.0}})
    # gate_proj exists, but not among the edited layers of this selection
    with pytest.raises(InvalidInput, match="gate_proj"):
        submit_variant(
            w.ctx,
            "v/llama",
            {"forget": -ALPHA},
            None,
            {**options, "modules": ["q_proj"], "module_strengths": {"gate_proj": 2.0}},
        )
    assert not w.pending and set(w.ctx.storage.list("variants/")) == variants_before, "a refusal changes nothing"


@pytest.mark.parametrize("value", [0.0, -1.0, 4.5, float("nan"), float("inf")])
def test_a_strength_outside_zero_to_four_is_refused_on_the_wire(value: float) -> None:
    from pydantic import ValidationError

    from api_schemas import UnlearnRequest

    with pytest.raises(ValidationError, match="module_strengths"):
        UnlearnRequest.model_validate({"concepts": ["forget"], "module_strengths": {"q_proj": value}})
    assert UnlearnRequest.model_validate({"concepts": ["forget"], "module_strengths": {"q_proj": 4.0}})
