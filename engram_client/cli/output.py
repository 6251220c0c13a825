"""Where the CLI's words go: results on stdout, progress, status lines and errors on stderr.

Keeping the two streams apart is what lets ``engram --json unlearn ... | jq`` work while the build
is being watched; every command prints through the two consoles here and fails through
:func:`fail`, so the convention holds everywhere.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.text import Text

from api_schemas import Job, JobResult


def _console(stderr: bool) -> Console:
    """A console without markup (server text may hold ``[brackets]``); wide when it is not a terminal."""
    console = Console(stderr=stderr, markup=False, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        # Rich assumes 80 columns off a terminal, which would fold 32-character variant IDs in logs.
        console = Console(stderr=stderr, markup=False, highlight=False, width=200)
    return console


stdout = _console(stderr=False)  # results
stderr = _console(stderr=True)  # progress, status, errors


def fail(title: str, detail: str | None = None, code: int = 1) -> NoReturn:
    """Print ``title: detail`` in red on stderr and exit with ``code`` (1 unless told otherwise)."""
    message = Text(title, style="bold red")
    if detail:
        message.append(f": {detail}", style="red")
    stderr.print(message)
    raise typer.Exit(code)


def job_failed(job: Job) -> NoReturn:
    """Print why a job did not succeed (its problem, when it has one) and exit 1."""
    if job.error is not None:
        fail(f"{job.kind} job {job.job_id} {job.status}: {job.error.title}", job.error.detail)
    fail(f"{job.kind} job {job.job_id} {job.status}")


def _wants_json(ctx: typer.Context, flag: bool) -> bool:
    """``--json`` may be given before the command (global) or after it (the command's own flag)."""
    return flag or ctx.obj.json


def jsonable(data: Any) -> Any:
    """Pydantic models (also inside lists and dicts) as their JSON-mode dumps; anything else unchanged. A job's
    result is dumped as the service answered it: only the fields it sent (no defaults filled in)."""
    if isinstance(data, JobResult):
        return data.model_dump(mode="json", exclude_unset=True)
    if isinstance(data, Job) and isinstance(data.result, JobResult):
        return {**data.model_dump(mode="json"), "result": jsonable(data.result)}
    if isinstance(data, BaseModel):
        return data.model_dump(mode="json")
    if isinstance(data, (list, tuple)):
        return [jsonable(item) for item in data]
    if isinstance(data, dict):
        return {key: jsonable(value) for key, value in data.items()}
    return data


def emit(ctx: typer.Context, as_json: bool, data: Any, render: Callable[[], None]) -> None:
    """JSON on stdout in ``--json`` mode, the human rendering otherwise."""
    if _wants_json(ctx, as_json):
        sys.stdout.write(json.dumps(jsonable(data), indent=2) + "\n")
        sys.stdout.flush()
    else:
        render()


def note_next_page(next_cursor: str | None) -> None:
    """After one page of a list (``--limit``/``--cursor``): say on stderr how to ask for the next."""
    if next_cursor is not None:
        stderr.print(f"more items follow: repeat with --cursor {next_cursor}")


def print_lines(lines: Sequence[str]) -> None:
    """Each line on stdout as it is (no wrapping of its own beyond the console's)."""
    for line in lines:
        stdout.print(line)
