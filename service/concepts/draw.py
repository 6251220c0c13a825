"""The drawing of a samples concept's texts in its collection job (the recipe: :mod:`service.concepts.sampled`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from service.config import Settings
from service.datasets.spool import DatasetSpool, SpooledDataset
from service.errors import JobFailed
from service.jobs.collect_plan import Sampling


def start_token(tokenizer: Any) -> int:
    """The token every sample starts from: BOS, or EOS for a tokenizer without one (GPT-2's convention).

    Raises:
        JobFailed: the tokenizer has neither.
    """
    for token in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token is not None:
            return int(token)
    raise JobFailed("the model's tokenizer has neither a BOS nor an EOS token to start samples from")


def draw_texts(model: Any, tokenizer: Any, sampling: Sampling, batch_size: int) -> Iterator[str]:
    """The ``sampling.count`` texts the model draws, batch by batch (the recipe :mod:`service.concepts.sampled` states)."""
    device = next(model.parameters()).device
    start = start_token(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.inference_mode():
        torch.manual_seed(sampling.seed)
        for begin in range(0, sampling.count, batch_size):
            ids = torch.full((min(batch_size, sampling.count - begin), 1), start, dtype=torch.long, device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=sampling.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=sampling.max_new_tokens,
                min_new_tokens=sampling.max_new_tokens,
                pad_token_id=pad,
            )
            for row in out[:, 1:].tolist():
                text = tokenizer.decode(row, skip_special_tokens=True)
                # Only special tokens drawn: kept as they read, so that every sample is a record.
                yield text if text.strip() else tokenizer.decode(row)


def spool_samples(texts: Iterator[str], path: Path, settings: Settings, on_drawn: Callable[[int], None]) -> SpooledDataset:
    """The drawn texts spooled as ``{"text"}`` records to ``path`` (hashed as an upload is), ``on_drawn``
    told the number drawn after each one (it raises to stop)."""
    with DatasetSpool(path, settings.max_records, max_record_bytes=settings.max_record_bytes) as spool:
        for drawn, text in enumerate(texts, start=1):
            spool.add({"text": text})
            on_drawn(drawn)
        return spool.finish()
