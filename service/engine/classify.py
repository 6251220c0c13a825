"""Run an image classifier over labelled image probes: its logits, and its penultimate features.

The penultimate features are the input of the classification head, which every
``...ForImageClassification`` model in transformers holds as its ``classifier`` module (a
``Linear``, or a ``Sequential`` such as ResNet's ``Flatten → Linear``). A forward pre-hook on that
module records what it is given, flattened to ``[B, D]`` (ResNet's pooled ``[B, C, 1, 1]``), so no
architecture's pooling is re-implemented here. A model without a ``classifier`` module that receives
one ``[B, …]`` tensor per forward is refused by name (:class:`HeadNotFound`).

Inference runs under ``torch.inference_mode`` with the model in ``eval`` mode (BatchNorm's running
statistics, no dropout); results come back as float64 on the CPU, in probe order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from service.engine.collect import PixelBatch, model_device, model_dtype

__all__ = ["HEAD_ATTRIBUTE", "Classified", "HeadNotFound", "classification_head", "classify"]

HEAD_ATTRIBUTE = "classifier"


class HeadNotFound(ValueError):
    """The model has no classification head whose input could be read (the message names the model)."""


@dataclass(frozen=True)
class Classified:
    """One model's outputs on a probe set, in probe order (float64, CPU).

    Attributes:
        logits: ``[n, classes]``.
        labels: ``[n]`` class indices (as given).
        features: ``[n, D]`` the classification head's input.
    """

    logits: torch.Tensor
    labels: torch.Tensor
    features: torch.Tensor


def classification_head(model: nn.Module) -> nn.Module:
    """The model's classification head (its ``classifier`` module).

    Raises:
        HeadNotFound: no ``classifier`` attribute, or one that is no module (an identity head of a
            model with ``num_labels=0`` is refused too: it has no classes to score).
    """
    name = type(model).__name__
    # a transformers model: only classifiers have the head attribute
    head = getattr(model, HEAD_ATTRIBUTE, None)
    if not isinstance(head, nn.Module):
        raise HeadNotFound(
            f"{name} has no `{HEAD_ATTRIBUTE}` module: its penultimate features (the input of the classification "
            "head) cannot be found; only ...ForImageClassification models are evaluated as classifiers"
        )
    if isinstance(head, nn.Identity):
        raise HeadNotFound(f"{name}'s `{HEAD_ATTRIBUTE}` is an identity (num_labels=0): it has no classes to score")
    return head


def _head_input(args: tuple[Any, ...], model_name: str) -> torch.Tensor:
    if len(args) != 1 or not isinstance(args[0], torch.Tensor) or args[0].ndim < 2:
        raise HeadNotFound(f"{model_name}'s `{HEAD_ATTRIBUTE}` is not called with one [B, …] tensor")
    return args[0].flatten(1)


def classify(model: nn.Module, batches: Iterable[PixelBatch], labels: Sequence[int] | torch.Tensor) -> Classified:
    """Logits and penultimate features of ``model`` on every image of ``batches``, with ``labels``.

    Args:
        model: A ``...ForImageClassification`` model (or any module with a ``classifier`` head whose
            forward takes ``pixel_values`` and returns ``.logits``).
        batches: The probes' pixels, in the order of ``labels``.
        labels: One class index per image.

    Raises:
        HeadNotFound: see :func:`classification_head`.
        ValueError: the batches hold a different number of images than ``labels``, or the logits
            are not ``[B, classes]``.
    """
    head = classification_head(model)
    model_name = type(model).__name__
    seen: list[torch.Tensor] = []

    def record(_module: nn.Module, args: tuple[Any, ...]) -> None:
        seen.append(_head_input(args, model_name).detach().to("cpu", torch.float64))

    device, dtype = model_device(model), model_dtype(model)
    logits: list[torch.Tensor] = []
    was_training = model.training
    handle = head.register_forward_pre_hook(record)
    try:
        model.eval()
        with torch.inference_mode():
            for batch in batches:
                output = model(pixel_values=batch.pixel_values.to(device, dtype))
                scores = output.logits
                if scores.ndim != 2 or scores.shape[0] != batch.num_counted:
                    raise ValueError(
                        f"{model_name} gave logits of shape {tuple(scores.shape)} for {batch.num_counted} images"
                    )
                logits.append(scores.detach().to("cpu", torch.float64))
    finally:
        handle.remove()
        model.train(was_training)
    targets = torch.as_tensor(labels, dtype=torch.int64).reshape(-1)
    all_logits = torch.cat(logits) if logits else torch.zeros((0, 0), dtype=torch.float64)
    if all_logits.shape[0] != targets.shape[0]:
        raise ValueError(f"{all_logits.shape[0]} images were classified but {targets.shape[0]} labels given")
    if len(seen) != len(logits):
        raise HeadNotFound(f"{model_name}'s `{HEAD_ATTRIBUTE}` was called {len(seen)} times for {len(logits)} batches")
    features = torch.cat(seen) if seen else torch.zeros((0, 0), dtype=torch.float64)
    return Classified(logits=all_logits, labels=targets, features=features)
