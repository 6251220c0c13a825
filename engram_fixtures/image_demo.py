"""The README's image example: a tiny ResNet that reads coloured digits, and its data, one file per class.

``python -m engram_fixtures.image_demo --out demo/digits`` writes, in about half a minute on one core:

- ``model/``: a tiny ``ResNetForImageClassification`` (:func:`engram_fixtures.vision.make_tiny_resnet`)
  trained on the mini-CIFAR training split (:mod:`engram_fixtures.mini_cifar`: scikit-learn's 1,797
  digit scans, upsampled to 16×16 and coloured per image), with its ``preprocessor_config.json``;
- ``train-<k>.jsonl``: the training images of class ``k`` (``{"image": <base64 PNG>, "label": k}``),
  one concept each;
- ``test-<k>.jsonl`` and ``test-others-<k>.jsonl``: the test images of class ``k``, and of every
  other class, for ``engram evaluate --forget/--retain``; ``test-all.jsonl``, every test image;
- with ``--retrained K``: ``retrained-K/``, the same recipe trained without class ``K``'s images, the
  retain model of ``engram evaluate --retain-model`` (the paper's ToW and CKA) and of an image
  calibration's ``retain_model`` (register it like ``model/``).

The same images, split and training recipe as the mini-CIFAR (seeded, one thread by default), so the
figures the README quotes come out the same on any machine with the same torch. Built once per
cache, like the mini-CIFAR (:func:`engram_fixtures.cache.cached_build`: keyed by the plan, the thread
count, this module's and its builders' source and the library versions), then copied into ``--out``:
a second run (the README's walk-through test, the calibration e2e) trains nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from engram_fixtures import mini_cifar, vision
from engram_fixtures.cache import cached_build, copy_entry
from engram_fixtures.mini_cifar import (
    NUM_CLASSES,
    TrainingPlan,
    _pixel_values,
    _split,
    _train,
    _write_records,
    make_images,
    model_accuracy,
)

__all__ = ["build_image_demo"]


REPORT = "report.json"  # beside the entry's demo/ folder: what the build measured


def build_image_demo(
    out: Path,
    plan: TrainingPlan | None = None,
    threads: int = 1,
    cache_dir: Path | None = None,
    retrained: int | None = None,
) -> dict[str, object]:
    """Write the model and the per-class files under ``out`` (a new or empty folder).

    Trained once per ``cache_dir`` (:func:`engram_fixtures.cache.default_cache_dir` when None) and
    copied from there: the files are the same bytes as a fresh build (seeded, ``threads`` fixed).

    Args:
        retrained: a class to also train a model without (``retrained-<k>/``), or None.

    Returns:
        What was built: the model's folder, the test accuracy and the seconds its training took (and
        the retrained model's folder, accuracy on the other classes and on the class it never saw).
    """
    chosen = plan or TrainingPlan()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty: choose a new folder")
    if retrained is not None and not 0 <= retrained < NUM_CLASSES:
        raise SystemExit(f"--retrained {retrained}: the classes are 0 to {NUM_CLASSES - 1}")

    def build(root: Path) -> None:
        report = _build(root / "demo", chosen, threads, retrained)
        (root / REPORT).write_text(json.dumps(report))

    parameters: dict[str, object] = {**asdict(chosen), "threads": threads}
    if retrained is not None:  # absent otherwise: the plain demo keeps its cache key
        parameters["retrained"] = retrained
    code = [Path(__file__), Path(str(mini_cifar.__file__)), Path(str(vision.__file__))]
    entry = cached_build("image-demo", parameters, code, build, cache_dir)
    if out.exists():
        out.rmdir()  # empty (checked above): copy_entry makes it
    copy_entry(entry / "demo", out)
    report = json.loads((entry / REPORT).read_text())
    if retrained is not None:
        report["retrained_model"] = str(out / f"retrained-{retrained}")
    return {"model": str(out / "model"), **report}


def _build(out: Path, chosen: TrainingPlan, threads: int, retrained: int | None) -> dict[str, object]:
    """Train the ResNet (and the retrained one) and write the per-class files under ``out`` (created);
    the test accuracies and the training seconds."""
    out.mkdir(parents=True)
    images, labels = make_images(chosen.size, chosen.seed)
    train, test = _split(labels, chosen.test_fraction, chosen.seed)
    for k in range(NUM_CLASSES):
        _write_records(out / f"train-{k}.jsonl", images, labels, [i for i in train if labels[i] == k])
        _write_records(out / f"test-{k}.jsonl", images, labels, [i for i in test if labels[i] == k])
        _write_records(out / f"test-others-{k}.jsonl", images, labels, [i for i in test if labels[i] != k])
    _write_records(out / "test-all.jsonl", images, labels, test)
    seconds = _train_resnet(out / "model", images, labels, train, chosen, threads)
    accuracy = model_accuracy(out / "model", [images[i] for i in test], [int(labels[i]) for i in test])
    report: dict[str, object] = {"train_seconds": seconds, "test_accuracy": round(accuracy, 4)}
    if retrained is not None:
        kept = [i for i in train if labels[i] != retrained]
        folder = out / f"retrained-{retrained}"
        report["retrained_train_seconds"] = _train_resnet(folder, images, labels, kept, chosen, threads)
        for name, indices in (
            ("others", [i for i in test if labels[i] != retrained]),
            ("class", [i for i in test if labels[i] == retrained]),
        ):
            score = model_accuracy(folder, [images[i] for i in indices], [int(labels[i]) for i in indices])
            report[f"retrained_{name}_accuracy"] = round(score, 4)
    return report


def _train_resnet(
    folder: Path, images: list[Image.Image], labels: np.ndarray, indices: list[int], chosen: TrainingPlan, threads: int
) -> float:
    """The demo's recipe (seed, plan, ``threads`` torch threads) on the images at ``indices``; seconds taken."""
    vision.make_tiny_resnet(folder, num_labels=NUM_CLASSES, seed=chosen.seed, image_size=chosen.size)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        started = time.perf_counter()
        torch.manual_seed(chosen.seed)
        pixels = _pixel_values(folder, [images[i] for i in indices])
        _train(folder, pixels, torch.as_tensor(labels[indices]), chosen)
        return round(time.perf_counter() - started, 1)
    finally:
        torch.set_num_threads(previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engram_fixtures.image_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="a new folder (under a model root of the server)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while training (default 1)")
    parser.add_argument(
        "--retrained", type=int, default=None, metavar="K", help="also train retrained-K/, the same model without class K"
    )
    arguments = parser.parse_args(argv)
    sys.stderr.write(
        f"a tiny ResNet on {NUM_CLASSES} classes of coloured digits (about half a minute of training, once per cache)...\n"
    )
    report = build_image_demo(arguments.out, threads=arguments.threads, retrained=arguments.retrained)
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
