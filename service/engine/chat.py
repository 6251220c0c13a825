"""Conversations rendered with a model's chat template, and which of their tokens are counted.

The counting rule: for each assistant message ``i``, the counted tokens are those of
``render(messages[:i+1])`` beyond ``render(messages[:i], add_generation_prompt=True)``: the turn's
content and whatever the template adds to close it (an end-of-turn token). Every other token
(system prompt, user turns, role headers, the generation prompt) is read by the model but not
counted. The whole conversation is rendered once and fed to the model; the rule's spans are
positions in it.

That only works when each shorter render is a *token prefix* of the longer one (a template that
rewrites earlier turns, e.g. drops past reasoning, or a tokenizer that merges across the boundary,
breaks it). Every render is checked; a conversation that breaks the property is refused with a
message that says which render, never counted approximately.

Renders are tokenized the way ``apply_chat_template(tokenize=True)`` does (no special tokens added:
the template writes its own BOS).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from service.engine.messages import Message, RecordError

if TYPE_CHECKING:  # annotations only: a tokenizer is loaded by the caller
    from transformers import PreTrainedTokenizerBase

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


class NoChatTemplate(RecordError):
    """The model's tokenizer has no chat template."""


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def folder_has_chat_template(folder: Path) -> bool | None:
    """Whether a model folder ships a chat template, read from its allowlisted tokenizer files only
    (``chat_template.jinja``, ``chat_template.json``, ``tokenizer_config.json``'s ``chat_template``),
    without loading the tokenizer. ``None`` when the folder cannot be read here (a worker will know).
    """
    from service.engine.model_files import ModelSourceError, present, read_bytes, read_side_json, resolve_file

    try:
        if not folder.is_dir():
            return None
        for name in TEMPLATE_FILES:
            if not present(folder, name):
                continue
            if name.endswith(".jinja"):
                if read_bytes(resolve_file(folder, name)).strip():
                    return True
                continue
            # read_side_json: a file too large or nested too deeply is refused, not a crash of the request
            value = read_side_json(folder, name).get("chat_template")
            if isinstance(value, str) and value.strip():
                return True
            if isinstance(value, list) and any(isinstance(t, dict) and t.get("template") for t in value):
                return True
    except (OSError, ValueError, AttributeError, ModelSourceError):
        return None  # unreadable here: the job loads the tokenizer and says
    return False


def _as_dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    return [m.as_dict() for m in messages]


def render_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], add_generation_prompt: bool = False
) -> list[int]:
    """The token IDs of ``messages`` rendered by the model's chat template.

    Raises:
        NoChatTemplate: the tokenizer has none.
        RecordError: the template fails on these messages (its message says why).
    """
    if not has_chat_template(tokenizer):
        raise NoChatTemplate("the model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
    try:
        ids = tokenizer.apply_chat_template(
            _as_dicts(messages), tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
    except Exception as exc:  # jinja's TemplateError, raise_exception() inside the template, ...
        raise RecordError(f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}") from None
    return _token_ids(ids)


def _token_ids(rendered: object) -> list[int]:
    """``apply_chat_template``'s result for one conversation with ``tokenize=True, return_dict=False``:
    a list of token IDs (its declared return type is the union of every mode's)."""
    if not isinstance(rendered, list):
        raise RecordError(f"the chat template gave {type(rendered).__name__}, not a list of token IDs")
    return [int(i) for i in rendered]


def _check_prefix(shorter: list[int], longer: list[int], what: str) -> None:
    if longer[: len(shorter)] != shorter:
        raise RecordError(
            f"the chat template breaks the prefix property: {what}, so the turn's tokens cannot be told apart "
            "(a template that rewrites earlier turns, or tokens merged across the turn boundary)"
        )


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> tuple[list[int], list[bool]]:
    """The rendered conversation and which of its tokens are counted (the assistant turns).

    Raises:
        NoChatTemplate: the tokenizer has none.
        RecordError: a render fails, or breaks the prefix property (naming the message).
    """
    ids = render_ids(tokenizer, messages)
    counted = [False] * len(ids)
    for i, message in enumerate(messages):
        if message.role != "assistant":
            continue
        start, stop = turn_span(tokenizer, messages, i, ids)
        for position in range(start, stop):
            counted[position] = True
    return ids, counted


def turn_span(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], i: int, whole: list[int] | None = None
) -> tuple[int, int]:
    """Where assistant message ``i``'s counted tokens lie in the render of ``messages`` (or of
    ``messages[:i+1]`` when ``whole`` is not given): ``[start, stop)``.

    Raises:
        RecordError: message ``i`` is the first (there is no prompt to render before it), a render
            fails, or the prefix property breaks.
    """
    if i == 0:
        raise RecordError("message 0 is an assistant message; a conversation opens with another role")
    prompt = render_ids(tokenizer, messages[:i], add_generation_prompt=True)
    through = render_ids(tokenizer, messages[: i + 1])
    _check_prefix(prompt, through, f"messages[:{i}] with the generation prompt is not a token prefix of messages[:{i + 1}]")
    if whole is not None:
        _check_prefix(through, whole, f"messages[:{i + 1}] is not a token prefix of the whole conversation")
    if len(through) == len(prompt):
        raise RecordError(f"assistant message {i} renders to no tokens")
    return len(prompt), len(through)


def last_turn(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> tuple[list[int], list[int]]:
    """A probe's ``(prompt_ids, answer_ids)``: the conversation before its last assistant message,
    with the generation prompt, and that turn's counted tokens (messages after it are not read).

    Raises:
        RecordError: no assistant message, or as :func:`turn_span`.
    """
    turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
    if not turns:
        raise RecordError("the messages have no assistant message (the turn that is scored)")
    i = turns[-1]
    messages = messages[: i + 1]
    through = render_ids(tokenizer, messages)
    start, stop = turn_span(tokenizer, messages, i, through)
    return through[:start], through[start:stop]


def generation_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    """``messages`` rendered with the generation prompt: what a model continues to answer."""
    return render_ids(tokenizer, messages, add_generation_prompt=True)
