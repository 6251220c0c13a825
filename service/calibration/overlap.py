"""Retain probes the universe itself holds: a retain floor measured on them is optimistic.

An unlearn edit removes what is specific to the removed concepts *relative to the universe*: a
reference concept's own records are what the edit is built to spare. A calibration whose retain
probes are those records measures its retain floor where the edit cannot hurt first: on the real
LLM (docs/real-model.md, "Why the calibrated edit keeps fewer unseen kept facts…") the symbols in
the reference stayed at 100% up to α 0.2 while symbols no concept held had lost one at 0.175, and
the recommendation sat where the unseen ones were past the floor. The calibration therefore counts,
per universe concept, the retain probes that are its records, and its result says so (a field and a
warning), so that a user sends retain probes of the kept kind the concepts do not contain.

A probe and a record are the same text when their words match (whitespace, letter case and a
closing full stop or other end punctuation aside): a prompt/completion probe is its prompt followed
by its completion, a record its text, its prompt and completion, or its turns' contents.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from service.concepts.service import find_concept
from service.context import Context
from service.datasets.stored import local_dataset
from service.engine.records import Record
from service.storage.base import ObjectNotFound

END_PUNCTUATION = " .!?;:"


def text_key(text: str) -> str:
    """The words of ``text``, lower-cased, joined by single spaces, without closing punctuation."""
    return " ".join(text.split()).casefold().rstrip(END_PUNCTUATION)


def probe_key(probe: Mapping[str, Any]) -> str | None:
    """The text a stored text probe stands for (None for an image probe)."""
    if probe.get("messages") is not None:
        return text_key(" ".join(str(turn.get("content", "")) for turn in probe["messages"]))
    if probe.get("prompt") is None:
        return None
    return text_key(f"{probe['prompt']}{probe.get('completion') or ''}")


def record_key(record: Record) -> str:
    """The text a concept record stands for (as :func:`probe_key` reads a probe)."""
    if record.text is not None:
        return text_key(record.text)
    if record.messages is not None:
        return text_key(" ".join(turn.content for turn in record.messages))
    return text_key(f"{record.prompt or ''}{record.completion or ''}")


def _record_keys(path: Path) -> Iterable[str]:
    """Each record's text key (a text model's concept holds text records only: image ones are refused)."""
    with path.open("rb") as handle:
        for i, line in enumerate(handle):
            yield record_key(Record.from_mapping(json.loads(line), i))


def retain_probes_held(ctx: Context, concepts: Sequence[str], retain: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Per concept of ``concepts`` (the universe's, in its order), how many ``retain`` probes are its
    records; a concept holding none is left out, so an empty answer means none is held.

    A concept whose dataset is not stored (deleted since the universe was built) counts none: its
    statistics are what the universe holds, and nothing can be said of its records.
    """
    wanted: dict[str, int] = {}
    for probe in retain:
        key = probe_key(probe)
        if key:
            wanted[key] = wanted.get(key, 0) + 1
    held: dict[str, int] = {}
    if not wanted:
        return held
    for name in concepts:
        concept = find_concept(ctx, name)
        if concept is None or concept.dataset_digest is None:
            continue
        with tempfile.TemporaryDirectory(prefix="engram-overlap-") as scratch:
            try:
                path = local_dataset(ctx.storage, concept.dataset_digest, Path(scratch))
            except ObjectNotFound:
                continue
            found = {key for key in _record_keys(path) if key in wanted}
        count = sum(wanted[key] for key in found)
        if count:
            held[name] = count
    return held


def held_warning(held: Mapping[str, int], total: int) -> list[str]:
    """The result's warning when retain probes are records of the universe's concepts."""
    if not held:
        return []
    count = sum(held.values())
    named = ", ".join(f"{name} ({n})" for name, n in held.items())
    share = "all" if count >= total else f"{count} of the {total}"
    return [
        f"{share} retain probes are records of the universe's concepts ({named}): the edit is built to spare "
        "its own records, so the retain exact match measured on them, and the floor it holds, is optimistic "
        "about facts of their kind no concept holds; send retain probes the concepts do not contain (facts of "
        "the kept kind left out of the reference) to measure what the edit does to the rest"
    ]
