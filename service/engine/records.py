"""Concept records, their tokenization, and padding-safe batches.

A record is ``{"text"}`` (every token enters the statistics) or ``{"prompt", "completion"}`` (the
model reads both, only completion tokens enter the statistics). Tokenization mirrors ai-engram's
``edit_llm`` exactly (prompt with special tokens, completion without) so the two agree to the token.

Batches are right-padded: with causal attention a real token never attends to a pad that comes
after it, and position ids count from the first real token, so padding changes no statistic.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


class RecordError(ValueError):
    """A record that cannot be used, with a message naming it."""


@dataclass(frozen=True)
class Record:
    """One concept record: ``text`` alone, or ``prompt`` with ``completion``."""

    text: str | None = None
    prompt: str | None = None
    completion: str | None = None

    @classmethod
    def from_mapping(cls, raw: Any, index: int) -> Record:
        """Validate one JSON object.

        Args:
            raw: the decoded JSON value.
            index: its position, for the error message.

        Returns:
            The record.

        Raises:
            RecordError: not an object, unknown keys, both or neither kinds, empty strings.
        """
        if not isinstance(raw, dict):
            raise RecordError(f"record {index} is not a JSON object")
        unknown = set(raw) - {"text", "prompt", "completion"}
        if unknown:
            raise RecordError(f"record {index} has unknown field(s) {sorted(unknown)}")
        has_text = "text" in raw
        has_pair = "prompt" in raw or "completion" in raw
        if has_text == has_pair:
            raise RecordError(f"record {index} must have either 'text' or 'prompt'+'completion', not both")
        fields = ["text"] if has_text else ["prompt", "completion"]
        for field in fields:
            value = raw.get(field)
            if not isinstance(value, str) or not value.strip():
                raise RecordError(f"record {index}: '{field}' must be a non-empty string")
            _check_unicode(value, f"record {index}: '{field}'")
        return cls(**{f: raw[f] for f in fields})

    def to_json(self) -> dict[str, str]:
        """The record as the user sent it (without absent fields)."""
        if self.text is not None:
            return {"text": self.text}
        return {"prompt": self.prompt or "", "completion": self.completion or ""}


def _check_unicode(value: str, name: str) -> None:
    """Refuse a string that is not Unicode text: JSON's ``"\\ud800"`` decodes to a lone UTF-16
    surrogate, which no UTF-8 file, tokenizer or response can hold."""
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(value[exc.start])
        raise RecordError(f"{name} holds a lone surrogate (\\u{code:04x}) at character {exc.start}: not text") from None


@dataclass(frozen=True)
class Example:
    """A tokenized record: ids and which positions enter the statistics."""

    input_ids: list[int]
    counted: list[bool]


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors ``[B, T]``; ``counted`` is False on pads and prompt tokens."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    counted: torch.Tensor

    @property
    def num_counted(self) -> int:
        return int(self.counted.sum())


def encode_record(tokenizer: Any, record: Record, max_length: int) -> Example:
    """Tokenize one record, truncated to ``max_length`` tokens."""
    if record.text is not None:
        ids = tokenizer(record.text, add_special_tokens=True, truncation=True, max_length=max_length)[
            "input_ids"
        ]
        return Example(list(ids), [True] * len(ids))
    prompt_ids = tokenizer(record.prompt, add_special_tokens=True)["input_ids"]
    answer_ids = tokenizer(record.completion, add_special_tokens=False)["input_ids"]
    ids = (list(prompt_ids) + list(answer_ids))[:max_length]
    counted = ([False] * len(prompt_ids) + [True] * len(answer_ids))[:max_length]
    return Example(ids, counted)


def pad_token_id(tokenizer: Any) -> int:
    """The id used for padding: the pad token, else EOS, else 0 (pads are masked either way)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def make_batches(examples: Sequence[Example], batch_size: int, pad_id: int) -> Iterator[Batch]:
    """Group examples into right-padded batches.

    Examples are sorted by length first so a batch wastes little compute on padding; the order
    cannot change a statistic beyond float rounding because every token is summed.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i].input_ids))
    for start in range(0, len(order), batch_size):
        chunk = [examples[i] for i in order[start : start + batch_size]]
        yield _pad(chunk, pad_id)


def _pad(chunk: Sequence[Example], pad_id: int) -> Batch:
    width = max(len(e.input_ids) for e in chunk)
    ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(chunk), width), dtype=torch.long)
    counted = torch.zeros((len(chunk), width), dtype=torch.bool)
    for row, example in enumerate(chunk):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids, dtype=torch.long)
        attention[row, :n] = 1
        counted[row, :n] = torch.tensor(example.counted, dtype=torch.bool)
    return Batch(ids, attention, counted)
