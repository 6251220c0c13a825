"""What TOFU's metrics read about one probe under one model: plain values, no torch.

Kept apart from :mod:`service.engine.tofu_scoring` (which runs the model) so that the API process can
check a calibration's metrics on placeholder statistics (:mod:`service.calibration.goal`) without
importing torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AnswerTokens", "ProbeStatistics"]


@dataclass(frozen=True)
class AnswerTokens:
    """Teacher-forced statistics of one answer's tokens, float64, one entry per answer token."""

    logprobs: tuple[float, ...]
    vocab_mean: tuple[float, ...]  # E[log p] under the next-token distribution
    vocab_var: tuple[float, ...]  # Var[log p] under it
    argmax_hits: tuple[bool, ...]

    @property
    def avg_loss(self) -> float:
        return -sum(self.logprobs) / len(self.logprobs)


@dataclass(frozen=True)
class ProbeStatistics:
    """Everything the metrics read about one probe under one model."""

    answer: AnswerTokens
    answer_text: str  # the answer's tokens decoded without special tokens (zlib, ROUGE reference)
    paraphrased: AnswerTokens | None
    perturbed: tuple[AnswerTokens, ...] | None
    generation: str | None  # greedy answer, cut at the end token; None when not generated
