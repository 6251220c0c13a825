"""Class-wise unlearning on the mini-CIFAR: Engram α=1 and α_best against the model retrained without
class 0, and against the training baselines (fine-tuning on the retain set, NegGrad), timed.

    python -m bench.vision                    # both architectures, the paper's α grid (builds the mini-CIFAR once: minutes)
    python -m bench.vision --arch resnet --out bench/results/vision.json
    python -m bench.vision --alphas 1         # α = 1 alone
    python -m bench.vision --scale                # also the 100-class measurement (bench.vision_scale)

Per architecture (engram_fixtures.mini_cifar's tiny ResNet and ViT), in this process, on file
storage in a temporary directory, with the service's own functions: the base model is registered
(``register_model``); one concept per class is collected from that class's training images
(``collect_statistics`` on ``PixelBatch`` batches of the model's image processor) and published as a
collection job publishes it (the image collection job is not wired into the concept job yet);
a universe of the ten class concepts is built (``submit_universe`` + the workers' ``run_job``);
the unlearn variants of class 0 at each α of the grid (``submit_variant`` + ``run_job``, uniform
scaling, the universe as reference: ``W − α·W·Σ_class0·(Σ_all classes)⁺`` on every conv and the
head); α_best is the grid's α of the highest ToW (the paper's grid search selects by ToW too).

Then the base, the Engram variant and the retrained model are run over the probes
(``service.engine.classify``) and scored (``service.evaluation.classifier_metrics``):

* forget = the training images of class 0 (the paper's X⁺), retain = the other training images
  (X⁻), test = the whole test split (every class; accuracy on the test images of class 0 and of the
  others is reported too);
* ToW against the retrained model; DA (forget vs retain features) and NMI (k-means of the forget ∪
  retain features against their classes) of each model's penultimate features; linear CKA of the
  test split's penultimate features to the base and to the retrained model.

The baselines (:mod:`bench.vision_baselines`): fine-tuning the base on the retain set and NegGrad
(gradient ascent on the forget set, stopped at chance), short AdamW loops from the base weights.

Timings: the collection per concept, the universe build, the variant job (median over the grid),
next to the retrained model's training time (the mini-CIFAR build's) and the baselines' loops. The
table's cost columns per method: ``seconds`` (Engram: the variant job, the universe already built;
a baseline: its loop; Retrain: its training), ``fwd``/``bwd`` (images forwarded / back-propagated:
Engram's forward passes are the collection's, one per training image, none backward; Retrain's
are its epochs over the retain set).

``--scale``: the 100-class measurement of :mod:`bench.vision_scale` (a universe of 100 class
concepts built once, then each class variant against the checkpoint copy floor).
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from bench.universe import run_pending, service_context  # noqa: E402
from bench.vision_baselines import FINETUNE_PLAN, NEGGRAD_PLAN, BaselineRun, finetune_retain, neggrad  # noqa: E402
from engram_fixtures.mini_cifar import (
    FORGET_CLASS,
    NUM_CLASSES,
    MiniCifar,
    TrainingPlan,
    build_mini_cifar,
    load_split,
)  # noqa: E402
from service.engine.classify import Classified, classify  # noqa: E402
from service.engine.collect import LayerStatistics, PixelBatch, collect_statistics  # noqa: E402
from service.engine.images import load_image_processor, pixel_batches  # noqa: E402
from service.evaluation import classifier_metrics as cm  # noqa: E402

BATCH = 64


def _batches(folder: Path, images: list[Image.Image]) -> list[PixelBatch]:
    processor = load_image_processor(folder)
    return [PixelBatch(values) for values in pixel_batches(processor, images, BATCH, 3)]


def publish_concept(ctx: Any, model_id: str, name: str, stats: LayerStatistics, images: int, scratch: Path) -> None:
    """Publish a concept's statistics where a collection job publishes them."""
    from engram_fixtures.statistics import name_digest, publish_concept_statistics

    digest = name_digest(model_id, name)
    publish_concept_statistics(ctx, model_id, name, stats, num_records=images, dataset_digest=digest, scratch=scratch)


