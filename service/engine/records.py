"""Concept records, their tokenization, and padding-safe batches.

A record is ``{"text"}`` (every token enters the statistics), ``{"prompt", "completion"}`` (the
model reads both, only completion tokens enter the statistics) or ``{"messages": [{"role",
"content"}, …]}`` (a conversation rendered with the model's chat template; only the assistant turns
enter the statistics: :mod:`service.engine.chat`). ShareGPT, Alpaca and content-part records are
read as these (:mod:`service.engine.record_shapes`). Tokenization of the first two mirrors ai-engram's
``edit_llm`` exactly (prompt with special tokens, completion without) so the two agree to the token.

Every text is cut to a character budget before it is tokenized (:mod:`service.engine.record_budget`):
a record of any size costs bounded tokenizer memory, and one within the budget is tokenized exactly
as without it.

Batches are right-padded: with causal attention a real token never attends to a pad that comes
after it, and position ids count from the first real token, so padding changes no statistic.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.engine.chat import Renderer, encode_conversation
from service.engine.messages import ROLES, Message, RecordError
from service.engine.record_budget import count_tokens, cut
from service.engine.record_shapes import alpaca_pair, message_fields, shape_of

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
    def from_mapping(cls, raw: Any, where: int | str) -> Record:
        """Validate one JSON object, in any shape :mod:`service.engine.record_shapes` reads.

        Args:
            raw: the decoded JSON value.
            where: how the record is named in a message: where the user finds it in what they sent
                (``"dataset line 7"``, ``"dataset row 12"``), or its index in ``records`` (an int:
                ``"record 3"``).

        Returns:
            The canonical record (ShareGPT turns, Alpaca fields and content parts read as they mean).

        Raises:
            RecordError: not an object, unknown keys, both or neither kinds, empty strings, a turn
                the statistics cannot represent.
        """
        where = f"record {where}" if isinstance(where, int) else where
        if not isinstance(raw, dict):
            raise RecordError(f"{where} is not a JSON object")
        shape = shape_of(raw, where)
        if shape in {"messages", "conversations"}:
            return cls(messages=_messages(raw[shape], where, shape))
        fields = {"text": ["text"], "prompt": ["prompt", "completion"], "alpaca": ["instruction", "output"]}[shape]
        for field in fields:
            _check_string(raw, field, where)
        if shape == "alpaca":
            prompt, completion = alpaca_pair(raw, where)
            _check_unicode(prompt, f"{where}: 'input'")
            return cls(prompt=prompt, completion=completion)
        return cls(**{f: raw[f] for f in fields})

    def to_json(self) -> dict[str, Any]:
        """The record in its canonical shape (without absent fields): what is stored and hashed."""
        if self.text is not None:
            return {"text": self.text}
        if self.messages is not None:
            return {"messages": [m.as_dict() for m in self.messages]}
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


def _check_string(raw: dict[str, Any], field: str, where: str) -> None:
    value = raw.get(field)
    if not isinstance(value, str) or not value.strip():
        raise RecordError(f"{where}: '{field}' must be a non-empty string{_got(raw, field)}")
    _check_unicode(value, f"{where}: '{field}'")


def _messages(raw: Any, where: str, field: str = "messages") -> tuple[Message, ...]:
    """A conversation checked: a non-empty list of turns (:func:`~service.engine.record_shapes.message_fields`)
    with known roles and text contents, at least one assistant turn (non-blank), not opening with the
    assistant."""
    if not isinstance(raw, list) or not raw:
        raise RecordError(f"{where}: '{field}' must be a non-empty list of {{role, content}} objects")
    messages = []
    for i, item in enumerate(raw):
        at = f"{where}: message {i}"
        role, content, name = message_fields(item, at)
        if not isinstance(role, str) or role not in ROLES:
            raise RecordError(f"{at} has role {role!r:.60}; a role is one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            got = "null" if content is None else type(content).__name__
            raise RecordError(f"{at}: 'content' must be a string or a list of text parts, got {got}")
        if role == "assistant" and not content.strip():
            raise RecordError(f"{at}: an assistant message must have non-empty content (its tokens are counted)")
        _check_unicode(content, f"{at}: 'content'")
        if name is not None:
            _check_unicode(name, f"{at}: 'name'")
        messages.append(Message(role, content, name))
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
    tokenizer: PreTrainedTokenizerBase,
    record: Record,
    max_length: int,
    template: str | None = None,
    index: int | str = 0,
    *,
    budget: int | None = None,
    renderer: Renderer | None = None,
) -> Example:
    """Tokenize one record, truncated to ``max_length`` tokens (the example says how many were cut).

    Args:
        template: ``"chat"``: a prompt/completion record is rendered as a one-turn chat (messages
            records always are).
        index: the record's position (``record i`` in a message), or how a message names it.
        budget: characters of each text that are tokenized
            (:func:`service.engine.record_budget.char_budget`; ``None``: all of them). A record within
            it is tokenized exactly as without it; the tokens beyond it are only counted.
        renderer: what renders chat templates (default: ``apply_chat_template`` in this process).

    Raises:
        RecordError: a conversation the model's chat template cannot render with its counted tokens
            told apart (see :func:`service.engine.chat.encode_conversation`), or no chat template.
    """
    if record.messages is not None or template == "chat":
        try:
            ids, counted, beyond = encode_conversation(tokenizer, record.as_chat(), renderer, budget)
        except RecordError as exc:
            raise type(exc)(f"{f'record {index}' if isinstance(index, int) else index}: {exc}") from None
        return Example(ids[:max_length], counted[:max_length], max(0, len(ids) - max_length) + beyond)
    if record.text is not None:
        return _encode_text(tokenizer, record.text, max_length, budget)
    return _encode_pair(tokenizer, record.prompt or "", record.completion or "", max_length, budget)


def _encode_text(tokenizer: PreTrainedTokenizerBase, text: str, max_length: int, budget: int | None) -> Example:
    # The tokenizer truncates (keeping the special tokens it adds at the end, as ai-engram does);
    # only a record that reached the limit is counted whole (a piece at a time beyond the budget).
    head, rest = cut(text, budget)
    ids = tokenizer(head, add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
    if len(ids) < max_length and not rest:
        return Example(list(ids), [True] * len(ids), 0)
    whole = _count(tokenizer, text, budget, special=True)
    return Example(list(ids), [True] * len(ids), whole - len(ids))


def _encode_pair(
    tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str, max_length: int, budget: int | None
) -> Example:
    (prompt_head, prompt_rest), (answer_head, answer_rest) = cut(prompt, budget), cut(completion, budget)
    prompt_ids = tokenizer(prompt_head, add_special_tokens=True)["input_ids"]
    answer_ids = tokenizer(answer_head, add_special_tokens=False)["input_ids"]
    if prompt_rest and len(prompt_ids) < max_length:  # a prompt cut short of max_length tokens (see record_budget)
        answer_ids = []  # the answer does not follow a cut prompt
    ids = (list(prompt_ids) + list(answer_ids))[:max_length]
    counted = ([False] * len(prompt_ids) + [True] * len(answer_ids))[:max_length]
    whole = len(prompt_ids) if not prompt_rest else _count(tokenizer, prompt, budget, special=True)
    whole += len(answer_ids) if not answer_rest and answer_ids else _count(tokenizer, completion, budget)
    return Example(ids, counted, whole - len(ids))


def _count(tokenizer: PreTrainedTokenizerBase, text: str, budget: int | None, *, special: bool = False) -> int:
    """The tokens of all of ``text`` (a piece at a time beyond a budget: bounded memory)."""
    if budget is None:
        return len(tokenizer(text, add_special_tokens=special)["input_ids"])
    return count_tokens(tokenizer, text, budget, special=special)


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
