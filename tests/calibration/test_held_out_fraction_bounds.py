"""``held_out_fraction``: null is as good as left out, and a value outside (0, 1) is refused naming the
field. Found by schemathesis: ``"held_out_fraction": null`` was a 500 (the bounds of ``Field(gt=, lt=)`` on
the optional type were compared with None)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api_schemas import CalibrateRequest

pytestmark = pytest.mark.fast

BODY = {
    "concepts": ["c"],
    "forget": [{"prompt": "Q?", "completion": " a"}],
    "retain": [{"prompt": "Q?", "completion": " b"}],
}


def test_null_is_as_good_as_left_out() -> None:
    assert CalibrateRequest.model_validate({**BODY, "held_out_fraction": None}) == CalibrateRequest.model_validate(BODY)


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.1])
def test_a_fraction_outside_the_open_interval_is_refused_naming_the_field(value: float) -> None:
    with pytest.raises(ValidationError) as refused:
        CalibrateRequest.model_validate({**BODY, "held_out_fraction": value})
    [error] = refused.value.errors()
    assert error["loc"] == ("held_out_fraction",) and "between 0 and 1" in error["msg"]
