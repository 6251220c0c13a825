"""The collection of a text concept on a language model: stored text records to token batches.

The stored dataset is read from a local file one line at a time, twice: once to count the tokens
that enter the statistics (:class:`~service.concepts.collected.Survey`: what ``max_length`` cut is
reported, never silent), once in chunks to collect them; no whole dataset is in memory. Every text
is cut to a character budget before it is tokenized (a record of any size costs bounded memory;
:mod:`service.engine.record_budget`), and chat templates render in a child process bounded by
ENGRAM_TEMPLATE_TIMEOUT_S / _MEMORY_BYTES / _MAX_CHARS, checking cancellation every 0.1 s.
Progress counts tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from service.concepts.collected import CancelCheck, Collected, Survey
from service.concepts.plan import Collection
from service.concepts.service import CHAT_KINDS
from service.context import Context
from service.datasets.stored import check_text_records, iter_records, row_name
from service.engine.collect import collect_statistics
from service.engine.layers import LayerSpec
from service.engine.record_budget import char_budget
from service.engine.records import Batch, Example, RecordError, encode_record, make_batches, pad_token_id
from service.engine.template_render import TemplateProcess
from service.errors import JobFailed
from service.jobs.progress import ProgressReporter
from service.jobs.templates import template_limits

log = logging.getLogger("engram.collection")

SORT_CHUNK = 8192  # examples sorted by length together (a batch wastes little on padding)


def collect_texts(
    ctx: Context,
    job_id: str,
    collection: Collection,
    loaded: tuple[Any, Any],
    path: Path,
    layers: Sequence[LayerSpec],
    cancelled: CancelCheck,
) -> Collected:
    """A text concept's statistics on a language model (``loaded``: the model and its tokenizer).

    Raises:
        InvalidInput: an image record in the dataset (named).
        JobFailed: a record the model cannot read (a chat without its template), or no counted token.
    """
    model, tokenizer = loaded
    spec, model_id, first_row = collection.spec, collection.payload.model_id, collection.plan.first_row
    check_text_records(path, model_id, first_row)  # a reference's image records, named
    budget = char_budget(tokenizer, spec.max_length)
    with TemplateProcess(template_limits(ctx.settings), cancelled) as renderer:

        def examples() -> Iterator[Example]:
            for i, record in enumerate(iter_records(path)):
                try:
                    where = row_name(i, first_row)
                    yield encode_record(
                        tokenizer, record, spec.max_length, spec.template, index=where, budget=budget, renderer=renderer
                    )
                except RecordError as exc:
                    raise JobFailed(chat_problem(str(exc), model_id)) from None

        survey = _surveyed(examples(), spec.max_length, cancelled, collection.payload.concept)
        progress = ProgressReporter(ctx, job_id, survey.tokens)
        started = time.monotonic()
        batches = _chunked_batches(examples(), ctx.settings.collect_batch_size, pad_token_id(tokenizer))
        stats = collect_statistics(model, batches, layers, on_batch=progress.advance, should_stop=progress.cancelled)
    return Collected(stats, survey.report(), time.monotonic() - started)


def _surveyed(examples: Iterable[Example], max_length: int, cancelled: CancelCheck, concept: str) -> Survey:
    """The first pass's survey; a dataset without a counted token fails, a truncation is logged."""
    survey = Survey.of(examples, max_length, cancelled)
    if survey.tokens == 0:
        raise JobFailed(survey.nothing_counted())
    if survey.truncated:
        log.warning("collection of %s: %s", concept, survey.report())
    return survey


def _chunked_batches(examples: Iterable[Example], batch_size: int, pad_id: int) -> Iterator[Batch]:
    """Right-padded batches of ``examples``, sorted by length within chunks of :data:`SORT_CHUNK`
    (a dataset up to that size gives exactly the batches ``make_batches`` gives for it whole)."""
    chunk: list[Example] = []
    for example in examples:
        chunk.append(example)
        if len(chunk) == SORT_CHUNK:
            yield from make_batches(chunk, batch_size, pad_id)
            chunk = []
    if chunk:
        yield from make_batches(chunk, batch_size, pad_id)


def chat_problem(message: str, model_id: str) -> str:
    """A record's chat problem as the job says it: naming the model when it has no chat template."""
    if "has no chat template" in message:
        return (
            f"model {model_id} has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json), "
            f"which {CHAT_KINDS} need ({message})"
        )
    return message
