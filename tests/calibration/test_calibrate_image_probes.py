"""A calibration request's probes are of one kind, and its metrics of that kind, checked at validation.

Image probes (an image classifier's calibration, issue 25) are searched on the classifier's metrics;
text probes on answer NLL and TOFU's. Mixing kinds, or naming a metric of the other kind, is refused
naming the probe or the metric (the model's kind is checked at submission:
tests/calibration/test_calibrate_classifier.py).
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
        ({"forget": [IMAGE], "retain": [TEXT]}, "retain[0] is a text probe but forget[0] is an image probe"),
        ({"forget": [TEXT], "retain": [TEXT, IMAGE]}, "retain[1] is an image probe but forget[0] is a text probe"),
        ({"forget": [TEXT], "retain": [TEXT], "test": [TEXT]}, "test probes are for image classifiers"),
        ({"forget": [IMAGE], "retain": [IMAGE], "objective": {"minimize": "retain_nll_ratio"}}, "retain_nll_ratio"),
        ({"forget": [TEXT], "retain": [TEXT], "objective": {"maximize": "tow"}}, "tow: a metric of an image classifier"),
        ({"forget": [IMAGE], "retain": [IMAGE], "utility": {"w": [IMAGE]}}, "utility serve TOFU's metrics"),
        ({"forget": [IMAGE], "retain": [IMAGE], "objective": {"maximize": "towel"}}, "unknown metrics ['towel']"),
    ],
)
def test_a_probe_or_metric_of_the_other_kind_is_refused_naming_it(body: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError) as refused:
        CalibrateRequest.model_validate({"concepts": ["c"], **body})
    assert named in str(refused.value)


def test_image_probes_need_no_objective_and_text_probes_are_still_a_request() -> None:
    image = CalibrateRequest.model_validate({"concepts": ["c"], "forget": [IMAGE], "retain": [IMAGE], "test": [IMAGE]})
    assert image.kind == "image" and image.objective is None
    bounded = {"constraints": [{"metric": "retain_accuracy", "min": 0.5}], "retain_model": "m/r", "held_out_fraction": 0.5}
    assert CalibrateRequest.model_validate({"concepts": ["c"], "forget": [IMAGE] * 2, "retain": [IMAGE] * 2, **bounded})
    text = CalibrateRequest.model_validate({"concepts": ["c"], "forget": [TEXT], "retain": [TEXT]})
    assert text.kind == "text" and text.forget[0].kind == "text"
