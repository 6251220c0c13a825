"""Rephrasing: the same probes asked another way, on the unchanged model.

* :func:`as_chat`: a prompt/completion probe as a conversation, the prompt the user's turn and the
  completion the assistant's (both stripped of surrounding whitespace, as chat turns are written),
  scored through the model's chat template; a chat probe is already one.
* :func:`as_plain`: a chat probe as plain text, the contents of the turns before the scored one,
  one a line, then the scored turn's content after a space; a prompt/completion probe is already one.
* :func:`with_answer`: a probe with another answer (TOFU's ``paraphrased_answer``).
"""

from __future__ import annotations

from service.engine.evaluate import TextProbe


def as_chat(probe: TextProbe) -> TextProbe:
    """``probe`` as a user turn and the assistant's answer (a chat probe unchanged)."""
    if probe.messages is not None:
        return TextProbe(messages=list(probe.messages))
    user = {"role": "user", "content": probe.prompt.strip()}
    return TextProbe(messages=[user, {"role": "assistant", "content": probe.completion.strip()}])


def as_plain(probe: TextProbe) -> TextProbe:
    """``probe`` without a template: the turns before the last assistant turn, one a line, and that
    turn's content as the completion (a prompt/completion probe unchanged).

    Raises:
        ValueError: a conversation without an assistant turn.
    """
    if probe.messages is None:
        return TextProbe(probe.prompt, probe.completion)
    turns = list(probe.messages)
    last = max((i for i, m in enumerate(turns) if m["role"] == "assistant"), default=None)
    if last is None or last == 0:
        raise ValueError("a chat probe needs a turn before its last assistant turn")
    prompt = "\n".join(m["content"] for m in turns[:last])
    return TextProbe(prompt, " " + turns[last]["content"].strip())


def with_answer(probe: TextProbe, answer: str) -> TextProbe:
    """``probe`` with ``answer`` as the scored answer (a chat probe: its last assistant turn)."""
    if probe.messages is None:
        return TextProbe(probe.prompt, answer)
    turns = [dict(m) for m in probe.messages]
    last = max(i for i, m in enumerate(turns) if m["role"] == "assistant")
    turns[last] = {"role": "assistant", "content": answer}
    return TextProbe(messages=turns[: last + 1])
