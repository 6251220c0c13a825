"""Probes bounded by what the model reads: its context and ENGRAM_MAX_LENGTH, as concept records are.

A probe's sequence (prompt, then the answer that is scored) holds at most ``bound.tokens`` tokens,
the smaller of the model's context (``max_position_embeddings``) and ENGRAM_MAX_LENGTH, the bound
that collection reads a record to. Without it one probe of 20,000 characters (16k tokens of an
unlucky tokenizer) runs the forward pass over 16k positions: the float32 logits alone are
16k × vocabulary × 4 bytes (2 GB at a 32k vocabulary), and a TOFU answer that long is decoded one
full forward pass per token.

Cut or refuse:

* The answer (a completion, a TOFU paraphrased or perturbed answer, a conversation's scored
  assistant turn) is what is measured, so it is never cut: an answer that leaves no room for one
  prompt token is refused, naming the bound and its setting.
* The prompt is cut on the left: its last tokens, those next to the answer, are kept, after its
  first token when that is the tokenizer's BOS (a model reads a sequence that starts with it). The
  probe is then counted as truncated in the result (a probe is never shortened silently).

Before anything is tokenized, texts are cut to the character budget of
:mod:`service.engine.record_budget` (``(tokens + 1) × L``, ``L`` the longest vocabulary entry): an
answer longer than that has more than ``bound.tokens`` tokens and is refused without being
tokenized; a prompt is tokenized from its last that many characters, which hold every token that
can be kept. A long probe costs no tokenizer memory either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.engine.record_budget import char_budget

if TYPE_CHECKING:  # annotations only: a tokenizer is loaded by the caller
    from transformers import PreTrainedTokenizerBase

# Where configs keep the model's context length (Llama/Mistral/Qwen..., GPT-2, GPT-J/MPT, ChatGLM).
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


class ProbeTooLong(ValueError):
    """An answer longer than a probe may hold (the message names the bound and its setting)."""


@dataclass(frozen=True)
class ProbeBound:
    """How long a probe's sequence may be: ``tokens`` (prompt and answer), ``chars`` (of a text
    tokenized: :func:`service.engine.record_budget.char_budget`), ``why`` (the settings that set it)
    and ``remedy`` (what a user can do about an answer past it), for messages."""

    tokens: int
    chars: int
    why: str
    remedy: str


def model_context(config: Any) -> int | None:
    """The positions the model was built for, from its config (a multimodal model's text part);
    ``None`` when the config does not say."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in CONTEXT_FIELDS:
        # a transformers config: each architecture names its context length differently
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def probe_bound(tokenizer: PreTrainedTokenizerBase, config: Any, max_length: int) -> ProbeBound:
    """The bound of a model's probes: the smaller of its context and ``max_length`` (ENGRAM_MAX_LENGTH)."""
    context = model_context(config)
    if context is not None and context < max_length:
        why = f"the model's context, max_position_embeddings {context} (ENGRAM_MAX_LENGTH is {max_length})"
        return ProbeBound(context, char_budget(tokenizer, context), why, "shorten the answer: the model reads no more")
    why, remedy = f"ENGRAM_MAX_LENGTH {max_length}", "shorten the answer or raise ENGRAM_MAX_LENGTH"
    return ProbeBound(max_length, char_budget(tokenizer, max_length), why, remedy)


def check_answer_chars(answer: str, bound: ProbeBound | None, what: str = "answer") -> None:
    """Refuse an answer whose text alone has more tokens than a probe holds, before tokenizing it.

    Raises:
        ProbeTooLong: ``answer`` is longer than ``bound.chars`` characters.
    """
    if bound is not None and len(answer) > bound.chars:
        raise ProbeTooLong(
            f"its {what} is {len(answer):,} characters, more than the {bound.tokens} tokens a probe holds "
            f"({bound.why}) and an answer is scored whole: {bound.remedy}"
        )


def prompt_tail(prompt: str, bound: ProbeBound | None) -> str:
    """The last ``bound.chars`` characters of ``prompt`` (all of it within the budget): they hold every
    token a probe can keep of it."""
    if bound is None or len(prompt) <= bound.chars:
        return prompt
    return prompt[len(prompt) - bound.chars :]


def fit(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Sequence[int],
    answer: Sequence[int],
    bound: ProbeBound | None,
    longest: int | None = None,
    what: str = "answer",
) -> tuple[list[int], list[int], bool]:
    """``(prompt, answer)`` within ``bound.tokens``: the prompt cut on the left (its BOS kept), and
    whether it was cut.

    Args:
        longest: the longest answer the prompt is read with (a TOFU probe's answers share one cut of
            their prompt, so every answer is scored after the same context); default: ``answer``'s.
        what: how the answer is named in a refusal.

    Raises:
        ProbeTooLong: the answer leaves no room for one prompt token.
    """
    if bound is None:
        return list(prompt), list(answer), False
    longest = len(answer) if longest is None else max(longest, len(answer))
    room = bound.tokens - longest
    if room < 1:
        raise ProbeTooLong(
            f"its {what} is {longest} tokens; a probe holds {bound.tokens} ({bound.why}), the answer whole and "
            f"at least one prompt token: {bound.remedy}"
        )
    kept, cut = cut_left(tokenizer, prompt, room)
    return kept, list(answer), cut


def cut_left(tokenizer: PreTrainedTokenizerBase, prompt: Sequence[int], room: int) -> tuple[list[int], bool]:
    """``prompt``'s last tokens, ``room`` in all with its first when that is the tokenizer's BOS, and
    whether any was left out (``room`` >= 1)."""
    if len(prompt) <= room:
        return list(prompt), False
    first = 1 if prompt and prompt[0] == tokenizer.bos_token_id else 0
    kept = room - first
    return list(prompt[:first]) + (list(prompt[len(prompt) - kept :]) if kept > 0 else []), True
