"""What a collection's two readers (text records, image records) hand to its one publication, and
the cancellation check every phase of a collection reads.

:class:`Survey` is the account of what ``max_length`` did to a dataset: the job result and the
statistics manifest give the records read, those truncated (how many, the tokens cut, the first
indices) and those left without a counted token (a completion or assistant turn wholly beyond the
limit adds nothing to the statistics), so that a dataset is never shortened silently. An image is
never cut: its survey counts records only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from service.context import Context
from service.engine.collect import LayerStatistics
from service.engine.records import Example
from service.jobs.progress import JobCancelled

FIRST_LISTED = 10  # record indices a truncation report lists
CANCEL_CHECK_S = 0.5  # how often a collection's loops read the job record for a cancellation


@dataclass(frozen=True)
class Collected:
    """A dataset's statistics, the survey's report of them and the seconds the collection took."""

    stats: LayerStatistics
    report: dict[str, Any]
    seconds: float


@dataclass
class Survey:
    """What ``max_length`` did to a dataset: the counted tokens, the records it truncated and those
    it left without a counted token (which then add nothing to the statistics)."""

    max_length: int
    records: int = 0
    tokens: int = 0
    truncated: int = 0
    cut_tokens: int = 0
    uncounted: int = 0
    first_truncated: list[int] = field(default_factory=list)
    first_uncounted: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, examples: Iterable[Example], max_length: int, should_stop: Callable[[], bool] | None = None) -> Survey:
        """One pass over the tokenized records, stopping when ``should_stop`` says so (a large
        dataset's first pass takes minutes: a cancellation must not wait for its end).

        Raises:
            JobCancelled: ``should_stop`` returned True.
        """
        survey = cls(max_length)
        for index, example in enumerate(examples):
            if should_stop is not None and should_stop():
                raise JobCancelled()
            survey.add(index, example)
        return survey

    def add(self, index: int, example: Example) -> None:
        counted = sum(example.counted)
        self.records += 1
        self.tokens += counted
        if example.cut:
            self.truncated += 1
            self.cut_tokens += example.cut
            if len(self.first_truncated) < FIRST_LISTED:
                self.first_truncated.append(index)
        if counted == 0:
            self.uncounted += 1
            if len(self.first_uncounted) < FIRST_LISTED:
                self.first_uncounted.append(index)

    def report(self) -> dict[str, Any]:
        """The job result's and the manifest's account of it."""
        return {
            "records": self.records,
            "truncated": {
                "max_length": self.max_length,
                "records": self.truncated,
                "tokens": self.cut_tokens,
                "first": self.first_truncated,
            },
            "uncounted": {"records": self.uncounted, "first": self.first_uncounted},
        }

    def nothing_counted(self) -> str:
        """Why a dataset without a counted token fails, naming the setting when truncation is why."""
        if self.truncated:
            return (
                "no record has a token that enters the statistics: the counted tokens (completions, assistant "
                f"turns) lie beyond max_length {self.max_length} (ENGRAM_MAX_LENGTH) in every record "
                f"({self.truncated} of {self.records} truncated)"
            )
        return "no record has a token that enters the statistics"


class CancelCheck:
    """Whether the job was cancelled, read from its record at most every :data:`CANCEL_CHECK_S`
    (a loop over records may call it for each one)."""

    def __init__(self, ctx: Context, job_id: str) -> None:
        self.ctx, self.job_id, self._last = ctx, job_id, 0.0

    def __call__(self, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now - self._last < CANCEL_CHECK_S:
            return False
        self._last = now
        job = self.ctx.jobs.get(self.job_id)
        return bool(job and job.cancel_requested)
