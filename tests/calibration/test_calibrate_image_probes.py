"""A calibration request with image probes is refused by name at validation, not failed in its job.

Calibrate scores candidates on text probes of a causal LM (answer NLL, TOFU's metrics); an image
probe (accepted by ``Probe`` since evaluate takes them) would otherwise reach the job.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api_schemas import CalibrateRequest

pytestmark = pytest.mark.fast

TEXT = {"prompt": "Q: a? A:", "completion": " b"}
IMAGE = {"image": "iVBORw0KGgo=", "label": 0}


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"forget": [IMAGE], "retain": [TEXT]}, "forget[0] is an image probe"),
        ({"forget": [TEXT], "retain": [TEXT, IMAGE]}, "retain[1] is an image probe"),
    ],
)
def test_an_image_probe_is_refused_naming_it(body: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError) as refused:
        CalibrateRequest.model_validate({"concepts": ["c"], **body})
    assert named in str(refused.value) and "POST /variants/{variant_id}/evaluate" in str(refused.value)


def test_text_probes_are_still_a_request() -> None:
    assert CalibrateRequest.model_validate({"concepts": ["c"], "forget": [TEXT], "retain": [TEXT]}).forget[0].kind == "text"
