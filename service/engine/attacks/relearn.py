"""Relearning: a few full fine-tuning steps on part of what was forgotten, in a copy of the model.

The loop is the plainest one a customer would write, so that a test can write it again and compare:
``torch.manual_seed(seed)``; AdamW (``lr``, betas 0.9/0.999, eps 1e-8, no weight decay) over every
parameter; ``steps`` times, one batch holding every training row (right-padded), the model's own
causal-LM loss (``labels``: -100 on padding and on a probe's prompt tokens), ``backward``, ``step``.
The model is in train mode during the loop (its dropout, if any, draws from the seeded generator),
and in eval mode after it. Deterministic for a seed on one machine and thread count.

Memory: the copy's weights, their gradients and AdamW's two moments, four times the weights
(:func:`relearn_bytes`), plus the activations of one batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

IGNORE = -100  # the label the causal-LM loss skips
TrainRow = tuple[list[int], list[int]]  # (input ids, labels)


def probe_row(prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> TrainRow:
    """A probe as a training row: the answer tokens learned, the prompt only read."""
    return [*prompt_ids, *answer_ids], [IGNORE] * len(prompt_ids) + list(answer_ids)


def text_row(ids: Sequence[int]) -> TrainRow:
    """A text as a training row: every token learned (the loss shifts: the first is only read)."""
    return list(ids), list(ids)


def padded_batch(rows: Sequence[TrainRow], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)`` right-padded to the longest row (padding masked, label -100).

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("relearning needs at least one training row")
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        mask[i, : len(row_ids)] = 1
        labels[i, : len(row_labels)] = torch.tensor(row_labels, dtype=torch.long)
    return ids, mask, labels


def standalone_copy(model: Any) -> Any:
    """A copy of ``model`` that owns its weights (a PEFT model merged into its base first)."""
    copied = copy.deepcopy(model)
    if hasattr(copied, "merge_and_unload"):  # a PEFT adapter: the customer fine-tunes the merged model
        copied = copied.merge_and_unload()
    return copied


def relearn_bytes(model: torch.nn.Module) -> int:
    """Bytes a relearn copy holds besides activations: weights, gradients and AdamW's two moments."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return 4 * weights


def relearned(
    model: Any,
    rows: Sequence[TrainRow],
    steps: int,
    lr: float,
    seed: int,
    pad_id: int,
    on_step: Callable[[int, float], None] | None = None,
) -> Any:
    """A copy of ``model`` fine-tuned ``steps`` AdamW steps on ``rows`` (the module docstring's loop).

    Args:
        model: A causal LM (left unchanged).
        rows: Training rows (:func:`probe_row`, :func:`text_row`), one batch per step.
        steps: Optimizer steps (>= 1).
        lr: AdamW's learning rate (> 0).
        seed: ``torch.manual_seed`` before the loop.
        pad_id: Any valid token id for the padding.
        on_step: Called after each step with its index and loss (progress, cancellation).

    Returns:
        The fine-tuned copy, in eval mode, without gradients.

    Raises:
        ValueError: a bad ``steps`` or ``lr``, no rows, or a loss that is not finite (naming the step).
    """
    if steps < 1 or not lr > 0:
        raise ValueError(f"relearning needs steps >= 1 and lr > 0, got {steps} and {lr}")
    ids, mask, labels = padded_batch(rows, pad_id)
    attacked = standalone_copy(model)
    device = next(attacked.parameters()).device
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    params = list(attacked.parameters())
    for param in params:
        param.requires_grad_(True)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    attacked.train()
    with torch.enable_grad():
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = attacked(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            if not torch.isfinite(loss):
                raise ValueError(f"relearning's loss is not finite at step {step + 1} (lr {lr} too large?)")
            loss.backward()
            optimizer.step()
            if on_step is not None:
                on_step(step, float(loss.detach()))
    attacked.eval()
    for param in params:
        param.requires_grad_(False)
        param.grad = None
    del optimizer
    return attacked
