"""An evaluate attack's thresholds (issue 37): refused where they cannot apply, naming the fix; and a
calibration's attack constraint takes its bound itself, not the attack's thresholds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api_schemas import CalibrateRequest, EvaluateRequest
from api_schemas.attacks import AttackThreshold
from api_schemas.evaluation import ProbeSummary, Split
from service.evaluation.attacks import passed_thresholds

PAIR = {"prompt": "Q: a? A:", "completion": " b"}


@pytest.mark.parametrize(
    ("attack", "mention"),
    [
        ({"kind": "quantize", "type": "Q4_1", "thresholds": [{"metric": "recovered_fraction", "max": 0.3}]}, "relearn's"),
        ({"kind": "relearn", "thresholds": [{"metric": "forget_exact_match"}]}, "no bound"),
        ({"kind": "relearn", "thresholds": [{"metric": "forget_exact_match", "min": 0.5, "max": 0.2}]}, "above max"),
        ({"kind": "relearn", "thresholds": []}, "at least 1"),
    ],
)
def test_a_threshold_that_cannot_apply_is_refused(attack: dict[str, object], mention: str) -> None:
    with pytest.raises(ValidationError, match=mention):
        EvaluateRequest.model_validate({"forget": [PAIR] * 4, "retain": [PAIR], "attacks": [attack]})


def test_a_calibration_bounds_the_metric_in_the_constraint_not_in_the_attack() -> None:
    attack = {"kind": "quantize", "type": "Q4_1", "thresholds": [{"metric": "forget_exact_match", "max": 0.2}]}
    body = {"concepts": ["c"], "forget": [PAIR] * 4, "retain": [PAIR] * 4}
    constraint = {"attack": attack, "metric": "forget_exact_match", "max": 0.2}
    with pytest.raises(ValidationError, match="thresholds are evaluate's"):
        CalibrateRequest.model_validate({**body, "attack_constraints": [constraint]})


def test_passed_needs_every_bound_met_and_a_measured_value() -> None:
    variant: dict[Split, ProbeSummary] = {"forget": ProbeSummary(mean_nll=1.5, exact_match=0.25, n=4)}
    met = [AttackThreshold(metric="forget_exact_match", max=0.25), AttackThreshold(metric="forget_mean_nll", min=1.0)]
    assert passed_thresholds(met, variant, None) == {
        "passed": True,
        "margins": {"max_forget_exact_match": 0.0, "min_forget_mean_nll": 0.5},
    }
    assert passed_thresholds([AttackThreshold(metric="forget_exact_match", max=0.2)], variant, None)["passed"] is False
    unmeasured = [AttackThreshold(metric="recovered_fraction", max=0.3)]  # relearn left it out: nothing forgotten
    assert passed_thresholds(unmeasured, variant, None) == {"passed": False, "margins": {}}
    assert passed_thresholds(unmeasured, variant, -0.5) == {"passed": True, "margins": {"max_recovered_fraction": 0.8}}
