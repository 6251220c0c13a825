"""POST /variants/{id}/evaluate with labelled image probes, on the real app in this process.

A tiny random ``ResNetForImageClassification`` (engram_fixtures.vision, 10 classes) is registered with
a second one of another seed as its "retrained" model, and a variant forgetting the digit 0 is built
from image concepts of scikit-learn's digits. Its evaluation's accuracies, label NLLs, confusion
rows, ToW and CKA equal a computation written here: the downloaded variant and the base loaded
with ``from_pretrained``, images read by ``AutoImageProcessor``, the penultimate features read
from ``model.resnet`` (not through a hook), CKA in its HSIC form on Gram matrices (Kornblith et
al.'s definition, not the feature-space formula the service uses), everything in plain Python
loops over float64 logits. Bad requests are 4xx problems that change nothing; a text evaluation's
answer keeps its shape.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoImageProcessor, AutoModelForImageClassification

from engram_fixtures.live import download_variant, wait_concepts_ready, wait_for_job, wait_variant_ready
from engram_fixtures.models import make_tiny_llama
from engram_fixtures.vision import make_tiny_resnet, make_tiny_vit
from tests.helpers.api import assert_problem, register_model, unchanged
from tests.helpers.app import InProcessServer, in_process_server
from tests.helpers.images import b64, digit_image, digit_indices, digit_record, digits, encode, png_bomb

pytestmark = pytest.mark.fast

RESNET, RETRAINED, FIVE, LLAMA = "cls/resnet", "cls/retrained", "cls/five", "cls/llama"
VIT, VIT_RETRAINED = "cls/vit", "cls/vit-retrained"
TOL = 1e-6
FORGET_DIGIT = 0


FORGET = [digit_record(i) for i in digit_indices(FORGET_DIGIT, 600, 8)]
RETAIN = [digit_record(i) for i in digit_indices(None, 600, 16, exclude=FORGET_DIGIT)]
TEST = [digit_record(i, label=f"class_{int(digits()[1][i])}") for i in digit_indices(None, 1200, 20)]  # names
TEXT_PROBE = {"prompt": "Q: the capital of France? A:", "completion": " Paris"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("classifier-eval")
    make_tiny_resnet(path / "models" / "resnet", num_labels=10, seed=0)
    make_tiny_resnet(path / "models" / "retrained", num_labels=10, seed=1)
    make_tiny_resnet(path / "models" / "five", num_labels=5, seed=2)
    make_tiny_vit(path / "models" / "vit", num_labels=10, seed=0)
    make_tiny_vit(path / "models" / "vit-retrained", num_labels=10, seed=1)
    make_tiny_llama(path / "models" / "llama")
    return path


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[InProcessServer]:
    torch.set_num_threads(1)
    with in_process_server(root / "app", root / "models") as app:
        models = (
            (RESNET, "resnet"),
            (RETRAINED, "retrained"),
            (FIVE, "five"),
            (LLAMA, "llama"),
            (VIT, "vit"),
            (VIT_RETRAINED, "vit-retrained"),
        )
        for model_id, folder in models:
            register_model(app.client, model_id, f"file://{root / 'models' / folder}")
        yield app


def _post_concept(server: InProcessServer, name: str, model: str, role: str, records: list[dict[str, Any]]) -> None:
    response = server.client.post("/concepts", json={"name": name, "role": role, "models": [model], "records": records})
    assert response.status_code == 202, response.text


@pytest.fixture(scope="module")
def variant(server: InProcessServer) -> dict[str, Any]:
    zeros = [digit_record(i) for i in digit_indices(FORGET_DIGIT, 0, 20)]
    others = [digit_record(i) for i in digit_indices(None, 0, 60, exclude=FORGET_DIGIT)]
    _post_concept(server, "digit-zero", RESNET, "target", zeros)
    _post_concept(server, "digit-others", RESNET, "reference", others)
    wait_concepts_ready(server.client, ["digit-zero", "digit-others"], RESNET, timeout=300)
    body = {"concepts": ["digit-zero"], "alpha": 1.0, "format": "checkpoint"}
    response = server.client.post(f"/models/{RESNET}/unlearn", json=body)
    assert response.status_code in (200, 202), response.text
    return wait_variant_ready(server.client, response.json()["variant"]["variant_id"], timeout=300)


@pytest.fixture(scope="module")
def text_variant(server: InProcessServer) -> dict[str, Any]:
    _post_concept(server, "llama-facts", LLAMA, "target", [TEXT_PROBE])
    wait_concepts_ready(server.client, ["llama-facts"], LLAMA, timeout=300)
    response = server.client.post(f"/models/{LLAMA}/unlearn", json={"concepts": ["llama-facts"], "alpha": 1.0})
    assert response.status_code in (200, 202), response.text
    return wait_variant_ready(server.client, response.json()["variant"]["variant_id"], timeout=300)


def _evaluate(server: InProcessServer, variant_id: str, body: dict[str, Any]) -> dict[str, Any]:
    response = server.client.post(f"/variants/{variant_id}/evaluate", params={"wait": 30}, json=body)
    assert response.status_code in (200, 202), response.text
    job = response.json() if response.status_code == 200 else wait_for_job(server.client, response.json()["job_id"], 300)
    assert job["kind"] == "evaluate" and job["status"] == "succeeded", job
    result: dict[str, Any] = job["result"]
    return {**result, "_progress": job["progress"]}


# ---------------------------------------------------------------- the computation written here


def _outputs(folder: Path, model: Any, probes: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """float64 logits, penultimate features (ResNet's pooled output) and class ids, probe by probe."""
    processor = AutoImageProcessor.from_pretrained(str(folder))
    logits, features, labels = [], [], []
    model.eval()
    with torch.no_grad():
        for probe in probes:
            image = digit_image_from(probe)
            pixels = processor(images=[image], return_tensors="pt")["pixel_values"].float()
            pooled = model.resnet(pixel_values=pixels).pooler_output.flatten(1)
            logits.append(model.classifier(pooled).double()[0].numpy())
            features.append(pooled.double()[0].numpy())
            label = probe["label"]
            labels.append(int(label.removeprefix("class_")) if isinstance(label, str) else int(label))
    return np.array(logits), np.array(features), labels


def digit_image_from(probe: dict[str, Any]) -> Any:
    import base64
    import io

    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(probe["image"]))).convert("RGB")


