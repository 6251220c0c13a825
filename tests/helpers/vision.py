"""Float64 references for edits of image classifiers: a layer's ``[W | b]`` as a checkpoint stores it
(a conv's weight flattened to ``[C_out, C_in · Π kernel]``, the column order of its unfolded patches),
the unlearning formula ``W − α · W · Σ_f · Σ_U⁺`` on the published sums, and per-class accuracy
computed by plain argmax (not through the service's classify).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor

from service.engine.layers import LayerSpec
from tests.helpers.algebra import reference_pinv


def stored_augmented(
    spec: LayerSpec, tensors: Mapping[str, torch.Tensor], weight_key: str, bias_key: str | None
) -> torch.Tensor:
    """``[W | b]`` of ``spec`` from checkpoint tensors, float64, ``[out, in(+1)]`` (a conv's kernel flattened)."""
    weight = tensors[weight_key].double()
    weight = weight.T if spec.transposed else weight.reshape(spec.out_features, -1)
    if spec.bias:
        assert bias_key is not None, spec.name
        weight = torch.cat([weight, tensors[bias_key].double()[:, None]], dim=1)
    return weight


def reference_unlearn(old: torch.Tensor, forget: torch.Tensor, universe: torch.Tensor, alpha: float) -> torch.Tensor:
    """``[W | b] − α · [W | b] · Σ_f · Σ_U⁺`` in float64 (``Σ_U``: the sum of the universe's members' sums)."""
    return old - alpha * old @ forget.double() @ reference_pinv(universe)


def per_class_accuracy(
    folder: Path, model: torch.nn.Module, images: Sequence[Image.Image], labels: Sequence[int]
) -> np.ndarray:
    """Top-1 accuracy of each class (index = label), the images read by ``folder``'s image processor."""
    processor = AutoImageProcessor.from_pretrained(str(folder))
    predicted = []
    with torch.no_grad():
        for start in range(0, len(images), 128):
            pixels = processor(images=list(images[start : start + 128]), return_tensors="pt")["pixel_values"]
            predicted.append(model.eval()(pixel_values=pixels.float()).logits.argmax(dim=-1).numpy())
    guesses, truth = np.concatenate(predicted), np.asarray(labels)
    return np.array([float(np.mean(guesses[truth == c] == c)) for c in range(int(truth.max()) + 1)])
