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
the template writes its own BOS). A collection renders in a bounded child process
(:mod:`service.engine.template_render`: a template is untrusted code) and cuts contents and renders
to the record budget (:mod:`service.engine.record_budget`) before tokenizing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from service.engine.messages import Message, RecordError
from service.engine.record_budget import count_tokens, cut

if TYPE_CHECKING:  # annotations only: a tokenizer is loaded by the caller
    from transformers import PreTrainedTokenizerBase

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


class NoChatTemplate(RecordError):
    """The model's tokenizer has no chat template."""


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    # a transformers tokenizer: older ones and some custom classes have no chat_template attribute
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
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    add_generation_prompt: bool = False,
    renderer: Renderer | None = None,
) -> list[int]:
    """The token IDs of ``messages`` rendered by the model's chat template: by ``renderer`` (a job's
    bounded :class:`~service.engine.template_render.TemplateProcess`) or, without one,
    ``apply_chat_template`` in this process.

    Raises:
        NoChatTemplate: the tokenizer has none.
        RecordError: the template fails on these messages (its message says why), or passes a
            renderer's bound (:class:`~service.engine.template_render.TemplateOverBudget`).
    """
    if not has_chat_template(tokenizer):
        raise NoChatTemplate("the model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
    if renderer is not None:
        (text,) = renderer.render(tokenizer, messages, [(len(messages), add_generation_prompt)])
        return _text_ids(tokenizer, text)
    try:
        ids = tokenizer.apply_chat_template(
            _as_dicts(messages), tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
    except Exception as exc:  # jinja's TemplateError, raise_exception() inside the template, ...
        raise RecordError(f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}") from None
    return _token_ids(ids)


def _text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A render's token IDs as ``apply_chat_template(tokenize=True)`` gives them: the text tokenized
    with no special tokens added (the template wrote its own)."""
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _prefix_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    prefixes: Sequence[tuple[int, bool]],
    renderer: Renderer | None,
) -> list[list[int]]:
    """``render_ids(messages[:n], add_generation_prompt)`` for each prefix; a renderer renders them
    all in one request (one round trip to its process)."""
    if renderer is None or not has_chat_template(tokenizer):
        return [render_ids(tokenizer, messages[:n], add) for n, add in prefixes]
    return [_text_ids(tokenizer, text) for text in renderer.render(tokenizer, messages, prefixes)]


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


class Renderer(Protocol):
    """What renders a conversation's prefixes: :class:`InProcess`, or the bounded child process of
    :mod:`service.engine.template_render` (collection: templates from model folders are untrusted code)."""

    def render(
        self, tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], prefixes: Sequence[tuple[int, bool]]
    ) -> list[str]: ...


class InProcess:
    """``apply_chat_template(tokenize=False)`` in this process, unbounded (the tests' reference)."""

    def render(
        self, tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], prefixes: Sequence[tuple[int, bool]]
    ) -> list[str]:
        texts = []
        for count, add_generation_prompt in prefixes:
            try:
                text = tokenizer.apply_chat_template(
                    _as_dicts(messages[:count]), tokenize=False, add_generation_prompt=add_generation_prompt
                )
            except Exception as exc:  # jinja's TemplateError, raise_exception() inside the template, ...
                raise RecordError(
                    f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}"
                ) from None
            if not isinstance(text, str):
                raise RecordError(f"the chat template gave {type(text).__name__}, not a string")
            texts.append(text)
        return texts


TURNS_PER_REQUEST = 8  # assistant turns rendered per request (a request stops at the budget)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> tuple[list[int], list[bool]]:
    """The rendered conversation and which of its tokens are counted (the assistant turns), rendered
    in this process, uncut.

    Raises:
        NoChatTemplate: the tokenizer has none.
        RecordError: a render fails, or breaks the prefix property (naming the message).
    """
    ids, counted, _ = encode_conversation(tokenizer, messages)
    return ids, counted


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    renderer: Renderer | None = None,
    budget: int | None = None,
) -> tuple[list[int], list[bool], int]:
    """The rendered conversation, which of its tokens are counted (the assistant turns), and how many
    tokens lie beyond ``budget``.

    Renders are tokenized as ``apply_chat_template(tokenize=True)`` tokenizes them (no special tokens
    added). With a ``budget`` (:mod:`service.engine.record_budget`), each message's content and each
    render are cut to that many characters before tokenizing; the tokens beyond are only counted
    (the third value), and a turn whose prompt is already past the budget is not rendered further:
    its tokens lie beyond ``max_length``.

    Raises:
        NoChatTemplate: the tokenizer has none.
        RecordError: a render fails, or breaks the prefix property (naming the message).
    """
    if not has_chat_template(tokenizer):
        raise NoChatTemplate("the model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
    renderer = InProcess() if renderer is None else renderer
    messages, beyond = _cut_contents(tokenizer, messages, budget)
    (whole_text,) = renderer.render(tokenizer, messages, [(len(messages), False)])
    ids, rest = _tokens(tokenizer, whole_text, budget)
    beyond += rest
    counted = [False] * len(ids)
    turns = [i for i, message in enumerate(messages) if message.role == "assistant"]
    if turns and turns[0] == 0:
        raise RecordError("message 0 is an assistant message; a conversation opens with another role")
    for start in range(0, len(turns), TURNS_PER_REQUEST):
        group = turns[start : start + TURNS_PER_REQUEST]
        texts = renderer.render(tokenizer, messages, [p for i in group for p in ((i, True), (i + 1, False))])
        for k, i in enumerate(group):
            prompt_text, through_text = texts[2 * k], texts[2 * k + 1]
            if budget is not None and len(prompt_text) >= budget:
                return ids, counted, beyond  # this turn and the later ones start beyond max_length
            prompt, through = _tokens(tokenizer, prompt_text, budget)[0], _tokens(tokenizer, through_text, budget)[0]
            begin, stop = _span(prompt, through, ids, i)
            for position in range(begin, stop):
                counted[position] = True
    return ids, counted, beyond


def _cut_contents(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], budget: int | None
) -> tuple[tuple[Message, ...], int]:
    """Each content cut to ``budget`` characters, and the tokens cut away (a content that long
    already reaches past ``max_length`` wherever it stands)."""
    if budget is None:
        return tuple(messages), 0
    kept, beyond = [], 0
    for message in messages:
        head, rest = cut(message.content, budget)
        if rest:
            beyond += count_tokens(tokenizer, message.content, budget) - count_tokens(tokenizer, head, budget)
            message = Message(message.role, head, message.name)
        kept.append(message)
    return tuple(kept), beyond


