"""The per-probe statistics that TOFU's metrics are computed from (one model, one probe set).

A TOFU probe is an evaluation probe (:class:`service.engine.evaluate.TextProbe`: prompt/completion
or chat ``messages``) plus, where the user has them, a ``paraphrased_answer`` and a list of
``perturbed_answers`` (plausible wrong answers), as in TOFU. Every answer is tokenized exactly as
:func:`service.engine.evaluate.encode_probe` tokenizes the completion (the collector's rule), so a
paraphrase or a wrong answer is scored as if it were the completion.

Per answer token, under teacher forcing, the statistics are what OpenUnlearning's
``tokenwise_vocab_logprobs`` reads: the token's log-probability, the mean and variance of the
log-probability under the next-token distribution (min-k%++), and whether the argmax is the token
(EM and ES). The log-softmax is taken in float64 over the answer positions only (a few tokens ×
the vocabulary), whatever the model's dtype. For ROUGE the answer is also generated greedily.
The aggregation into metrics is :mod:`service.evaluation.tofu_metrics`.

Bounds (:mod:`service.engine.probe_bound`): :func:`encoded_tofu` cuts a probe's prompt once, on the
left, to leave room for its longest answer within the probe bound, so every answer of a probe is
scored after the same context; an answer past the bound is refused by its field. Forward passes are
batched by padded tokens (:func:`service.engine.evaluate.token_batches`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from service.engine.evaluate import (
    BATCH_TOKENS,
    TextProbe,
    _greedy_batch,
    _model_device,
    _pad_id,
    _right_pad,
    encode_probe,
    probe_tokens,
    token_batches,
)

# The private helpers are evaluate's own padding and decoding, reused so both score the same inputs.
from service.engine.probe_bound import ProbeBound, ProbeTooLong, fit
from service.engine.tofu_statistics import AnswerTokens, ProbeStatistics

if TYPE_CHECKING:  # annotations only
    from service.engine.chat import Renderer

__all__ = [
    "AnswerTokens",
    "ProbeStatistics",
    "AnswerRefused",
    "TofuProbe",
    "answer_tokens",
    "answers_of",
    "encoded_tofu",
    "merged_cuts",
    "tofu_probe",
    "tofu_statistics",
    "with_answer",
]

# Greedy generation for ROUGE decodes as many tokens as the answer has (plus ``generation_slack``),
# then cuts at the end token. OpenUnlearning decodes up to 200 tokens to the end token; a model that
# was never taught to stop (the demo models) would glue its next words onto the answer's last word
# and lose it from the recall, so the default decodes the answer's length, evaluate's greedy rule.
GENERATION_SLACK = 0


@dataclass(frozen=True)
class TofuProbe:
    """A probe with TOFU's optional answers: ``paraphrased_answer`` (the same fact in other words)
    and ``perturbed_answers`` (wrong answers of the same form)."""

    probe: TextProbe
    paraphrased_answer: str | None = None
    perturbed_answers: tuple[str, ...] | None = None
    # every answer's (prompt_ids, answer_ids), in :func:`answers_of`'s order, set by :func:`encoded_tofu`
    ids: tuple[tuple[list[int], list[int]], ...] | None = None
    cut: bool = False  # the prompt was cut to the probe bound


class AnswerRefused(ValueError):
    """An answer of a TOFU probe that cannot be scored: ``where`` names its field (``""``: the
    completion or scored turn, ``".paraphrased_answer"``, ``".perturbed_answers[j]"``), ``error`` says
    why (a :class:`~service.engine.probe_bound.ProbeTooLong` past the probe bound)."""

    def __init__(self, where: str, error: ValueError) -> None:
        super().__init__(str(error))
        self.where, self.error = where, error


def answers_of(item: TofuProbe) -> list[tuple[str, TextProbe]]:
    """Every answer of ``item`` as a probe, named by its field: the probe itself, its paraphrase,
    then each perturbed answer (the order :func:`tofu_statistics` scores them in)."""
    answers = [("", item.probe)]
    if item.paraphrased_answer is not None:
        answers.append((".paraphrased_answer", with_answer(item.probe, item.paraphrased_answer)))
    answers += [(f".perturbed_answers[{j}]", with_answer(item.probe, w)) for j, w in enumerate(item.perturbed_answers or ())]
    return answers


def encoded_tofu(
    tokenizer: PreTrainedTokenizerBase, item: TofuProbe, renderer: Renderer | None = None, bound: ProbeBound | None = None
) -> TofuProbe:
    """``item`` with every answer's token IDs, within ``bound``: its prompt cut once, on the left, to
    leave room for its longest answer (a chat probe's templates rendered by ``renderer``).

    Raises:
        AnswerRefused: an answer tokenizes to nothing, or leaves no room for a prompt token (naming
            its field).
    """
    pairs = []
    for where, probe in answers_of(item):
        try:
            pairs.append((where, probe_tokens(tokenizer, probe, renderer, bound)))
        except ValueError as exc:
            raise AnswerRefused(where, exc) from None
    longest_where, (_, longest) = max(pairs, key=lambda pair: len(pair[1][1]))
    fitted = []
    for _, (prompt_ids, answer_ids) in pairs:
        try:
            fitted.append(fit(tokenizer, prompt_ids, answer_ids, bound, len(longest)))
        except ProbeTooLong as exc:
            raise AnswerRefused(longest_where, exc) from None
    ids = tuple((prompt_ids, answer_ids) for prompt_ids, answer_ids, _ in fitted)
    return TofuProbe(item.probe, item.paraphrased_answer, item.perturbed_answers, ids, any(cut for *_, cut in fitted))


def with_answer(probe: TextProbe, answer: str) -> TextProbe:
    """``probe`` with ``answer`` in place of its completion (a chat probe: its last assistant turn)."""
    if probe.messages is None:
        return TextProbe(prompt=probe.prompt, completion=answer)
    messages = [dict(m) for m in probe.messages]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    messages[last]["content"] = answer
    return TextProbe(messages=messages[: last + 1])


# Answer positions whose float64 log-softmax is taken at once: a few float64 copies of 64 × vocabulary
# (~64 MiB each at a 128k vocabulary), whatever the answer's length.
ROWS_AT_ONCE = 64


def merged_cuts(flags: Mapping[str, list[bool]], sets: Mapping[str, Sequence[TofuProbe]]) -> dict[str, list[bool]]:
    """Per probe set, whether each probe's prompt was cut: ``flags`` (the plain probes') or'ed with
    the :func:`encoded_tofu` sets' own cuts, position by position (a probe counts once, cut for its
    completion or for a longer answer)."""
    merged = dict(flags)
    for name, items in sets.items():
        was = merged.get(name, [False] * len(items))
        merged[name] = [cut or item.cut for cut, item in zip(was, items, strict=True)]
    return merged


def _token_rows(logits: torch.Tensor, targets: list[int]) -> AnswerTokens:
    """Statistics of answer tokens from the logits that predict them (``(n, vocab)``), computed
    :data:`ROWS_AT_ONCE` positions at a time."""
    token_logp: list[float] = []
    means: list[float] = []
    variances: list[float] = []
    hits: list[bool] = []
    for start in range(0, len(targets), ROWS_AT_ONCE):
        logp = torch.log_softmax(logits[start : start + ROWS_AT_ONCE].to(torch.float64), dim=-1)
        target = torch.tensor(targets[start : start + ROWS_AT_ONCE], dtype=torch.long, device=logp.device)
        p = logp.exp()
        mean = (p * logp).sum(-1)
        token_logp += logp.gather(1, target[:, None])[:, 0].tolist()
        means += mean.tolist()
        variances += ((p * logp.square()).sum(-1) - mean.square()).tolist()
        hits += [bool(h) for h in (logp.argmax(-1) == target).tolist()]
    return AnswerTokens(tuple(token_logp), tuple(means), tuple(variances), tuple(hits))


def _batch_tokens(model: PreTrainedModel, encoded: Sequence[tuple[list[int], list[int]]], pad_id: int) -> list[AnswerTokens]:
    ids, mask = _right_pad([p + a for p, a in encoded], pad_id)
    out: Any = model(input_ids=ids.to(_model_device(model)), attention_mask=mask.to(_model_device(model)), use_cache=False)
    logits: torch.Tensor = out.logits
    # Position t predicts token t+1: the answer's tokens are predicted from one position earlier.
    return [_token_rows(logits[i, len(p) - 1 : len(p) + len(a) - 1], a) for i, (p, a) in enumerate(encoded)]


def answer_tokens(
    model: PreTrainedModel,
    encoded: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
    batch_size: int = 16,
    batch_tokens: int = BATCH_TOKENS,
) -> list[AnswerTokens]:
    """Teacher-forced statistics of each ``(prompt_ids, answer_ids)``'s answer tokens.

    Args:
        model: Causal LM; put in eval mode by this call.
        encoded: Token IDs per answer (:func:`service.engine.evaluate.encode_probe`).
        pad_id: Padding id (right padding and a mask: results do not depend on the batching).
        batch_size: Most sequences per forward pass.
        batch_tokens: Most padded tokens per forward pass.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    model.eval()  # type: ignore[no-untyped-call]  # PreTrainedModel.eval is untyped in transformers
    rows: list[AnswerTokens] = []
    with torch.inference_mode():
        for group in token_batches([len(p) + len(a) for p, a in encoded], batch_tokens, batch_size):
            rows.extend(_batch_tokens(model, encoded[group.start : group.stop], pad_id))
    return rows


