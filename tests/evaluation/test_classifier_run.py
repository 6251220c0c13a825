"""service.evaluation.classifier_run's assembly of a classifier evaluation, on synthetic model outputs:
what each section holds, and what is left out and why."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from service.engine.classify import Classified
from service.evaluation import classifier_run


def _outputs(seed: int, labels: list[int], classes: int = 4, width: int = 6) -> Classified:
    rng = np.random.default_rng(seed)
    return Classified(
        logits=torch.from_numpy(rng.normal(size=(len(labels), classes))),
        labels=torch.tensor(labels, dtype=torch.int64),
        features=torch.from_numpy(rng.normal(size=(len(labels), width))),
    )


SETS = {"forget": [0, 0, 0, 1], "retain": [1, 2, 3, 1, 2, 3], "test": [0, 1, 2, 3, 0]}


def _models(names: tuple[str, ...] = ("base", "variant")) -> dict[str, dict[str, Classified]]:
    return {m: {s: _outputs(10 * i + j, labels) for j, (s, labels) in enumerate(SETS.items())} for i, m in enumerate(names)}


def test_per_probe_nll_and_hits_are_the_softmax_of_each_row() -> None:
    outputs = _outputs(3, [2, 0, 1])
    nll, hits = classifier_run.per_probe(outputs)
    for row, label, got_nll, got_hit in zip(outputs.logits.tolist(), [2, 0, 1], nll, hits, strict=True):
        assert got_nll == pytest.approx(-math.log(math.exp(row[label]) / sum(math.exp(v) for v in row)), rel=1e-12)
        assert got_hit == (max(range(4), key=lambda c: row[c]) == label)


def _section(models: dict[str, dict[str, Classified]]) -> dict[str, Any]:
    """The classifier section as the evaluation stores and answers it (JSON)."""
    return classifier_run.classifier_section(models, forgotten=[0]).model_dump(mode="json", exclude_unset=True)


def test_confusion_rows_only_for_sets_holding_the_forgotten_class() -> None:
    section = _section(_models())
    sets = section["models"]["variant"]["sets"]
    assert set(sets["forget"]["confusion"]) == {"0"} and set(sets["test"]["confusion"]) == {"0"}
    assert "confusion" not in sets["retain"]
    assert sum(sets["forget"]["confusion"]["0"]) == pytest.approx(1.0)


def test_without_a_retrained_model_tow_and_its_cka_are_left_out_naming_why() -> None:
    section = _section(_models())
    scores = section["scores"]
    assert "tow" not in scores and "cka_to_retrained" not in scores
    assert "retain_model" in scores["left_out"]["tow"] and set(scores["cka_to_base"]) == set(SETS)


def test_tow_needs_the_three_sets() -> None:
    models = _models(("base", "variant", "retrained"))
    for per_set in models.values():
        del per_set["test"]
    section = classifier_run.classifier_section(models, forgotten=[0])
    assert section.scores.tow is None and section.scores.cka_to_retrained is not None
    scores = _section(models)["scores"]  # stored: absent (not null), its reason named
    assert "tow" not in scores and "no test probes" in scores["left_out"]["tow"]


def test_nmi_past_its_bound_is_left_out_naming_the_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(classifier_run, "NMI_MAX_WORK", 10)
    section = _section(_models())
    assert "nmi" not in section["models"]["base"] and "da" in section["models"]["base"]
    assert "send fewer probes" in section["scores"]["left_out"]["base.nmi"]