def _hand_accuracy(logits: np.ndarray, labels: list[int]) -> float:
    hits = 0
    for row, label in zip(logits, labels, strict=True):
        best = max(range(len(row)), key=lambda c: (row[c], -c))  # the first largest, as argmax
        hits += best == label
    return hits / len(labels)


def _hand_nll(logits: np.ndarray, labels: list[int]) -> list[float]:
    out = []
    for row, label in zip(logits, labels, strict=True):
        top = max(row)
        out.append(-(row[label] - top - math.log(sum(math.exp(v - top) for v in row))))
    return out


def _hand_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Kornblith et al.'s CKA as HSIC on Gram matrices: tr(KHLH) / sqrt(tr(KHKH) tr(LHLH))."""
    n = x.shape[0]
    h = np.eye(n) - np.ones((n, n)) / n
    k, l_ = h @ (x @ x.T) @ h, h @ (y @ y.T) @ h
    return float(np.trace(k @ l_) / math.sqrt(np.trace(k @ k) * np.trace(l_ @ l_)))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(a), abs(b))


# ---------------------------------------------------------------- tests


def test_classifier_evaluation_equals_a_hand_computation(
    server: InProcessServer, variant: dict[str, Any], root: Path, tmp_path: Path
) -> None:
    body = {"forget": FORGET, "retain": RETAIN, "test": TEST, "retain_model": RETRAINED}
    result = _evaluate(server, variant["variant_id"], body)
    n = len(FORGET) + len(RETAIN) + len(TEST)
    assert result["_progress"]["done"] == result["_progress"]["total"] == 3 * n
    assert result["retain_model"] == RETRAINED and not result.get("reused")
    folder = root / "models" / "resnet"
    models = {
        "base": (folder, AutoModelForImageClassification.from_pretrained(folder)),
        "variant": (
            folder,
            AutoModelForImageClassification.from_pretrained(download_variant(server.client, variant, tmp_path / "v")),
        ),
        "retrained": (
            root / "models" / "retrained",
            AutoModelForImageClassification.from_pretrained(root / "models" / "retrained"),
        ),
    }
    sets = {"forget": FORGET, "retain": RETAIN, "test": TEST}
    hand = {m: {s: _outputs(f, model, probes) for s, probes in sets.items()} for m, (f, model) in models.items()}
    section = result["classifier"]
    assert section["forgotten_classes"] == [FORGET_DIGIT]
    accuracy: dict[str, dict[str, float]] = {}
    for model_name in ("base", "variant", "retrained"):
        report = section["models"][model_name]
        for set_name in sets:
            logits, _, labels = hand[model_name][set_name]
            got = report["sets"][set_name]
            accuracy.setdefault(model_name, {})[set_name] = _hand_accuracy(logits, labels)
            assert got["n"] == len(labels)
            assert _close(got["accuracy"], accuracy[model_name][set_name]), (model_name, set_name)
            nll = _hand_nll(logits, labels)
            assert _close(got["label_nll"], sum(nll) / len(nll)), (model_name, set_name)
            zeros = [row for row, label in zip(logits, labels, strict=True) if label == FORGET_DIGIT]
            if zeros:
                counts = [0] * 10
                for row in zeros:
                    counts[int(np.argmax(row))] += 1
                assert got["confusion"] == {str(FORGET_DIGIT): pytest.approx([c / len(zeros) for c in counts], abs=TOL)}
            else:
                assert "confusion" not in got
            if model_name in result["summary"]:  # summary and records: the text shape, the label's numbers
                summary = result["summary"][model_name][set_name]
                assert _close(summary["mean_nll"], got["label_nll"]) and _close(summary["exact_match"], got["accuracy"])
                records = [r for r in result["records"] if r["split"] == set_name]
                assert [r["index"] for r in records] == list(range(len(labels)))
                assert all(_close(r[model_name]["nll"], v) for r, v in zip(records, nll, strict=True))
        assert 0.0 <= report["da"] <= 1.0 + TOL and 0.0 <= report["nmi"] <= 1.0 + TOL
    expected_tow = 1.0
    for set_name in sets:
        expected_tow *= 1.0 - abs(accuracy["variant"][set_name] - accuracy["retrained"][set_name])
    scores = section["scores"]
    assert _close(scores["tow"], expected_tow)
    for set_name in sets:
        variant_features = hand["variant"][set_name][1]
        assert _close(scores["cka_to_base"][set_name], _hand_cka(variant_features, hand["base"][set_name][1]))
        assert _close(scores["cka_to_retrained"][set_name], _hand_cka(variant_features, hand["retrained"][set_name][1]))
    assert scores["left_out"] == {}
    # issue 39: each image probe set's sha256 (of its probes as canonical JSON, computed here) and size
    canonical = {name: json.dumps(probes, sort_keys=True, separators=(",", ":")).encode() for name, probes in sets.items()}
    expected = {name: {"sha256": hashlib.sha256(data).hexdigest(), "n": len(sets[name])} for name, data in canonical.items()}
    assert result["probe_sets"] == expected
    # the same probes on the same variant: answered from storage, the same numbers
    again = _evaluate(server, variant["variant_id"], body)
    assert again == result, "issue 35, finding 9: answered by the job that stored the result"


