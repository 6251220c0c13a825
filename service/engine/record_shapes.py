"""The shapes chat and instruction datasets come in, read as the three canonical records.

A record is stored in one of three canonical shapes (:class:`service.engine.records.Record`):
``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages": [{"role", "content", "name"?}, …]}``
with string contents. Datasets in the wild hold the same content in other shapes; each is read as
the canonical record it means, and nothing else:

- OpenAI messages whose ``content`` is a list of parts: the ``text`` parts joined in order with
  ``"\\n"`` (what vLLM's OpenAI server renders them as for a text-only template). A part of another
  type (``image_url``, ``input_audio``, …) is refused by its type: statistics of text tokens cannot
  represent it, and dropping it would collect a conversation nobody wrote.
- A message's ``name`` (a participant's name) is kept and handed to the chat template, which renders
  it or not, exactly as it does when the model is used.
- Tool-call turns (``tool_calls``, ``function_call``, and the ``tool_call_id`` of their results) are
  refused by name: they are structured calls that the service does not pass to the template, and
  leaving out the turn or its call would change the conversation silently.
- ShareGPT: ``{"conversations": [{"from", "value"}, …]}`` (or such turns under ``messages``), roles
  mapped by :data:`SHAREGPT_ROLES`; an unknown ``from`` is refused naming it.
- Alpaca: ``{"instruction", "input"?, "output"}`` is ``{"prompt", "completion"}`` with the prompt
  ``instruction`` alone when ``input`` is empty (or null, or absent), else
  ``instruction + "\\n\\n" + input`` (the separator Alpaca's own prompt puts between them), and the
  completion ``output`` as it is.

Digests. A stored dataset's digest is that of its canonical records (:func:`service.datasets.spool.record_line`):
JSON key order and spacing, a Parquet struct's null fields, a column mapping never entered it, so two
forms of the same records are the same dataset. These shapes follow that convention: a ShareGPT or
Alpaca record, or content given as parts, has the digest of the canonical record it is read as, and
so shares its statistics; a ``name`` is content (a template may render it), so it enters the digest.
"""

from __future__ import annotations

from typing import Any

from service.engine.messages import RecordError

# ShareGPT's speakers as chat roles (FastChat's human/gpt, and the role names some exports write).
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
}
TOOL_FIELDS = ("tool_calls", "function_call", "tool_call_id")
ALPACA_SEPARATOR = "\n\n"
PART_SEPARATOR = "\n"
# Each shape's fields: (required, optional). "conversations" is ShareGPT's name for "messages".
SHAPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "text": (("text",), ()),
    "prompt": (("prompt", "completion"), ()),
    "messages": (("messages",), ()),
    "conversations": (("conversations",), ()),
    "alpaca": (("instruction", "output"), ("input",)),
}
SHAPE_NAMES = "'text', 'prompt'+'completion', 'messages' (or ShareGPT's 'conversations'), or 'instruction'+'output' (Alpaca)"
FIELDS = tuple(name for required, optional in SHAPES.values() for name in (*required, *optional))


def shape_of(raw: dict[str, Any], where: str) -> str:
    """Which of :data:`SHAPES` a record object is.

    Raises:
        RecordError: unknown fields, or fields of no shape or of several.
    """
    unknown = set(raw) - set(FIELDS)
    if unknown:
        raise RecordError(f"{where} has unknown field(s) {sorted(unknown)} (a record has {SHAPE_NAMES})")
    present = [shape for shape, (required, optional) in SHAPES.items() if set(raw) & {*required, *optional}]
    if len(present) != 1:
        held = f"; it has {', '.join(sorted(raw))}" if raw else ""
        raise RecordError(f"{where} must have exactly one of {SHAPE_NAMES}{held}")
    return present[0]


def alpaca_pair(raw: dict[str, Any], where: str) -> tuple[str, str]:
    """An Alpaca record's ``(prompt, completion)``, its ``instruction`` and ``output`` checked already."""
    extra = raw.get("input")
    if extra is not None and not isinstance(extra, str):
        raise RecordError(f"{where}: 'input' must be a string (empty when there is none), got {type(extra).__name__}")
    instruction = raw["instruction"]
    prompt = instruction + ALPACA_SEPARATOR + extra if extra and extra.strip() else instruction
    return prompt, raw["output"]


def message_fields(item: Any, at: str) -> tuple[Any, Any, Any]:
    """One conversation turn's ``(role, content, name)``, its content text (parts joined), its role
    mapped from ShareGPT's ``from``; the caller checks the role and the text.

    Raises:
        RecordError: not an object, a tool-call turn, unknown or missing fields, a non-text part.
    """
    if not isinstance(item, dict):
        raise RecordError(f"{at} is not a JSON object")
    tool = next((field for field in TOOL_FIELDS if field in item), None)
    if tool is not None:
        raise RecordError(
            f"{at} is a tool-call turn ({tool!r}): tool calls and their results are not read (the service passes no "
            "tools to the chat template); leave out the tool-call turns, or write the call as text content"
        )
    if "from" in item or "value" in item:
        _fields(item, ("from", "value"), (), at, "a ShareGPT turn is {from, value}")
        speaker = item["from"]
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            known = ", ".join(SHAREGPT_ROLES)
            raise RecordError(f"{at} has 'from' {speaker!r:.60}, which is no known speaker (one of {known})")
        value = _text(item["value"], at, "value")
        if not isinstance(value, str):
            got = "null" if value is None else type(value).__name__
            raise RecordError(f"{at}: 'value' must be a string or a list of text parts, got {got}")
        return role, value, None
    _fields(item, ("role", "content"), ("name",), at, "a message is {role, content, name?}")
    name = item.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise RecordError(f"{at}: 'name' must be a non-empty string")
    return item["role"], _text(item["content"], at, "content"), name


def _fields(item: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...], at: str, shape: str) -> None:
    extra = sorted(set(item) - {*required, *optional})
    missing = [name for name in required if name not in item]
    if extra or missing:
        what = f"unknown field(s) {extra}" if extra else f"no {' or '.join(repr(m) for m in missing)}"
        raise RecordError(f"{at} has {what} ({shape})")


def _text(content: Any, at: str, field: str) -> Any:
    """A turn's text: a string as it is, a list of content parts as their text joined; anything
    else is returned for the caller to refuse (it says what the content holds)."""
    if not isinstance(content, list):
        return content
    if not content:
        raise RecordError(f"{at}: '{field}' is an empty list of content parts")
    texts = []
    for j, part in enumerate(content):
        where = f"{at}: content part {j}"
        if not isinstance(part, dict):
            raise RecordError(f"{where} is not a JSON object (a part is {{type: text, text}})")
        kind = part.get("type")
        if kind != "text":
            if kind is None:
                raise RecordError(f"{where} has no 'type' (a part is {{type: text, text}})")
            raise RecordError(
                f"{where} is of type {kind!r:.60}: text-only statistics cannot represent it (only 'text' parts are read)"
            )
        _fields(part, ("type", "text"), (), where, "a text part is {type: text, text}")
        if not isinstance(part["text"], str):
            raise RecordError(f"{where}: 'text' must be a string")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)
