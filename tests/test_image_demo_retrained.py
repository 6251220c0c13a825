"""``python -m engram_fixtures.image_demo --retrained K`` (issue 40: the README's ``--retain-model`` for
the image demo could not be reached, since nothing built the classifier retrained without the class).

The retrained model is the demo's recipe on every training image but class K's: it must not know class
K and must know the others as the demo model does; the demo's own files are the same bytes as without
the flag (the README's figures do not move), and ``test-all.jsonl`` holds every test image once.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from engram_fixtures.image_demo import build_image_demo, main
from engram_fixtures.mini_cifar import NUM_CLASSES

pytestmark = pytest.mark.slow

FORGOTTEN = 3


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_retrained_model_does_not_know_its_class_and_the_demo_is_unchanged(tmp_path: Path) -> None:
    plain = build_image_demo(tmp_path / "plain")
    report = build_image_demo(tmp_path / "with", retrained=FORGOTTEN)
    with_retrained = tmp_path / "with"

    assert report["retrained_model"] == str(with_retrained / f"retrained-{FORGOTTEN}")
    assert (with_retrained / f"retrained-{FORGOTTEN}" / "preprocessor_config.json").exists()
    scores = (report["retrained_class_accuracy"], report["retrained_others_accuracy"], plain["test_accuracy"])
    never_seen, others, demo = (float(str(value)) for value in scores)
    assert never_seen <= 0.05, report  # it never saw the class
    assert others >= demo - 0.05, report  # and knows the others as the demo model knows all

    for name in ("model/model.safetensors", "train-0.jsonl", f"test-{FORGOTTEN}.jsonl"):
        assert digest(tmp_path / "plain" / name) == digest(with_retrained / name), name
    assert report["test_accuracy"] == plain["test_accuracy"]

    every = [json.loads(line) for line in (with_retrained / "test-all.jsonl").read_text().splitlines()]
    per_class = [
        json.loads(line)
        for k in range(NUM_CLASSES)
        for line in (with_retrained / f"test-{k}.jsonl").read_text().splitlines()
    ]
    assert sorted(json.dumps(r, sort_keys=True) for r in every) == sorted(json.dumps(r, sort_keys=True) for r in per_class)


def test_a_class_outside_the_model_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=f"--retrained {NUM_CLASSES}: the classes are 0 to {NUM_CLASSES - 1}"):
        main(["--out", str(tmp_path / "out"), "--retrained", str(NUM_CLASSES)])
