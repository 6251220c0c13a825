"""``engram calibrate``'s objective options: what the command sends for an objective and its bounds."""

from __future__ import annotations

import pytest
import typer

from engram_client.cli.calibration import _constraints, _objective

pytestmark = pytest.mark.fast


def test_constraints_are_absolute_or_relative_to_the_base() -> None:
    assert _constraints(["model_utility>=0.9x", "retain_nll_ratio <= 2", "privacy>=1e-1"]) == [
        {"metric": "model_utility", "min_ratio_to_base": 0.9},
        {"metric": "retain_nll_ratio", "max": 2.0},
        {"metric": "privacy", "min": 0.1},
    ]
    assert _constraints(None) is None


@pytest.mark.parametrize("bad", ["model_utility>0.9", "model_utility>=", ">=0.9", "model_utility>=high"])
def test_a_constraint_that_is_not_metric_op_number_is_refused(bad: str) -> None:
    with pytest.raises(typer.BadParameter, match="metric>=value"):
        _constraints([bad])


def test_one_objective() -> None:
    assert _objective("overall", None) == {"maximize": "overall"}
    assert _objective(None, "exact_memorization") == {"minimize": "exact_memorization"}
    assert _objective(None, None) is None
    with pytest.raises(typer.BadParameter, match="not both"):
        _objective("overall", "privacy")
