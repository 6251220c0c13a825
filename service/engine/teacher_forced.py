"""A probe's answer NLL and exact match from one teacher-forced forward pass.

Exact match is read from the same logits as the NLL: a probe matches when, at every completion
position, the argmax of the logits given the true prefix is the true token. That is the greedy
answer's exact match (:func:`service.engine.evaluate.greedy_exact_match`) without generating it:
greedy decoding reproduces the completion exactly when each step's argmax, fed the tokens before
it, is the next true token, and with a reproduced prefix those are the teacher-forced inputs. A
calibration scores every candidate on every probe, so one pass instead of one per answer token
is what makes exact match cheap enough to decide by (general-text paragraphs of 100 tokens
included). The NLL is computed as :func:`service.engine.evaluate.answer_nll` computes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from service.engine.evaluate import BATCH_TOKENS, encode_probe, token_batches
from service.engine.evaluate import TextProbe as Probe
from service.engine.evaluate import _logits as logits_of  # the evaluator's own forward pass
from service.engine.evaluate import _pad_id as pad_id_of
from service.engine.evaluate import _right_pad as right_pad


def nll_and_exact_match(
    model: Any, tokenizer: Any, probes: Sequence[Probe], batch_size: int = 16, batch_tokens: int = BATCH_TOKENS
) -> tuple[list[float], list[bool]]:
    """Per probe, the completion's mean NLL (nats/token) and whether its teacher-forced argmax is the
    completion (see the module docstring); batched by padded tokens as evaluate batches."""
    encoded = [encode_probe(tokenizer, p) for p in probes]
    pad_id = pad_id_of(tokenizer)
    model.eval()
    nll: list[float] = []
    match: list[bool] = []
    with torch.inference_mode():
        for rows in token_batches([len(p) + len(a) for p, a in encoded], batch_tokens, batch_size):
            batch = encoded[rows.start : rows.stop]
            ids, mask = right_pad([p + a for p, a in batch], pad_id)
            logits = logits_of(model, ids, mask)
            for i, (p_ids, a_ids) in enumerate(batch):
                # logits at position t predict token t+1: the completion is predicted from one earlier
                pred = logits[i, len(p_ids) - 1 : len(p_ids) + len(a_ids) - 1]
                target = torch.tensor(a_ids, dtype=torch.long, device=pred.device)
                nll.append(float(torch.nn.functional.cross_entropy(pred, target, reduction="mean")))
                match.append(bool(torch.equal(pred.argmax(dim=-1), target)))
    return nll, match


def scored_in_chunks(
    model: Any, tokenizer: Any, probes: Sequence[Probe], chunk: int, batch_tokens: int, advance: Callable[[int], None]
) -> tuple[list[float], list[bool]]:
    """:func:`nll_and_exact_match` of ``probes`` ``chunk`` at a time, calling ``advance(n)`` after each
    chunk (a job's progress): what ``evaluate`` and its attacks' summaries score a split with."""
    nll: list[float] = []
    match: list[bool] = []
    for start in range(0, len(probes), chunk):
        part = probes[start : start + chunk]
        part_nll, part_match = nll_and_exact_match(model, tokenizer, part, batch_size=chunk, batch_tokens=batch_tokens)
        nll += part_nll
        match += part_match
        advance(len(part))
    return nll, match