def test_without_a_retrained_model_tow_is_left_out_naming_why(server: InProcessServer, variant: dict[str, Any]) -> None:
    result = _evaluate(server, variant["variant_id"], {"forget": FORGET, "retain": RETAIN})
    section = result["classifier"]
    assert set(section["models"]) == {"base", "variant"}
    assert set(section["models"]["variant"]["sets"]) == {"forget", "retain"}
    scores = section["scores"]
    assert "tow" not in scores and "cka_to_retrained" not in scores
    assert "retain_model" in scores["left_out"]["tow"]
    assert set(scores["cka_to_base"]) == {"forget", "retain"}
    assert result["retain_model"] is None


def test_a_text_evaluation_keeps_its_shape(server: InProcessServer, text_variant: dict[str, Any]) -> None:
    result = _evaluate(server, text_variant["variant_id"], {"forget": [TEXT_PROBE], "retain": [TEXT_PROBE]})
    # no classifier section; who asked, when and on which probes (issue 39; no labels or reason given: none stored)
    recorded = {"created_at", "created_by", "labels", "probe_sets"}
    assert set(result) == {"variant_id", "summary", "records", "worker", "_progress", *recorded}
    assert set(result["summary"]["base"]) == {"forget", "retain"}
    assert set(result["summary"]["base"]["forget"]) == {"mean_nll", "exact_match", "n"}
    assert set(result["records"][0]) == {"split", "index", "base", "variant"}