def engram_variants(
    built: MiniCifar, architecture: str, root: Path, alphas: list[float]
) -> tuple[dict[float, Path], dict[str, Any]]:
    """The α-variants forgetting class 0 (one universe, a variant job per α), through the service's
    job bodies; their folders and the timings."""
    from service.engine.checkpoint import load_model
    from service.models.inspection import register_model
    from service.universes.service import submit_universe
    from service.variants.service import coefficients_for_unlearn, submit_variant, variant_view

    model_dir = root / "base"
    shutil.copytree(built.model(architecture), model_dir)
    ctx = service_context(root)
    model_id = f"mini-cifar/{architecture}"
    record, _ = register_model(ctx, model_id, f"file://{model_dir}")
    model = load_model(model_dir, dtype=torch.float32)
    images, labels = load_split(built.train)
    collect_s = []
    for label in range(NUM_CLASSES):
        chosen = [image for image, y in zip(images, labels, strict=True) if y == label]
        started = time.perf_counter()
        stats = collect_statistics(model, _batches(model_dir, chosen), record.layout.layers)
        collect_s.append(time.perf_counter() - started)
        publish_concept(ctx, model_id, f"class{label}", stats, len(chosen), root)
    started = time.perf_counter()
    view, _ = submit_universe(ctx, model_id, [f"class{c}" for c in range(NUM_CLASSES)], None)
    run_pending(ctx)
    universe_s = time.perf_counter() - started
    options = {"scaling": "uniform", "format": "checkpoint", "universe": view.universe_id}
    folders, variant_s = {}, []
    for alpha in alphas:
        started = time.perf_counter()
        variant, _ = submit_variant(ctx, model_id, coefficients_for_unlearn([f"class{FORGET_CLASS}"], alpha), alpha, options)
        run_pending(ctx)
        variant_s.append(time.perf_counter() - started)
        assert variant_view(ctx, variant.variant_id).status == "ready"
        folder = root / f"variant-{alpha:g}"
        shutil.copytree(model_dir, folder)
        files = ctx.storage.local_path(f"variants/{variant.variant_id}/files/model.safetensors")
        shutil.copyfile(files, folder / "model.safetensors")
        folders[alpha] = folder
    timings = {
        "collect_s_per_concept": round(float(np.mean(collect_s)), 3),
        "universe_s": round(universe_s, 3),
        "variant_s_median": round(float(np.median(variant_s)), 3),
        "retrain_s": built.report[f"{architecture}-retrained.train_seconds"],
    }
    return folders, timings


def _pixels(folder: Path, images: list[Image.Image]) -> torch.Tensor:
    return torch.cat([batch.pixel_values for batch in _batches(folder, images)])


def baselines(built: MiniCifar, architecture: str, root: Path) -> tuple[dict[str, Path], dict[str, BaselineRun]]:
    """Fine-tune on the retain set and NegGrad on the forget set, from the base model; their folders and costs."""
    base = built.model(architecture)
    images, labels = load_split(built.train)
    forget = [i for i, y in enumerate(labels) if y == FORGET_CLASS]
    retain = [i for i, y in enumerate(labels) if y != FORGET_CLASS]
    pixels, targets = _pixels(base, images), torch.as_tensor(labels)
    runs = {
        "finetune_retain": finetune_retain(base, root / "finetune", pixels[retain], targets[retain], FINETUNE_PLAN),
        "neggrad": neggrad(base, root / "neggrad", pixels[forget], targets[forget], NEGGRAD_PLAN, NUM_CLASSES),
    }
    return {"finetune_retain": root / "finetune", "neggrad": root / "neggrad"}, runs


def _run(folder: Path, images: list[Image.Image], labels: list[int]) -> Classified:
    from transformers import AutoModelForImageClassification

    model = AutoModelForImageClassification.from_pretrained(folder)
    return classify(model, _batches(folder, images), labels)


def _scores(outputs: dict[str, Classified]) -> dict[str, float]:
    train, test = outputs["train"], outputs["test"]
    logits, labels = train.logits.numpy(), train.labels.numpy()
    forget = labels == FORGET_CLASS
    test_logits, test_labels = test.logits.numpy(), test.labels.numpy()
    test_forget = test_labels == FORGET_CLASS
    features = train.features.numpy()
    return {
        "forget": cm.top1_accuracy(logits[forget], labels[forget], "forget"),
        "retain": cm.top1_accuracy(logits[~forget], labels[~forget], "retain"),
        "test": cm.top1_accuracy(test_logits, test_labels, "test"),
        "test_forget_class": cm.top1_accuracy(test_logits[test_forget], test_labels[test_forget], "test forget"),
        "test_other_classes": cm.top1_accuracy(test_logits[~test_forget], test_labels[~test_forget], "test retain"),
        "forget_nll": cm.mean_label_nll(logits[forget], labels[forget], "forget"),
        "DA": cm.dimensional_alignment(features[forget], features[~forget]),
        "NMI": cm.feature_nmi(features, labels),
    }


