"""Watching jobs and downloads: a rich progress bar on a terminal, throttled plain lines elsewhere.

Pipes and CI logs get one plain line per change, at most one a second per job, with the whole ID
so it can be copied from the log::

    collect job 3f2a…e1 120/300 tokens (40%) running

Ctrl-C while watching stops the watching only (exit 130): the service keeps working on the job.
Ctrl-C while downloading exits 130 too, and leaves the output directory as it was.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import filesize
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Column
from rich.text import Text

from api_schemas import Job, Variant, VariantFile
from engram_client.cli.output import fail, stderr
from engram_client.client import FINISHED, EngramClient

SHORT_ID = 8  # characters of a job or variant ID shown in a progress bar
PLAIN_EVERY_S = 1.0  # at most one plain progress line per second per job: CI logs stay readable


class _Count(ProgressColumn):
    """``done/total unit``; sizes in bytes are shown human-readable."""

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit", "")
        if unit == "bytes":
            total = filesize.decimal(int(task.total)) if task.total else "?"
            return Text(f"{filesize.decimal(int(task.completed))}/{total}")
        total = f"{int(task.total)}" if task.total else "?"
        return Text(f"{int(task.completed)}/{total} {unit}")


class ProgressView:
    """Progress of jobs and downloads: a rich bar on a terminal, throttled plain lines otherwise."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._bars: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._shown: dict[str, tuple[Any, ...]] = {}
        self._shown_at: dict[str, float] = {}

    def __enter__(self) -> ProgressView:
        if self.console.is_terminal:
            columns = (
                TextColumn("{task.description}"),
                BarColumn(),
                _Count(table_column=Column(no_wrap=True)),
                TaskProgressColumn(),
                TimeElapsedColumn(),
            )
            self._bars = Progress(*columns, console=self.console)
            self._bars.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._bars is not None:
            self._bars.stop()

    def job(self, job: Job) -> None:
        """Show a job's progress (the callback of ``wait_for_jobs``)."""
        p = job.progress
        # A bar has one line: a short ID there; plain lines keep the whole ID for copying from a log.
        job_id = job.job_id[:SHORT_ID] if self._bars is not None else job.job_id
        self.show(job.job_id, f"{job.kind} job {job_id}", p.done, p.total, p.unit, job.status, job.status in FINISHED)

    def show(self, key: str, label: str, done: int, total: int, unit: str, note: str = "", final: bool = False) -> None:
        """Show ``done`` of ``total`` ``unit`` for ``key``; ``final`` forces the plain line out."""
        if self._bars is not None:
            self._bar(key, label, done, total, unit, note)
            return
        state = (done, total, note)
        now = time.monotonic()
        if state == self._shown.get(key) or (not final and now - self._shown_at.get(key, -1e9) < PLAIN_EVERY_S):
            return
        self._shown[key], self._shown_at[key] = state, now
        self.console.print(_plain_progress(label, done, total, unit, note), soft_wrap=True)

    def _bar(self, key: str, label: str, done: int, total: int, unit: str, note: str) -> None:
        assert self._bars is not None
        description = f"{label} {note}".strip()
        if key not in self._tasks:
            self._tasks[key] = self._bars.add_task(description, total=total or None, unit=unit)
        self._bars.update(self._tasks[key], description=description, completed=done, total=total or None)


def _plain_progress(label: str, done: int, total: int, unit: str, note: str) -> str:
    """``collect job <id> 120/300 tokens (40%) running``; bytes human-readable; ``?`` while the total is unknown."""
    shown_total = str(total) if total or note in FINISHED else "?"  # a queued job reports 0/0 until it starts
    if unit == "bytes":
        amount = f"{filesize.decimal(done)}/{filesize.decimal(total)}"
    else:
        amount = f"{done}/{shown_total} {unit}"
    percent = f" ({100 * done // total}%)" if total else ""
    return f"{label} {amount}{percent} {note}".rstrip()


def watch(client: EngramClient, job_ids: Sequence[str]) -> list[Job]:
    """Watch jobs to the end with progress; Ctrl-C stops watching (exit 130), never the jobs."""
    try:
        with ProgressView(stderr) as view:
            return client.wait_for_jobs(job_ids, on_progress=view.job)
    except KeyboardInterrupt:
        hint = "; ".join(f"engram jobs watch {job_id}" for job_id in job_ids)
        fail("Stopped watching", f"the service keeps working: {hint}", code=130)


def download(client: EngramClient, variant: Variant, out: Path, force: bool) -> None:
    """Download a ready variant with one progress bar over all its bytes; say where it went."""
    total = sum(f.size for f in variant.files)
    received: dict[str, int] = {}

    with ProgressView(stderr) as view:
        label = f"download {variant.variant_id[:SHORT_ID] if stderr.is_terminal else variant.variant_id}"

        def progress(entry: VariantFile, done: int) -> None:
            received[entry.path] = done
            got = sum(received.values())
            view.show("download", label, got, total, "bytes", final=got == total)

        try:
            client.download_variant(variant.variant_id, out, overwrite=force, on_progress=progress)
        except KeyboardInterrupt:  # the client removed its staging directory: nothing half-written remains
            fail("Download interrupted", f"{out} is as it was; run the same command again to download", code=130)
    size = filesize.decimal(total)
    files = f"{len(variant.files)} file" + ("s" if len(variant.files) != 1 else "")
    stderr.print(f"variant {variant.variant_id} in {out}: {files}, {size}, sha256 verified")