def _refused(server: InProcessServer, variant_id: str, body: dict[str, Any], status: int, *mentions: str) -> None:
    with unchanged(server):  # type: ignore[arg-type]  # InProcessServer has the fields unchanged reads
        response = server.client.post(f"/variants/{variant_id}/evaluate", json=body)
        assert_problem(response, status, *mentions)


def test_image_probes_for_a_text_model_are_422_naming_the_probe(
    server: InProcessServer, text_variant: dict[str, Any]
) -> None:
    _refused(
        server,
        text_variant["variant_id"],
        {"forget": FORGET[:1], "retain": RETAIN[:2]},
        422,
        "forget[0] is an image probe",
        f"model {LLAMA} is a text model",
    )


def test_text_probes_for_an_image_model_are_422_naming_the_probe(server: InProcessServer, variant: dict[str, Any]) -> None:
    _refused(
        server,
        variant["variant_id"],
        {"retain": [TEXT_PROBE]},
        422,
        "retain[0] is a text probe",
        f"model {RESNET} is an image model",
    )


def test_mixed_probe_kinds_are_422(server: InProcessServer, variant: dict[str, Any]) -> None:
    _refused(
        server,
        variant["variant_id"],
        {"forget": FORGET[:1], "retain": [TEXT_PROBE]},
        422,
        "retain[0] is a text probe but forget[0] is an image probe",
    )


@pytest.mark.parametrize(
    ("label", "mention"),
    [("class_99", "'class_99' is no class name of the model"), (10, "'label' 10 is no class of the model")],
)
def test_a_label_the_model_does_not_have_is_422_naming_the_probe(
    server: InProcessServer, variant: dict[str, Any], label: int | str, mention: str
) -> None:
    probes = [*RETAIN[:2], digit_record(5, label=label)]
    _refused(server, variant["variant_id"], {"forget": FORGET[:1], "retain": probes}, 422, "retain[2]", mention)


def test_an_undecodable_image_is_422_naming_the_probe(server: InProcessServer, variant: dict[str, Any]) -> None:
    broken = {"image": b64(encode(digit_image(3, rgb=True), "PNG")[:40]), "label": 3}
    gif = {"image": b64(encode(digit_image(3, rgb=True), "GIF")), "label": 3}
    _refused(server, variant["variant_id"], {"forget": FORGET[:1], "test": [broken]}, 422, "test[0]")
    _refused(server, variant["variant_id"], {"forget": [*FORGET[:1], gif]}, 422, "forget[1]", "a GIF")


def test_a_decompression_bomb_is_413_naming_the_probe(server: InProcessServer, variant: dict[str, Any]) -> None:
    bomb = {"image": b64(png_bomb(9000, 9000)), "label": 0}
    _refused(server, variant["variant_id"], {"forget": [bomb]}, 413, "forget[0]", "ENGRAM_MAX_IMAGE_PIXELS")


def test_a_retain_model_of_another_kind_or_class_count_is_422(server: InProcessServer, variant: dict[str, Any]) -> None:
    body = {"forget": FORGET[:2], "retain": RETAIN[:2]}
    _refused(server, variant["variant_id"], {**body, "retain_model": LLAMA}, 422, f"retain_model {LLAMA} is a text model")
    _refused(server, variant["variant_id"], {**body, "retain_model": FIVE}, 422, f"retain_model {FIVE} has 5 classes")
    _refused(server, variant["variant_id"], {**body, "retain_model": "cls/nothing"}, 404, "cls/nothing")


def test_text_only_options_with_image_probes_are_422(server: InProcessServer, variant: dict[str, Any]) -> None:
    _refused(server, variant["variant_id"], {"forget": FORGET[:1], "metrics": "tofu"}, 422, "metrics")
    _refused(server, variant["variant_id"], {"forget": [{**FORGET[0], "label": None}]}, 422, "image and label")


