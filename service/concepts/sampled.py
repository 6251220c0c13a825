"""A reference concept drawn from the model itself: ``POST /concepts`` with ``samples``.

A universe without general text gives an edit that is less selective. A platform without a retain
corpus can post ``{"samples": {"count", "max_new_tokens", "temperature", "seed"}}`` for one model:
its collection job first draws ``count`` texts with that model, stores them as the concept's dataset
(``datasets/<digest>.jsonl``, content-addressed like any upload: the same texts are the same
statistics), then collects them as text records.

How they are drawn (what a test reproduces with ``model.generate``): every sample starts from the
tokenizer's BOS token (its EOS where it has none) — also for chat models, whose chat template is not
rendered: the samples are the model's unconditional text distribution, the general text a reference
stands for. ``torch.manual_seed(seed)`` once (inside ``torch.random.fork_rng``: the process's own
random state is left as it was), then batches of ``ENGRAM_COLLECT_BATCH_SIZE`` in order, each
``model.generate(bos, do_sample=True, temperature, top_k=0, top_p=1.0, max_new_tokens,
min_new_tokens=max_new_tokens)``: pure temperature sampling (not the model's generation-config
truncation), every sample exactly ``max_new_tokens`` tokens (EOS is suppressed, so that no sample is
empty and a sample's size is what was asked). Decoded without special tokens. Deterministic for a
seed on one machine (and one batch size); another device or library version may draw other texts.

Memory: one batch's key/value cache at a time; the texts themselves go to a spooled file as drawn.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from service.config import Settings
from service.datasets.spool import DatasetSpool, SpooledDataset
from service.engine.probe_bound import model_context
from service.errors import InvalidInput, JobFailed
from service.jobs.collect_plan import Sampling
from service.models.record import ModelRecord


def check_sampling(settings: Settings, manifests: Mapping[str, ModelRecord], sampling: Sampling) -> None:
    """A samples request checked at submission: one text model, ``count`` and ``max_new_tokens`` in bounds.

    Raises:
        InvalidInput: several models, an image model, more samples than ENGRAM_MAX_RECORDS, or more
            tokens than the model's context leaves after its BOS token.
    """
    if len(manifests) != 1:
        raise InvalidInput(
            f"samples are drawn by one model and belong to it: name one model, not {', '.join(manifests)} "
            "(post one concept per model)"
        )
    ((model_id, manifest),) = manifests.items()
    if manifest.kind != "text":
        raise InvalidInput(f"model {model_id} is an image classifier: only a language model draws samples")
    if sampling.count > settings.max_records:
        raise InvalidInput(
            f"samples.count {sampling.count} is more than ENGRAM_MAX_RECORDS ({settings.max_records}): ask for fewer"
        )
    context = _context(Path(manifest.path))
    if context is not None and sampling.max_new_tokens >= context:
        raise InvalidInput(
            f"samples.max_new_tokens {sampling.max_new_tokens} does not fit model {model_id}'s context of {context} "
            f"tokens (max_position_embeddings) after its BOS token: ask for at most {context - 1}"
        )


def _context(folder: Path) -> int | None:
    """The model's context from its ``config.json`` (``None``: it does not say)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return model_context(SimpleNamespace(**text))


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
    """The ``sampling.count`` texts the model draws, batch by batch (see the module's docstring)."""
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