def _tokens(tokenizer: PreTrainedTokenizerBase, text: str, budget: int | None) -> tuple[list[int], int]:
    """A render's token IDs (of its first ``budget`` characters) and how many more the whole has."""
    head, rest = cut(text, budget)
    ids = [int(i) for i in tokenizer(head, add_special_tokens=False)["input_ids"]]
    if not rest or budget is None:
        return ids, 0
    return ids, max(0, count_tokens(tokenizer, text, budget) - len(ids))


def _span(prompt: list[int], through: list[int], whole: list[int], i: int) -> tuple[int, int]:
    """Assistant message ``i``'s counted tokens ``[start, stop)`` from its renders' tokens."""
    _check_prefix(prompt, through, f"messages[:{i}] with the generation prompt is not a token prefix of messages[:{i + 1}]")
    _check_prefix(through, whole, f"messages[:{i + 1}] is not a token prefix of the whole conversation")
    if len(through) == len(prompt):
        raise RecordError(f"assistant message {i} renders to no tokens")
    return len(prompt), len(through)


def turn_span(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    i: int,
    whole: list[int] | None = None,
    renderer: Renderer | None = None,
) -> tuple[int, int]:
    """Where assistant message ``i``'s counted tokens lie in the render of ``messages`` (or of
    ``messages[:i+1]`` when ``whole`` is not given): ``[start, stop)``.

    Raises:
        RecordError: message ``i`` is the first (there is no prompt to render before it), a render
            fails, or the prefix property breaks.
    """
    if i == 0:
        raise RecordError("message 0 is an assistant message; a conversation opens with another role")
    prompt, through = _prefix_ids(tokenizer, messages, [(i, True), (i + 1, False)], renderer)
    _check_prefix(prompt, through, f"messages[:{i}] with the generation prompt is not a token prefix of messages[:{i + 1}]")
    if whole is not None:
        _check_prefix(through, whole, f"messages[:{i + 1}] is not a token prefix of the whole conversation")
    if len(through) == len(prompt):
        raise RecordError(f"assistant message {i} renders to no tokens")
    return len(prompt), len(through)