def measure(built: MiniCifar, architecture: str, alphas: list[float]) -> dict[str, Any]:
    """The table's rows (original, Engram per α, α_best by ToW, retrain) and the timings."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-vision-") as scratch:
        variants, timings = engram_variants(built, architecture, Path(scratch), alphas)
        trained, runs = baselines(built, architecture, Path(scratch))
        splits = {"train": load_split(built.train), "test": load_split(built.test)}
        folders = {
            "original": built.model(architecture),
            **{f"engram_alpha_{alpha:g}": folder for alpha, folder in variants.items()},
            **trained,
            "retrain": built.model(architecture, retrained=True),
        }
        outputs = {name: {split: _run(folder, *data) for split, data in splits.items()} for name, folder in folders.items()}
    rows: dict[str, dict[str, float]] = {name: _scores(out) for name, out in outputs.items()}
    retrained = cm.SetAccuracies(rows["retrain"]["forget"], rows["retrain"]["retain"], rows["retrain"]["test"])
    for name, row in rows.items():
        row["ToW"] = cm.tug_of_war(cm.SetAccuracies(row["forget"], row["retain"], row["test"]), retrained)
        features = outputs[name]["test"].features.numpy()
        row["CKA_to_original"] = cm.linear_cka(features, outputs["original"]["test"].features.numpy())
        row["CKA_to_retrain"] = cm.linear_cka(features, outputs["retrain"]["test"].features.numpy())
    best = max(alphas, key=lambda alpha: rows[f"engram_alpha_{alpha:g}"]["ToW"])
    _costs(rows, timings, runs, built, alphas)
    result = {"architecture": architecture, "alpha_best": best, "timings": timings, "rows": rows}
    return {**result, "baselines": {name: run.to_json() for name, run in runs.items()}, "report": built.report}


def _costs(
    rows: dict[str, dict[str, float]],
    timings: dict[str, Any],
    runs: dict[str, BaselineRun],
    built: MiniCifar,
    alphas: list[float],
) -> None:
    """Each row's seconds and forward/backward passes (see the module notes)."""
    images, labels = load_split(built.train)
    retained = sum(1 for y in labels if y != FORGET_CLASS)
    epochs = int(built.report["plan"]["epochs"])  # type: ignore[index]
    rows["original"].update(seconds=0.0, fwd=0, bwd=0)
    for alpha in alphas:
        rows[f"engram_alpha_{alpha:g}"].update(seconds=timings["variant_s_median"], fwd=len(images), bwd=0)
    for name, run in runs.items():
        rows[name].update(seconds=run.seconds, fwd=run.forward_passes, bwd=run.backward_passes)
    rows["retrain"].update(seconds=float(timings["retrain_s"]), fwd=epochs * retained, bwd=epochs * retained)


def _table(result: dict[str, Any]) -> str:
    columns = {"forget": "forget", "retain": "retain", "test": "test", "ToW": "ToW", "DA": "DA", "NMI": "NMI"}
    columns |= {"CKA_to_original": "CKA_orig", "CKA_to_retrain": "CKA_retr"}
    costs = ["seconds", "fwd", "bwd"]
    lines = [
        f"{result['architecture']} (alpha_best by ToW: {result['alpha_best']:g}): " + json.dumps(result["timings"]),
        "method".ljust(25) + "".join(c.rjust(9) for c in columns.values()) + "".join(c.rjust(9) for c in costs),
    ]
    for name, row in result["rows"].items():
        label = f"{name} (best)" if name == f"engram_alpha_{result['alpha_best']:g}" else name
        metrics = "".join(f"{row[c]:9.4f}" for c in columns)
        lines.append(label.ljust(25) + metrics + f"{row['seconds']:9.2f}{int(row['fwd']):9d}{int(row['bwd']):9d}")
    return "\n".join(lines)


# The paper's grid search (issue 40: the default was α = 1 alone, so `python -m bench.vision` as the README
# gives it printed ToW 0.944 at α = 1, not the README's 0.97 at the best α).
PAPER_ALPHAS = "0.5,0.6,0.7,0.8,0.9,1,1.2,1.4,1.6,1.8,2"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--arch", choices=["resnet", "vit", "both"], default="both")
    parser.add_argument(
        "--alphas",
        default=PAPER_ALPHAS,
        help=f"comma-separated α grid (default: the paper's, {PAPER_ALPHAS}); α_best maximises ToW",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--cache", type=Path, default=None, help="the mini-CIFAR cache (default: $ENGRAM_FIXTURE_CACHE)")
    parser.add_argument("--epochs", type=int, default=TrainingPlan.epochs, help="the mini-CIFAR's training epochs")
    parser.add_argument("--scale", action="store_true", help="also the 100-class measurement (bench.vision_scale)")
    arguments = parser.parse_args(argv)
    built = build_mini_cifar(arguments.cache, TrainingPlan(epochs=arguments.epochs))
    architectures = ["resnet", "vit"] if arguments.arch == "both" else [arguments.arch]
    alphas = [float(value) for value in arguments.alphas.split(",")]
    results = [measure(built, architecture, alphas) for architecture in architectures]
    for result in results:
        print(_table(result))
    output: dict[str, Any] = {"classwise": results}
    if arguments.scale:
        from bench.vision_scale import measure_scale, scale_table

        output["scale"] = measure_scale()
        print(scale_table(output["scale"]))
    if arguments.out:
        arguments.out.write_text(json.dumps(output if arguments.scale else results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
