"""Class-wise unlearning at scale: a universe of 100 class concepts builds once, then any class's
variant costs about a checkpoint copy (the paper's claim: every class's engram from one decomposition).

    python -m bench.vision_scale                   # 100 classes, 5 class variants
    python -m bench.vision_scale --classes 100 --variants 10 --out bench/results/vision_scale.json

The set: scikit-learn's ``load_digits`` scans recoloured into 100 classes (class ``c`` is digit
``c % 10`` drawn in hue ``c // 10`` of ten, on a dark background, upsampled to 16×16), ``--images``
per class. The classifier: a random ``ResNetForImageClassification`` (stem 32, stages 64/128/256
channels, a 100-way head: 1.2M parameters, a 4.7 MB float32 checkpoint), wide enough that a
checkpoint copy is not noise; it is not trained, because what is measured is cost, which training
does not change (the statistics have the same shapes; tests/e2e/test_vision_api.py and bench.vision
measure what an edit does to a trained classifier).

Through the service's own code, in this process, on file storage (as bench.vision): registration
(``register_model``); one concept per class collected (``collect_statistics``) and published as a
collection job publishes it; the universe of every class concept (``submit_universe`` + the
workers' ``run_job``), timed; then the unlearn variant of each of ``--variants`` classes
(``submit_variant`` + ``run_job``, α = 1, the universe as reference), timed, with the variant job's
own step times; next to two floors (medians of 5): ``shutil.copyfile`` of the base checkpoint, and
the same copy through safetensors (``load_file`` + ``save_file``: every tensor read and written,
what any writer of a new checkpoint does at least; the variant job's ``write`` step compares with it).
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import colorsys  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from bench.universe import run_pending, service_context  # noqa: E402

SIDE = 16
HUES = 10


def make_images(classes: int, per_class: int, seed: int = 0) -> tuple[list[Image.Image], list[int]]:
    """``per_class`` images of each class: digit ``c % 10`` in hue ``c // 10`` (see the module notes)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for label in range(classes):
        hue = (label // 10 % HUES) / HUES
        colour = np.array(colorsys.hsv_to_rgb(hue, 0.9, 1.0)) * 255
        pool = np.flatnonzero(digits.target == label % 10)
        for index in rng.choice(pool, size=per_class, replace=per_class > pool.size):
            ink = digits.images[index] / 16.0  # 8×8 in [0, 1]
            background = rng.uniform(0, 40, size=3)
            pixels = ink[..., None] * colour + (1 - ink[..., None]) * background
            image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).resize((SIDE, SIDE), Image.Resampling.BILINEAR)
            images.append(image)
            labels.append(label)
    return images, labels


def make_classifier(path: Path, classes: int, seed: int = 0) -> Path:
    """A random ResNet classifier of ``classes`` classes with its image processor config, saved at ``path``."""
    from transformers import ConvNextImageProcessor, ResNetConfig, ResNetForImageClassification

    labels = {index: f"class_{index}" for index in range(classes)}
    config = ResNetConfig(
        embedding_size=32,
        hidden_sizes=[64, 128, 256],
        depths=[1, 1, 1],
        layer_type="basic",
        id2label=labels,
        label2id={name: index for index, name in labels.items()},
    )
    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    ResNetForImageClassification(config).save_pretrained(path, safe_serialization=True)
    ConvNextImageProcessor(size={"shortest_edge": SIDE}).save_pretrained(path)
    return path