@pytest.mark.parametrize("fmt", ["delta", "peft"])
def test_a_delta_or_peft_variant_is_evaluated_as_shipped(server: InProcessServer, variant: dict[str, Any], fmt: str) -> None:
    """The same edit shipped as a delta on the base or a PEFT adapter (LoRA on the convs) scores as the checkpoint."""
    body = {"concepts": ["digit-zero"], "alpha": 1.0, "format": fmt}
    response = server.client.post(f"/models/{RESNET}/unlearn", json=body)
    assert response.status_code in (200, 202), response.text
    shipped = wait_variant_ready(server.client, response.json()["variant"]["variant_id"], timeout=300)
    probes = {"forget": FORGET, "retain": RETAIN}
    expected = _evaluate(server, variant["variant_id"], probes)["classifier"]["models"]["variant"]["sets"]
    got = _evaluate(server, shipped["variant_id"], probes)["classifier"]["models"]["variant"]["sets"]
    tolerance = TOL if fmt == "delta" else 1e-4  # the adapter drops singular values under its rank cut
    for name in probes:
        assert abs(got[name]["label_nll"] - expected[name]["label_nll"]) <= tolerance * max(1.0, expected[name]["label_nll"])


def _vit_outputs(folder: Path, model: Any, probes: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """A ViT's float64 logits and penultimate features (the [CLS] token of ``model.vit``'s output)."""
    processor = AutoImageProcessor.from_pretrained(str(folder))
    images = [digit_image_from(p) for p in probes]
    with torch.no_grad():
        pixels = processor(images=images, return_tensors="pt")["pixel_values"].float()
        cls = model.eval().vit(pixel_values=pixels).last_hidden_state[:, 0, :]
        logits = model.classifier(cls)
    return logits.double().numpy(), cls.double().numpy(), [int(p["label"]) for p in probes]


def test_a_vit_variant_is_evaluated_as_a_hand_computation_says(server: InProcessServer, root: Path, tmp_path: Path) -> None:
    _post_concept(server, "vit-zero", VIT, "target", [digit_record(i) for i in digit_indices(FORGET_DIGIT, 0, 20)])
    _post_concept(server, "vit-others", VIT, "reference", [digit_record(i) for i in digit_indices(None, 0, 60, exclude=0)])
    wait_concepts_ready(server.client, ["vit-zero", "vit-others"], VIT, timeout=300)
    response = server.client.post(f"/models/{VIT}/unlearn", json={"concepts": ["vit-zero"], "alpha": 1.0})
    assert response.status_code in (200, 202), response.text
    shipped = wait_variant_ready(server.client, response.json()["variant"]["variant_id"], timeout=300)
    sets = {"forget": FORGET, "retain": RETAIN, "test": [digit_record(i) for i in digit_indices(None, 1200, 20)]}
    result = _evaluate(server, shipped["variant_id"], {**sets, "retain_model": VIT_RETRAINED})
    folders = {
        "base": root / "models" / "vit",
        "variant": download_variant(server.client, shipped, tmp_path / "vit-variant"),
        "retrained": root / "models" / "vit-retrained",
    }
    hand = {
        m: {s: _vit_outputs(f, AutoModelForImageClassification.from_pretrained(f), p) for s, p in sets.items()}
        for m, f in folders.items()
    }
    section = result["classifier"]
    accuracy = {m: {s: _hand_accuracy(hand[m][s][0], hand[m][s][2]) for s in sets} for m in folders}
    for m in folders:
        for s in sets:
            got = section["models"][m]["sets"][s]
            assert _close(got["accuracy"], accuracy[m][s]), (m, s)
            nll = _hand_nll(hand[m][s][0], hand[m][s][2])
            assert _close(got["label_nll"], sum(nll) / len(nll)), (m, s)
    expected_tow = math.prod(1.0 - abs(accuracy["variant"][s] - accuracy["retrained"][s]) for s in sets)
    assert _close(section["scores"]["tow"], expected_tow)
    for s in sets:
        assert _close(section["scores"]["cka_to_base"][s], _hand_cka(hand["variant"][s][1], hand["base"][s][1]))
        assert _close(section["scores"]["cka_to_retrained"][s], _hand_cka(hand["variant"][s][1], hand["retrained"][s][1]))
