"""The engine's collection path as its tests drive it (encode, right-pad into batches, hook every
editable layer) and records of very different lengths to drive it with. Shared by the collection
tests (``tests/engine/test_collect.py``) and those of models placed by ``device_map``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from engram_fixtures.demo import make_facts
from service.engine.collect import LayerStatistics, collect_statistics
from service.engine.editable import editable_layers
from service.engine.records import Record, encode_record, make_batches, pad_token_id

MAX_LENGTH = 120  # below the fixtures' 128 positions, so no record is ever truncated


def mixed_records(seed: int = 0) -> list[Record]:
    """Text and prompt/completion records of very different lengths (2 to ~80 tokens)."""
    rng = random.Random(seed)
    facts = make_facts(24, seed=seed)
    records = [Record(prompt=p, completion=c) for p, c in facts[:12]]
    records += [Record(text=p + c) for p, c in facts[12:20]]
    records.append(Record(text="Hi"))
    records.append(Record(text=" ".join(p + c for p, c in facts[20:22])))  # the long one
    records.append(Record(prompt="Q: Who?", completion=" " + " ".join(c.strip() for _, c in facts[:4])))
    rng.shuffle(records)
    return records


def collect(model: nn.Module, tokenizer: Any, records: Sequence[Record], batch_size: int) -> LayerStatistics:
    """The engine's path: encode, right-pad into batches, hook every editable layer."""
    examples = [encode_record(tokenizer, record, MAX_LENGTH) for record in records]
    batches = make_batches(examples, batch_size, pad_token_id(tokenizer))
    return collect_statistics(model, batches, editable_layers(model))


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())