def _generations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    encoded: Sequence[tuple[list[int], list[int]]],
    batch_size: int,
    slack: int,
    batch_tokens: int = BATCH_TOKENS,
) -> list[str]:
    """Greedy answers (up to the answer's length + ``slack`` tokens), cut at the end
    token and decoded without special tokens, stripped (as OpenUnlearning's ``eval_text_similarity``)."""
    pad_id, eos = _pad_id(tokenizer), tokenizer.eos_token_id
    texts: list[str] = []
    widths = [len(p) + len(a) + slack for p, a in encoded]
    with torch.inference_mode():
        for group in token_batches(widths, batch_tokens, batch_size):
            chunk = encoded[group.start : group.stop]
            n_new = [len(a) + slack for _, a in chunk]
            for tokens in _greedy_batch(model, chunk, n_new, pad_id):
                cut = tokens.index(eos) if eos is not None and eos in tokens else len(tokens)
                texts.append(str(tokenizer.decode(tokens[:cut], skip_special_tokens=True)).strip())
    return texts


def tofu_statistics(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    probes: Sequence[TofuProbe],
    *,
    generate: bool = True,
    generation_slack: int = GENERATION_SLACK,
    batch_size: int = 16,
    renderer: Renderer | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> list[ProbeStatistics]:
    """Per-probe TOFU statistics of ``probes`` under ``model``.

    Args:
        model: Causal LM; put in eval mode by this call.
        tokenizer: Its tokenizer.
        probes: The probes; a missing paraphrase or perturbed list leaves that field ``None``.
        generate: Also decode each answer greedily (ROUGE); off, ``generation`` is ``None``.
        generation_slack: Tokens decoded beyond the answer's length (a model that ends its answers
            with the end token stops there anyway).
        batch_size: Most sequences per forward pass.
        renderer: What renders chat probes' templates (default: in this process).
        batch_tokens: Most padded tokens per forward pass.

    Raises:
        ValueError: an answer tokenizes to nothing (:func:`service.engine.evaluate.encode_probe`).
    """
    # Every answer of every probe, in one flat list, scored together and regrouped after.
    answers: list[tuple[list[int], list[int]]] = []
    layout: list[tuple[int, int | None, int]] = []  # (answer index, paraphrase index, n perturbed)
    for item in probes:
        main = len(answers)
        if item.ids is not None:  # encoded_tofu: within the probe bound
            answers += item.ids
        else:
            answers += [encode_probe(tokenizer, probe, renderer) for _, probe in answers_of(item)]
        para = main + 1 if item.paraphrased_answer is not None else None
        layout.append((main, para, len(item.perturbed_answers or ())))
    rows = answer_tokens(model, answers, _pad_id(tokenizer), batch_size, batch_tokens)
    mains = [answers[main] for main, _, _ in layout]
    generations: list[str | None] = (
        list(_generations(model, tokenizer, mains, batch_size, generation_slack, batch_tokens)) if generate else []
    )
    results = []
    for n, (item, (main, para, n_wrong)) in enumerate(zip(probes, layout, strict=True)):
        first_wrong = main + 1 + (para is not None)
        results.append(
            ProbeStatistics(
                answer=rows[main],
                answer_text=str(tokenizer.decode(answers[main][1], skip_special_tokens=True)),
                paraphrased=rows[para] if para is not None else None,
                perturbed=tuple(rows[first_wrong : first_wrong + n_wrong]) if item.perturbed_answers else None,
                generation=generations[n] if generate else None,
            )
        )
    return results


def tofu_probe(record: dict[str, object]) -> TofuProbe:
    """A :class:`TofuProbe` from an evaluation record (``prompt``/``completion`` or ``messages``, plus
    optional ``paraphrased_answer`` and ``perturbed_answers``).

    Raises:
        ValueError: a field of the wrong type, naming it.
    """
    para = record.get("paraphrased_answer")
    wrong = record.get("perturbed_answers")
    if para is not None and not isinstance(para, str):
        raise ValueError(f"paraphrased_answer must be a string, got {type(para).__name__}")
    if wrong is not None and not (isinstance(wrong, list) and all(isinstance(w, str) for w in wrong)):
        raise ValueError("perturbed_answers must be a list of strings")
    fields = {k: record[k] for k in ("prompt", "completion", "messages") if k in record}
    probe = TextProbe(**fields)  # type: ignore[arg-type]  # validated by encode_probe when scored
    return TofuProbe(probe, para, tuple(wrong) if wrong is not None else None)
