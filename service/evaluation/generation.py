"""A generation's prompt bounded by what the model reads, before it is tokenized.

The prompt (text, or messages rendered with the generation prompt) is cut on the left to at most
``room`` tokens, the smaller of the probe bound (the model's context and ENGRAM_MAX_LENGTH,
:mod:`service.engine.probe_bound`) and the context less ``max_new_tokens`` (the positions the answer
takes), its BOS kept; only its last ``bound.chars`` characters are tokenized. The result says when
the prompt was cut (``prompt_truncated``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.engine.chat import Renderer, generation_prompt
from service.engine.messages import Message
from service.engine.probe_bound import ProbeBound, cut_left, model_context, prompt_tail
from service.errors import JobFailed


def prompt_room(bound: ProbeBound, config: Any, max_new_tokens: int) -> int:
    """The most prompt tokens a generation of ``max_new_tokens`` may read.

    Raises:
        JobFailed: ``max_new_tokens`` leaves no position for a prompt in the model's context.
    """
    context = model_context(config)
    room = bound.tokens if context is None else min(bound.tokens, context - max_new_tokens)
    if room < 1:
        raise JobFailed(
            f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's context of {context} "
            f"tokens (max_position_embeddings): ask for at most {(context or 1) - 1}"
        )
    return room


def bounded_prompt(
    tokenizer: Any,
    room: int,
    bound: ProbeBound,
    prompt: str | None = None,
    messages: Sequence[Message] | None = None,
    renderer: Renderer | None = None,
) -> tuple[list[int], bool]:
    """The token IDs a generation reads (text with special tokens, or ``messages`` rendered with the
    generation prompt by ``renderer``), cut on the left to ``room`` tokens, and whether they were cut.

    Raises:
        RecordError: the messages cannot be rendered (as :func:`service.engine.chat.generation_prompt`).
    """
    if messages is not None:
        ids = generation_prompt(tokenizer, messages, renderer, bound.chars)
    else:
        ids = [int(i) for i in tokenizer(prompt_tail(prompt or "", bound), add_special_tokens=True)["input_ids"]]
    return cut_left(tokenizer, ids, room)
