"""GradDiff and NPO: the two gradient baselines of mini-TOFU's table, a short training loop each.

Not part of the service (issue 26 asks for them in ``bench/``): they fine-tune a copy of the base
model on the forget facts (and, as OpenUnlearning's defaults do, the retain facts), with the loss
on the answer tokens only, as the facts were learned.

* **GradDiff** (OpenUnlearning's ``GradDiff``): ``L = −NLL(forget) + γ·NLL(retain)``: gradient
  ascent on the forget answers, descent on the retain answers.
* **NPO** (Zhang et al. 2024; OpenUnlearning's ``NPO`` with its retain term):
  ``L = −(2/β)·mean log σ(−β·(log π(y|x) − log π_ref(y|x))) + γ·NLL(retain)`` on each forget
  answer's summed log-likelihood under the model and under the frozen base model (``π_ref``).

Both count what they spend: sequences through a forward pass and through a backward pass (the
reference model's forward passes included), and the wall time.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from service.engine.evaluate import TextProbe, encode_probe

Method = Literal["graddiff", "npo"]


@dataclass(frozen=True)
class Settings:
    """The loop's hyperparameters (OpenUnlearning's shape: epochs over the forget set, a retain
    batch beside each forget batch, AdamW)."""

    epochs: int = 10
    batch_size: int = 8
    lr: float = 5e-4
    retain_weight: float = 1.0  # γ
    beta: float = 0.1  # NPO's β
    seed: int = 0


@dataclass(frozen=True)
class Spent:
    """What a run cost."""

    seconds: float
    forward: int  # sequences through a forward pass
    backward: int  # sequences through a backward pass
    steps: int


def _batch(
    tokenizer: PreTrainedTokenizerBase, probes: Sequence[TextProbe]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 but on answer tokens)."""
    encoded = [encode_probe(tokenizer, p) for p in probes]
    width = max(len(prompt) + len(answer) for prompt, answer in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    for row, (prompt, answer) in enumerate(encoded):
        sequence = list(prompt) + list(answer)
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
        labels[row, len(prompt) : len(sequence)] = torch.tensor(answer)
    return ids, mask, labels


def _answer_logprob(model: PreTrainedModel, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per sequence: the summed log-probability of its answer tokens, and its token count."""
    ids, mask, labels = batch
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = labels[:, 1:]
    keep = targets != -100
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logprobs * keep).sum(dim=1)


def _mean_nll(model: PreTrainedModel, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean answer-token NLL of the batch (the loss the facts were learned with)."""
    ids, mask, labels = batch
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100)


def unlearn(
    base: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    forget: Sequence[TextProbe],
    retain: Sequence[TextProbe],
    method: Method,
    settings: Settings = Settings(),
) -> tuple[PreTrainedModel, Spent]:
    """A copy of ``base`` unlearned by ``method`` on ``forget`` (keeping ``retain``), and what it cost."""
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    model = copy.deepcopy(base)
    model.train()
    reference = base.eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    forward = backward = steps = 0
    forget, retain = list(forget), list(retain)
    for _ in range(settings.epochs):
        order = rng.sample(forget, len(forget))
        for start in range(0, len(order), settings.batch_size):
            forget_batch = _batch(tokenizer, order[start : start + settings.batch_size])
            retain_batch = _batch(tokenizer, rng.sample(retain, min(settings.batch_size, len(retain))))
            n_forget, n_retain = forget_batch[0].shape[0], retain_batch[0].shape[0]
            if method == "graddiff":
                forget_loss = -_mean_nll(model, forget_batch)
            else:
                with torch.no_grad():
                    ref = _answer_logprob(reference, forget_batch)
                forward += n_forget  # the reference model's pass
                ratio = _answer_logprob(model, forget_batch) - ref
                forget_loss = -(2.0 / settings.beta) * F.logsigmoid(-settings.beta * ratio).mean()
            loss = forget_loss + settings.retain_weight * _mean_nll(model, retain_batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            forward += n_forget + n_retain
            backward += n_forget + n_retain
            steps += 1
    model.eval()
    return model, Spent(time.perf_counter() - started, forward, backward, steps)