def last_turn(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    renderer: Renderer | None = None,
    chars: int | None = None,
) -> tuple[list[int], list[int]]:
    """A probe's ``(prompt_ids, answer_ids)``: the conversation before its last assistant message,
    with the generation prompt, and that turn's counted tokens (messages after it are not read).

    The whole conversation read is ``messages[:i+1]``, the turn's own "through" render, so two
    renders give both (a ``renderer``: in one request).

    Args:
        chars: tokenize only the last ``chars`` characters of the prompt (a probe's character budget,
            :mod:`service.engine.probe_bound`): the earlier messages' contents are cut first, newest
            kept, and both renders are tokenized from the same offset, so a conversation of any
            length costs bounded tokenizer memory. ``None``: all of it.

    Raises:
        RecordError: no assistant message, or as :func:`turn_span`.
    """
    turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
    if not turns:
        raise RecordError("the messages have no assistant message (the turn that is scored)")
    i = turns[-1]
    if i == 0:
        raise RecordError("message 0 is an assistant message; a conversation opens with another role")
    if chars is None:
        prompt, through = _prefix_ids(tokenizer, messages[: i + 1], [(i, True), (i + 1, False)], renderer)
    else:
        prompt, through = _tail_ids(tokenizer, _context_within(messages[: i + 1], chars), i, renderer, chars)
    start, stop = _span(prompt, through, through, i)
    return through[:start], through[start:stop]


def _context_within(messages: Sequence[Message], chars: int) -> tuple[Message, ...]:
    """``messages`` with the contents before the last message cut, newest kept, to ``chars``
    characters in all (each keeps at least one): what lies before them is beyond any kept token."""
    kept = list(messages)
    left = chars
    for j in range(len(kept) - 2, -1, -1):
        message = kept[j]
        if len(message.content) > left:
            keep = max(left, 1)
            kept[j] = Message(message.role, message.content[len(message.content) - keep :], message.name)
        left = max(0, left - len(message.content))
    return tuple(kept)


def _tail_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], i: int, renderer: Renderer | None, chars: int
) -> tuple[list[int], list[int]]:
    """The prompt and through renders of turn ``i``, each tokenized from the same offset: the prompt's
    last ``chars`` characters (its BOS kept, when the template writes one)."""
    if not has_chat_template(tokenizer):
        raise NoChatTemplate("the model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
    prompt_text, through_text = (renderer or InProcess()).render(tokenizer, messages, [(i, True), (i + 1, False)])
    start = max(0, len(prompt_text) - chars)
    lead = _bos_lead(tokenizer, prompt_text) if start else []
    return lead + _text_ids(tokenizer, prompt_text[start:]), lead + _text_ids(tokenizer, through_text[start:])


def _bos_lead(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """``[bos]`` when ``text`` opens with the BOS token (a render cut on the left keeps it), else nothing."""
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    return [int(bos_id)] if isinstance(bos, str) and bos and bos_id is not None and text.startswith(bos) else []


def generation_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    renderer: Renderer | None = None,
    chars: int | None = None,
) -> list[int]:
    """``messages`` rendered with the generation prompt: what a model continues to answer.

    Args:
        chars: tokenize only the render's last ``chars`` characters (its BOS kept), the contents cut
            first, newest kept (as :func:`last_turn`); ``None``: all of it.
    """
    if chars is None:
        return render_ids(tokenizer, messages, add_generation_prompt=True, renderer=renderer)
    if not has_chat_template(tokenizer):
        raise NoChatTemplate("the model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
    kept = _context_within([*messages, Message("user", "")], chars)[:-1]  # the last message may be cut too
    (text,) = (renderer or InProcess()).render(tokenizer, kept, [(len(kept), True)])
    start = max(0, len(text) - chars)
    return (_bos_lead(tokenizer, text) if start else []) + _text_ids(tokenizer, text[start:])


class RenderedOnce:
    """A renderer that answers from what it rendered before: primed inside the job's template
    process (every answer of every probe, before any model runs), it then serves every model's (and
    every calibration candidate's) scoring after that process ended, rendering nothing again."""

    def __init__(self, inner: Renderer | None) -> None:
        self.inner = inner
        self._seen: dict[tuple[object, ...], list[str]] = {}

    def render(
        self, tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], prefixes: Sequence[tuple[int, bool]]
    ) -> list[str]:
        key = (id(tokenizer), tuple((m.role, m.content) for m in messages), tuple(prefixes))
        if key not in self._seen:
            if self.inner is None:  # a bug (a probe not primed), not the user's
                raise RuntimeError("a chat probe's template was not rendered before scoring")
            self._seen[key] = self.inner.render(tokenizer, messages, prefixes)
        return self._seen[key]
