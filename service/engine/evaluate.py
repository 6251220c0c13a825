"""Offline evaluation of question/answer probes on a causal language model.

Two measures are computed per probe, both on the *completion* tokens only:

* ``answer_nll``: mean negative log-likelihood (nats/token) under teacher forcing.
* ``greedy_exact_match``: whether greedy decoding reproduces the completion token ids exactly.

Tokenization is fixed so that it matches the statistics collector:
``tokenizer(prompt, add_special_tokens=True)`` followed by
``tokenizer(completion, add_special_tokens=False)``, concatenated.  Do not change it
in one place without the other, or the measured NLL stops describing what was edited.
A probe of ``messages`` (ending with an assistant message) is rendered with the chat template as
the collector renders it: the prompt is the conversation before that turn with the generation
prompt, the completion that turn's counted tokens (:func:`service.engine.chat.last_turn`). A job
renders its chat probes once, in its bounded template process (a chat template is a program from the
model folder: :mod:`service.engine.template_render`), with :func:`encoded`; the scoring functions
then read the probes' token IDs and never run a template.

Bounds. A probe's sequence holds at most ``bound.tokens`` tokens (the model's context and
ENGRAM_MAX_LENGTH, :mod:`service.engine.probe_bound`): its prompt is cut on the left, its answer
refused when it alone passes the bound. Forward passes are batched by padded tokens (rows × the
longest row, at most ``batch_tokens``, ENGRAM_EVAL_BATCH_TOKENS), not by probes, so that many long
probes cost what a few do: a batch's float32 logits are ``batch_tokens`` × vocabulary × 4 bytes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from service.engine.probe_bound import ProbeBound, check_answer_chars, fit, prompt_tail

if TYPE_CHECKING:  # annotations only
    from service.engine.chat import Renderer

__all__ = [
    "BATCH_TOKENS",
    "TextProbe",
    "answer_nll",
    "encode_probe",
    "encoded",
    "greedy_exact_match",
    "greedy_tokens",
    "probe_tokens",
    "summarize",
    "token_batches",
]

# Padded tokens per forward pass (ENGRAM_EVAL_BATCH_TOKENS's default, for callers without settings):
# 2048 rows of float32 logits are 256 MiB at a 32k vocabulary, 1 GiB at 128k.
BATCH_TOKENS = 2048


@dataclass
class TextProbe:
    """One prompt/completion pair, e.g. ``TextProbe("Q: Where was X born? A:", " Quillmoor")``, or a
    conversation ``TextProbe(messages=[{"role": "user", ...}, {"role": "assistant", ...}])`` whose last
    (assistant) turn is scored: what the engine scores of a text probe (the wire's
    :class:`api_schemas.Probe` is any probe a request sends, images included)."""

    prompt: str = ""
    completion: str = ""
    messages: Sequence[dict[str, str]] | None = None
    # (prompt_ids, completion_ids) already computed by :func:`encoded` (a chat probe rendered once)
    ids: tuple[list[int], list[int]] | None = None
    # whether :func:`encoded` cut the prompt to the probe bound (the result counts such probes)
    cut: bool = False


def encoded(
    tokenizer: PreTrainedTokenizerBase, probe: TextProbe, renderer: Renderer | None = None, bound: ProbeBound | None = None
) -> TextProbe:
    """``probe`` with its token IDs computed (:func:`encode_probe`, within ``bound``), so that scoring
    it again renders nothing: a chat probe's template runs once, by ``renderer`` when given.

    Raises:
        ValueError: as :func:`encode_probe`.
    """
    prompt_ids, answer_ids = probe_tokens(tokenizer, probe, renderer, bound)
    prompt_ids, answer_ids, cut = fit(tokenizer, prompt_ids, answer_ids, bound)
    return dataclasses.replace(probe, ids=(prompt_ids, answer_ids), cut=cut)


def encode_probe(
    tokenizer: PreTrainedTokenizerBase, probe: TextProbe, renderer: Renderer | None = None, bound: ProbeBound | None = None
) -> tuple[list[int], list[int]]:
    """Tokenize a probe exactly as the collector does, within ``bound`` (its prompt cut on the left).

    Args:
        tokenizer: Tokenizer of the model.
        probe: The prompt/completion pair (its ``ids`` when :func:`encoded` computed them).
        renderer: What renders a chat probe's template (default: ``apply_chat_template`` here).
        bound: The most tokens a probe holds (:func:`service.engine.probe_bound.probe_bound`);
            ``None``: unbounded.

    Returns:
        ``(prompt_ids, completion_ids)``; the model input is their concatenation.

    Raises:
        ValueError: If the prompt or the completion tokenizes to nothing (the first
            completion token must be predicted from at least one prompt token), or the
            completion leaves no room for a prompt token within ``bound`` (ProbeTooLong).
    """
    if probe.ids is not None:
        return probe.ids
    prompt_ids, answer_ids, _ = fit(tokenizer, *probe_tokens(tokenizer, probe, renderer, bound), bound)
    return prompt_ids, answer_ids


def probe_tokens(
    tokenizer: PreTrainedTokenizerBase, probe: TextProbe, renderer: Renderer | None = None, bound: ProbeBound | None = None
) -> tuple[list[int], list[int]]:
    """``(prompt_ids, answer_ids)`` before the prompt is cut to ``bound.tokens``: the answer whole (refused
    past the character budget, untokenized), the prompt tokenized from its last ``bound.chars``
    characters (:mod:`service.engine.probe_bound`).

    Raises:
        ValueError: as :func:`encode_probe`.
    """
    if probe.ids is not None:
        return probe.ids
    chars = bound.chars if bound is not None else None
    if probe.messages is not None:
        from service.engine.chat import last_turn
        from service.engine.records import Message

        assistant = [m["content"] for m in probe.messages if m["role"] == "assistant"]
        check_answer_chars(assistant[-1] if assistant else "", bound)
        return last_turn(tokenizer, [Message(m["role"], m["content"]) for m in probe.messages], renderer, chars)
    check_answer_chars(probe.completion, bound)
    p_ids = list(tokenizer(prompt_tail(probe.prompt, bound), add_special_tokens=True)["input_ids"])
    a_ids = list(tokenizer(probe.completion, add_special_tokens=False)["input_ids"])
    if not p_ids:
        raise ValueError(f"prompt tokenizes to no tokens: {probe.prompt!r:.200}")
    if not a_ids:
        raise ValueError(f"completion tokenizes to no tokens: {probe.completion!r:.200}")
    return p_ids, a_ids


def token_batches(lengths: Sequence[int], batch_tokens: int, batch_size: int | None = None) -> list[range]:
    """Consecutive groups of sequences whose padded batch (rows × the longest row) holds at most
    ``batch_tokens`` tokens, and at most ``batch_size`` rows; a longer sequence is a batch alone.

    Raises:
        ValueError: a bound below 1.
    """
    if batch_tokens < 1 or (batch_size is not None and batch_size < 1):
        raise ValueError(f"batch_tokens and batch_size must be >= 1, got {batch_tokens} and {batch_size}")
    groups: list[range] = []
    start, widest = 0, 0
    for i, length in enumerate(lengths):
        wider = max(widest, length)
        rows = i - start + 1
        if i > start and (rows * wider > batch_tokens or (batch_size is not None and rows > batch_size)):
            groups.append(range(start, i))
            start, wider = i, length
        widest = wider
    if start < len(lengths):
        groups.append(range(start, len(lengths)))
    return groups


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Token id used to fill padded positions.

    Its value never matters (padded positions are masked out and lie *after* every
    real token, so a causal model cannot see them); it only has to be a valid id.
    """
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def _right_pad(rows: Sequence[list[int]], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id rows into a batch.

    Args:
        rows: Token ids per example.
        pad_id: Id written into padded positions.
        width: Total width; defaults to the longest row.

    Returns:
        ``(input_ids, attention_mask)``, both ``long`` tensors of shape ``(len(rows), width)``.
    """
    width = max(len(r) for r in rows) if width is None else width
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def _model_device(model: torch.nn.Module) -> torch.device:
    """Device of the model's first parameter (CPU for a parameterless module)."""
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def _logits(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Forward pass returning float32 logits of shape ``(batch, seq, vocab)``."""
    device = _model_device(model)
    out: Any = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    logits: torch.Tensor = out.logits
    return logits.float()


def _batch_nll(model: PreTrainedModel, encoded: Sequence[tuple[list[int], list[int]]], pad_id: int) -> list[float]:
    """Mean completion NLL for one batch of already-tokenized probes.

    Args:
        model: Causal LM.
        encoded: ``(prompt_ids, completion_ids)`` per probe.
        pad_id: Padding id.

    Returns:
        Mean NLL (nats/token) of each probe's completion tokens.
    """
    ids, mask = _right_pad([p + a for p, a in encoded], pad_id)
    logits = _logits(model, ids, mask)
    results: list[float] = []
    for i, (p_ids, a_ids) in enumerate(encoded):
        # Logits at position t predict token t+1, so the completion tokens, which sit at
        # positions len(p)..len(p)+len(a)-1, are predicted from positions one earlier.
        start, stop = len(p_ids) - 1, len(p_ids) + len(a_ids) - 1
        pred = logits[i, start:stop]
        target = torch.tensor(a_ids, dtype=torch.long, device=pred.device)
        nll = torch.nn.functional.cross_entropy(pred, target, reduction="mean")
        results.append(float(nll))
    return results


def answer_nll(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    probes: Sequence[TextProbe],
    batch_size: int = 16,
    batch_tokens: int = BATCH_TOKENS,
) -> list[float]:
    """Per-probe mean negative log-likelihood of the completion given the prompt.

    Args:
        model: Causal LM (e.g. ``LlamaForCausalLM``); put in eval mode by this call.
        tokenizer: Its tokenizer.
        probes: Prompt/completion pairs.
        batch_size: Most probes per forward pass; results do not depend on it (right
            padding plus an attention mask).
        batch_tokens: Most padded tokens per forward pass (:func:`token_batches`).

    Returns:
        One float per probe, in nats per completion token.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    encoded = [encode_probe(tokenizer, p) for p in probes]
    pad_id = _pad_id(tokenizer)
    model.eval()  # type: ignore[no-untyped-call]  # PreTrainedModel.eval is untyped in transformers
    results: list[float] = []
    with torch.inference_mode():
        for rows in token_batches([len(p) + len(a) for p, a in encoded], batch_tokens, batch_size):
            results.extend(_batch_nll(model, encoded[rows.start : rows.stop], pad_id))
    return results


def _greedy_batch(
    model: PreTrainedModel, encoded: Sequence[tuple[list[int], list[int]]], n_new: Sequence[int], pad_id: int
) -> list[list[int]]:
    """Greedy-decode ``n_new[i]`` tokens after each prompt, batched with right padding.

    Every row lives in one fixed-width buffer. A row's next token is read from the
    logits at its own last filled position and written just after it; the still-empty
    positions to the right are masked and, the model being causal, invisible anyway.
    Without a KV cache each step recomputes the whole buffer, which is fine for the
    handful of answer tokens that probes have.

    Returns:
        The generated token ids per row.
    """
    prompts = [p for p, _ in encoded]
    width = max(len(p) + n for p, n in zip(prompts, n_new, strict=True))
    ids, mask = _right_pad(prompts, pad_id, width)
    lengths = [len(p) for p in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    for _ in range(max(n_new, default=0)):
        logits = _logits(model, ids, mask)
        for i, length in enumerate(lengths):
            if len(generated[i]) >= n_new[i]:
                continue
            token = int(logits[i, length - 1].argmax())
            generated[i].append(token)
            ids[i, length] = token
            mask[i, length] = 1
            lengths[i] = length + 1
    return generated


def greedy_tokens(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    probes: Sequence[TextProbe],
    max_new_tokens: int | None = None,
    batch_size: int = 16,
    batch_tokens: int = BATCH_TOKENS,
) -> list[list[int]]:
    """Greedy continuation of each prompt, as many tokens as its completion has.

    Decoding is done by hand (no ``model.generate``) so that it needs no generation
    config and behaves identically across transformers versions.

    Args:
        model: Causal LM; put in eval mode by this call.
        tokenizer: Its tokenizer.
        probes: Prompt/completion pairs; the completion only sets the length.
        max_new_tokens: Optional cap on the tokens decoded per probe.
        batch_size: Most probes decoded together (results do not depend on it).
        batch_tokens: Most tokens of a decoding buffer (rows × its width: :func:`token_batches`).

    Returns:
        The decoded token ids per probe.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    encoded = [encode_probe(tokenizer, p) for p in probes]
    cap = math.inf if max_new_tokens is None else max_new_tokens
    n_new = [int(min(len(a), cap)) for _, a in encoded]
    pad_id = _pad_id(tokenizer)
    model.eval()  # type: ignore[no-untyped-call]  # PreTrainedModel.eval is untyped in transformers
    outputs: list[list[int]] = []
    widths = [len(p) + n for (p, _), n in zip(encoded, n_new, strict=True)]
    with torch.inference_mode():
        for rows in token_batches(widths, batch_tokens, batch_size):
            outputs.extend(_greedy_batch(model, encoded[rows.start : rows.stop], n_new[rows.start : rows.stop], pad_id))
    return outputs


def greedy_exact_match(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    probes: Sequence[TextProbe],
    max_new_tokens: int | None = None,
    batch_size: int = 16,
    batch_tokens: int = BATCH_TOKENS,
) -> list[bool]:
    """Whether greedy decoding from each prompt reproduces its completion token ids.

    Token ids are compared, not text, so a continuation that decodes to the same
    string through a different tokenization does not count as a match.

    Args:
        model: Causal LM; put in eval mode by this call.
        tokenizer: Its tokenizer.
        probes: Prompt/completion pairs.
        max_new_tokens: Optional cap on decoded tokens; when it is shorter than a
            completion only that many leading tokens are compared.
        batch_size: Most probes decoded together.
        batch_tokens: Most tokens of a decoding buffer (:func:`token_batches`).

    Returns:
        One bool per probe.
    """
    outputs = greedy_tokens(model, tokenizer, probes, max_new_tokens, batch_size, batch_tokens)
    targets = [encode_probe(tokenizer, p)[1] for p in probes]
    return [out == target[: len(out)] for out, target in zip(outputs, targets, strict=True)]


def summarize(nll: Sequence[float], em: Sequence[bool]) -> dict[str, float | int]:
    """Aggregate per-probe results.

    Args:
        nll: Per-probe NLL from :func:`answer_nll`.
        em: Per-probe exact-match flags from :func:`greedy_exact_match`.

    Returns:
        ``{"mean_nll": float, "exact_match": float (fraction), "n": int}``; the means are
        ``nan`` for an empty probe set.
    """
    if len(nll) != len(em):
        raise ValueError(f"nll and em differ in length: {len(nll)} != {len(em)}")
    n = len(nll)
    return {
        "mean_nll": sum(nll) / n if n else math.nan,
        "exact_match": sum(bool(x) for x in em) / n if n else math.nan,
        "n": n,
    }
