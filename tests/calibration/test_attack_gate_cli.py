"""``engram calibrate --attack-constraint`` (issue 37): the written constraint is the request's
``attack_constraints`` entry, which the schema accepts; a malformed one is a usage error naming the form."""

from __future__ import annotations

import pytest
import typer

from api_schemas import CalibrateRequest
from engram_client.cli.calibration import _attack_constraints

PAIR = {"prompt": "Q: a? A:", "completion": " b"}


def test_an_attack_constraint_is_the_attack_then_a_bound() -> None:
    written = ["quantize:Q4_1 forget_exact_match<=0.2", "relearn:steps=4,lr=5e-4 recovered_fraction<=0.3"]
    parsed = _attack_constraints(written)
    assert parsed == [
        {"attack": {"kind": "quantize", "type": "Q4_1"}, "metric": "forget_exact_match", "max": 0.2},
        {"attack": {"kind": "relearn", "steps": 4, "lr": 5e-4}, "metric": "recovered_fraction", "max": 0.3},
    ]
    body = {"concepts": ["c"], "forget": [PAIR] * 4, "retain": [PAIR] * 4, "attack_constraints": parsed}
    request = CalibrateRequest.model_validate(body)
    assert [c.attack_name for c in request.attack_constraints] == ["quantize:Q4_1", "relearn"]
    assert _attack_constraints(["quantize:Q4_1 retain_exact_match>=0.9x"]) == [
        {"attack": {"kind": "quantize", "type": "Q4_1"}, "metric": "retain_exact_match", "min_ratio_to_base": 0.9}
    ]
    assert _attack_constraints(None) is None


@pytest.mark.parametrize(
    ("written", "mention"),
    [("forget_exact_match<=0.2", "ATTACK METRIC<=V"), ("quantize:Q4_1 forget_exact_match=0.2", "metric>=value"),
     ("squash forget_exact_match<=0.2", "an attack is")],
)  # fmt: skip
def test_a_malformed_attack_constraint_is_a_usage_error(written: str, mention: str) -> None:
    with pytest.raises(typer.BadParameter, match=mention):
        _attack_constraints([written])