def _copy_floor(checkpoint: Path, scratch: Path, repeats: int = 5) -> float:
    times = []
    for attempt in range(repeats):
        started = time.perf_counter()
        shutil.copyfile(checkpoint, scratch / f"copy-{attempt}.safetensors")
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _safetensors_floor(checkpoint: Path, scratch: Path, repeats: int = 5) -> float:
    from safetensors.torch import load_file, save_file

    times = []
    for attempt in range(repeats):
        started = time.perf_counter()
        save_file(load_file(str(checkpoint)), str(scratch / f"resaved-{attempt}.safetensors"), metadata={"format": "pt"})
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_scale(classes: int = 100, per_class: int = 20, variants: int = 5, seed: int = 0) -> dict[str, Any]:
    """The universe's build time, each class variant's time and steps, and the copy floor."""
    from bench.vision import publish_concept
    from service.engine.checkpoint import load_model
    from service.engine.collect import PixelBatch, collect_statistics
    from service.engine.images import load_image_processor, pixel_batches
    from service.models.inspection import register_model
    from service.universes.service import submit_universe
    from service.variants.service import coefficients_for_unlearn, submit_variant, variant_view

    torch.set_num_threads(1)
    images, labels = make_images(classes, per_class, seed)
    with tempfile.TemporaryDirectory(prefix="bench-vision-scale-") as tmp:
        root = Path(tmp)
        model_dir = make_classifier(root / "base", classes, seed)
        ctx = service_context(root)
        model_id = f"scale/resnet-{classes}"
        record, _ = register_model(ctx, model_id, f"file://{model_dir}")
        model = load_model(model_dir, dtype=torch.float32)
        processor = load_image_processor(model_dir)
        started = time.perf_counter()
        for label in range(classes):
            chosen = [image for image, y in zip(images, labels, strict=True) if y == label]
            batches = [PixelBatch(values) for values in pixel_batches(processor, chosen, 64, 3)]
            stats = collect_statistics(model, batches, record.layout.layers)
            publish_concept(ctx, model_id, f"class{label}", stats, len(chosen), root)
        collect_s = time.perf_counter() - started
        started = time.perf_counter()
        universe, _ = submit_universe(ctx, model_id, [f"class{c}" for c in range(classes)], None)
        run_pending(ctx)
        universe_s = time.perf_counter() - started
        options = {"scaling": "uniform", "format": "checkpoint", "universe": universe.universe_id}
        chosen_classes = [int(c) for c in np.linspace(0, classes - 1, variants).round()]
        variant_s, steps = [], []
        for label in chosen_classes:
            started = time.perf_counter()
            view, _ = submit_variant(ctx, model_id, coefficients_for_unlearn([f"class{label}"], 1.0), 1.0, options)
            [job] = run_pending(ctx)
            variant_s.append(time.perf_counter() - started)
            assert variant_view(ctx, view.variant_id).status == "ready"
            steps.append(job.result["steps"])
        checkpoint = model_dir / "model.safetensors"
        checkpoint_bytes = checkpoint.stat().st_size
        floor = _copy_floor(checkpoint, root)
        resave = _safetensors_floor(checkpoint, root)
    median = statistics.median(variant_s)
    return {
        "classes": classes,
        "images": len(images),
        "parameters": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": checkpoint_bytes,
        "editable_layers": len(record.layout.layers),
        "collect_s_total": round(collect_s, 3),
        "universe_build_s": round(universe_s, 3),
        "variant_classes": chosen_classes,
        "variant_s": [round(v, 3) for v in variant_s],
        "variant_s_median": round(median, 3),
        "variant_steps_median": {k: round(statistics.median(s[k] for s in steps), 4) for k in steps[0]},
        "copy_floor_s": round(floor, 4),
        "variant_over_copy": round(median / floor, 1) if floor > 0 else None,
        "safetensors_floor_s": round(resave, 4),
        "threads": torch.get_num_threads(),
    }


def scale_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['classes']} class concepts ({result['images']} images, {result['parameters']} parameters, "
        f"{result['editable_layers']} editable layers)",
        f"  collection, every class:        {result['collect_s_total']:8.2f} s",
        f"  universe build (once):          {result['universe_build_s']:8.2f} s",
        f"  one class variant (median of {len(result['variant_s'])}): {result['variant_s_median']:8.3f} s  "
        f"{result['variant_s']}",
        f"  checkpoint copy floor:          {result['copy_floor_s']:8.4f} s  "
        f"(variant / copy: {result['variant_over_copy']})",
        f"  safetensors read + write floor: {result['safetensors_floor_s']:8.4f} s",
        f"  variant job steps (median s):   {json.dumps(result['variant_steps_median'])}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--images", type=int, default=20, help="images per class")
    parser.add_argument("--variants", type=int, default=5, help="class variants to time")
    parser.add_argument("--out", type=Path, default=None)
    arguments = parser.parse_args(argv)
    result = measure_scale(arguments.classes, arguments.images, arguments.variants)
    print(scale_table(result))
    if arguments.out:
        arguments.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
