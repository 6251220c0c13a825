"""Concept records, their tokenization, and padding-safe batches.

A record is ``{"text"}`` (every token enters the statistics), ``{"prompt", "completion"}`` (the
model reads both, only completion tokens enter the statistics) or ``{"messages": [{"role",
"content"}, …]}`` (a conversation rendered with the model's chat template; only the assistant turns
enter the statistics: :mod:`service.engine.chat`). Tokenization of the first two mirrors ai-engram's
``edit_llm`` exactly (prompt with special tokens, completion without) so the two agree to the token.

Batches are right-padded: with causal attention a real token never attends to a pad that comes
after it, and position ids count from the first real token, so padding changes no statistic.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.engine.chat import encode_chat
from service.engine.messages import ROLES, Message, RecordError

if TYPE_CHECKING:  # annotations only: a tokenizer is loaded by the caller, batches are built in _pad
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = ["ROLES", "TEMPLATES", "Message", "Record", "RecordError"]


TEMPLATES = ("chat",)  # a concept's ``template`` option: prompt/completion records as one-turn chats


@dataclass(frozen=True)
class Record:
    """One concept record: ``text`` alone, ``prompt`` with ``completion``, or ``messages``."""

    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[Message, ...] | None = None

    @property
    def kind(self) -> str:
        """``"text"``, ``"prompt"`` (prompt/completion) or ``"messages"``."""
        return "text" if self.text is not None else "messages" if self.messages is not None else "prompt"

    def as_chat(self) -> tuple[Message, ...]:
        """The conversation this record is under a concept's ``template: "chat"``: its messages, or a
        prompt/completion pair as one user turn and one assistant turn.

        Raises:
            RecordError: a text record (it has no turns to render).
        """
        if self.messages is not None:
            return self.messages
        if self.text is not None:
            raise RecordError('a text record cannot be rendered as a chat (template "chat" takes prompt/completion)')
        return (Message("user", self.prompt or ""), Message("assistant", self.completion or ""))

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
        unknown = set(raw) - {"text", "prompt", "completion", "messages"}
        if unknown:
            raise RecordError(f"record {index} has unknown field(s) {sorted(unknown)}")
        has_text = "text" in raw
        has_pair = "prompt" in raw or "completion" in raw
        has_messages = "messages" in raw
        if has_text + has_pair + has_messages != 1:
            raise RecordError(f"record {index} must have exactly one of 'text', 'prompt'+'completion' or 'messages'")
        if has_messages:
            return cls(messages=_messages(raw["messages"], index))
        fields = ["text"] if has_text else ["prompt", "completion"]
        for field in fields:
            value = raw.get(field)
            if not isinstance(value, str) or not value.strip():
                raise RecordError(f"record {index}: '{field}' must be a non-empty string{_got(raw, field)}")
            _check_unicode(value, f"record {index}: '{field}'")
        return cls(**{f: raw[f] for f in fields})

    def to_json(self) -> dict[str, Any]:
        """The record as the user sent it (without absent fields)."""
        if self.text is not None:
            return {"text": self.text}
        if self.messages is not None:
            return {"messages": [{"role": m.role, "content": m.content} for m in self.messages]}
        return {"prompt": self.prompt or "", "completion": self.completion or ""}


_JSON_TYPES = ((bool, "a boolean"), (int, "a number"), (float, "a number"), (dict, "an object"), (list, "an array"))


def _got(raw: dict[str, Any], field: str) -> str:
    """What a record holds instead of a non-empty string, for the message: a user whose ``text`` is
    a nested object or a null (a Parquet null, a CSV-to-JSON export) should read that, not guess."""
    if field not in raw:
        return " (it is missing)"
    value = raw[field]
    if value is None:
        return ", got null"
    if isinstance(value, str):
        return ", got an empty string" if not value else ", got only whitespace"
    return f", got {next((name for kind, name in _JSON_TYPES if isinstance(value, kind)), type(value).__name__)}"


def _messages(raw: Any, index: int) -> tuple[Message, ...]:
    """A conversation checked: a non-empty list of ``{"role", "content"}`` objects with known roles and
    string contents, at least one assistant turn (non-blank), not opening with the assistant."""
    where = f"record {index}"
    if not isinstance(raw, list) or not raw:
        raise RecordError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    messages = []
    for i, item in enumerate(raw):
        at = f"{where}: message {i}"
        if not isinstance(item, dict):
            raise RecordError(f"{at} is not a JSON object")
        if set(item) != {"role", "content"}:
            extra, missing = sorted(set(item) - {"role", "content"}), sorted({"role", "content"} - set(item))
            what = f"unknown field(s) {extra}" if extra else f"no {' or '.join(repr(m) for m in missing)}"
            raise RecordError(f"{at} has {what} (a message is {{role, content}})")
        role, content = item["role"], item["content"]
        if not isinstance(role, str) or role not in ROLES:
            raise RecordError(f"{at} has role {role!r:.60}; a role is one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise RecordError(f"{at}: 'content' must be a string")
        if role == "assistant" and not content.strip():
            raise RecordError(f"{at}: an assistant message must have non-empty content (its tokens are counted)")
        _check_unicode(content, f"{at}: 'content'")
        messages.append(Message(role, content))
    if not any(m.role == "assistant" for m in messages):
        raise RecordError(f"{where} has no assistant message: only assistant turns enter the statistics")
    if messages[0].role == "assistant":
        raise RecordError(f"{where}: message 0 is an assistant message; a conversation opens with another role")
    return tuple(messages)


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
    """A tokenized record: ids and which positions enter the statistics.

    ``cut`` is how many tokens ``max_length`` truncated away (counted or not), so that a collection
    can say which records it shortened instead of shortening them silently.
    """

    input_ids: list[int]
    counted: list[bool]
    cut: int = 0


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors ``[B, T]``; ``counted`` is False on pads and prompt tokens."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    counted: torch.Tensor

    @property
    def num_counted(self) -> int:
        return int(self.counted.sum())


def encode_record(
    tokenizer: PreTrainedTokenizerBase, record: Record, max_length: int, template: str | None = None, index: int = 0
) -> Example:
    """Tokenize one record, truncated to ``max_length`` tokens (the example says how many were cut).

    Args:
        template: ``"chat"``: a prompt/completion record is rendered as a one-turn chat (messages
            records always are).
        index: the record's position, for error messages.

    Raises:
        RecordError: a conversation the model's chat template cannot render with its counted tokens
            told apart (see :func:`service.engine.chat.encode_chat`), or no chat template.
    """
    if record.messages is not None or template == "chat":
        try:
            ids, counted = encode_chat(tokenizer, record.as_chat())
        except RecordError as exc:
            raise RecordError(f"record {index}: {exc}") from None
        return Example(ids[:max_length], counted[:max_length], max(0, len(ids) - max_length))
    if record.text is not None:
        # The tokenizer truncates (keeping the special tokens it adds at the end, as ai-engram does);
        # only a record that reached the limit is tokenized whole, to count what was cut.
        ids = tokenizer(record.text, add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
        cut = 0
        if len(ids) >= max_length:
            cut = len(tokenizer(record.text, add_special_tokens=True)["input_ids"]) - len(ids)
        return Example(list(ids), [True] * len(ids), cut)
    prompt_ids = tokenizer(record.prompt, add_special_tokens=True)["input_ids"]
    answer_ids = tokenizer(record.completion, add_special_tokens=False)["input_ids"]
    ids = (list(prompt_ids) + list(answer_ids))[:max_length]
    counted = ([False] * len(prompt_ids) + [True] * len(answer_ids))[:max_length]
    return Example(ids, counted, len(prompt_ids) + len(answer_ids) - len(ids))


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
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
    import torch  # here, not at the top: the API validates records with this module and never imports torch

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
