"""service.evaluation.records.StoredProbes: an evaluation's stored probes are the bytes the dicts
written before the record gave (their sha256 names the evaluation), and a file that does not fit
is refused naming it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.errors import JobFailed
from service.evaluation.records import ClassifierOptions, StoredProbes, TofuOptions
from service.evaluation.retain_model import RetainModelRef

TEXT = [
    {"prompt": "Q: où? A:", "completion": " ici"},
    {
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
        "paraphrased_answer": "p",
        "perturbed_answers": ["a", "b"],
    },
]
IMAGES = [{"image": "iVBORw0KGgo=", "label": 3}, {"image": "R0lGOD==", "label": "cat"}]
REF = {"id": "demo/retain", "kind": "model", "digest": "ab" * 32}


def _written_before(stored: dict[str, Any]) -> bytes:
    """What submit_evaluation wrote before the record (a dict, keys sorted, UTF-8 as is)."""
    return json.dumps(stored, sort_keys=True, ensure_ascii=False).encode()


CASES = [
    ({"forget": TEXT, "retain": TEXT[:1]}, StoredProbes(forget=TEXT, retain=TEXT[:1])),
    (
        {
            "forget": TEXT,
            "retain": [],
            "tofu": {"metrics": "tofu", "holdout": TEXT, "utility": {"ra": TEXT}, "retain_model": None},
        },
        StoredProbes(
            forget=TEXT, retain=[], tofu=TofuOptions(metrics="tofu", holdout=TEXT, utility={"ra": TEXT}, retain_model=None)
        ),
    ),
    (
        {
            "forget": TEXT,
            "retain": TEXT,
            "tofu": {"metrics": ["forget_quality"], "holdout": [], "utility": {}, "retain_model": REF},
        },
        StoredProbes(
            forget=TEXT,
            retain=TEXT,
            tofu=TofuOptions(metrics=["forget_quality"], holdout=[], utility={}, retain_model=RetainModelRef(**REF)),
        ),
    ),
    (
        {"forget": IMAGES, "retain": [], "test": IMAGES, "classifier": {"retain_model": None}},
        StoredProbes(forget=IMAGES, retain=[], test=IMAGES, classifier=ClassifierOptions(retain_model=None)),
    ),
]


@pytest.mark.parametrize(("before", "record"), CASES)
def test_the_stored_bytes_are_those_written_before_the_record(before: dict[str, Any], record: StoredProbes) -> None:
    assert record.to_bytes() == _written_before(before)
    assert StoredProbes.from_bytes(record.to_bytes(), "d").to_bytes() == record.to_bytes()  # read back: the same bytes


def test_stored_probes_that_do_not_fit_are_refused_naming_the_file_and_the_field() -> None:
    with pytest.raises(JobFailed, match=r"probes/d1\.json.*retain"):
        StoredProbes.from_bytes(b'{"forget": [], "retain": 3}', "d1")
    bad = {
        "forget": [],
        "retain": [],
        "tofu": {"metrics": "tofu", "holdout": [], "utility": {}, "retain_model": {**REF, "kind": "x"}},
    }
    with pytest.raises(JobFailed, match=r"probes/d2\.json.*tofu\.retain_model\.kind"):
        StoredProbes.from_bytes(json.dumps(bad).encode(), "d2")
    with pytest.raises(JobFailed, match=r"probes/d3\.json.*surprise"):
        StoredProbes.from_bytes(b'{"forget": [], "retain": [], "surprise": 1}', "d3")
