"""``engram concepts add | list | show | delete``: concept datasets and the collection of their statistics.

A concept's records come either from a local JSONL file, uploaded, or from a dataset the service's
worker fetches itself (``--dataset-uri``, with optional column mapping and row range); both are
checked here before anything is sent, so a usage mistake is a usage error rather than a failed job.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

import typer

from engram_client.cli.options import CallbackOpt, CursorOpt, DatasetFormat, JsonFlag, LimitOpt, NoWait, Role, Template
from engram_client.cli.output import emit, job_failed, note_next_page, print_lines, stderr
from engram_client.cli.progress import watch
from engram_client.cli.render import concept_state_lines, render_concept, render_concepts
from engram_client.cli.root import session

concepts_app = typer.Typer(help="Upload concept datasets and watch their collection.", no_args_is_help=True)

DATASET_FIELDS = ("text", "prompt", "completion", "messages")  # what --column may map
# The service's rules, checked here so that a mistake is named in CLI terms rather than as a regex.
CONCEPT_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
DATASET_SCHEMES = ("s3://", "hf://datasets/", "file:///")


def _parse_columns(columns: Sequence[str]) -> dict[str, str] | None:
    """``["prompt=question", "completion=answer"]`` as the reference's column mapping (record field to
    source column); the service says which combinations it takes."""
    mapping: dict[str, str] = {}
    for item in columns:
        field, sep, column = item.partition("=")
        field, column = field.strip(), column.strip()
        if not sep or field not in DATASET_FIELDS or not column:
            raise typer.BadParameter(
                f"{item!r} is not FIELD=COLUMN with FIELD one of {', '.join(DATASET_FIELDS)}", param_hint="--column"
            )
        if field in mapping:
            raise typer.BadParameter(f"{field} is mapped twice", param_hint="--column")
        mapping[field] = column
    return mapping or None


def _parse_rows(rows: str | None) -> dict[str, int] | None:
    """``START:STOP`` (either may be left out; STOP excluded) as the reference's row range."""
    if rows is None:
        return None
    start, sep, stop = rows.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = {"start": int(start) if start.strip() else 0}
        if stop.strip():
            bounds["stop"] = int(stop)
    except ValueError:
        raise typer.BadParameter(f"{rows!r} is not START:STOP (e.g. 0:5000, :100 or 100:)", param_hint="--rows") from None
    return bounds


def _reference_name(uri: str) -> str:
    """The default concept name of a reference: its last path segment's stem (``facts`` of ``…/facts.parquet``)."""
    return PurePosixPath(uri.split("?", 1)[0].rstrip("/")).stem


def _concept_name(name: str | None, file: Path | None, dataset_uri: str | None) -> str:
    """--name, or the stem of the file or URI; a stem that is no concept name asks for --name."""
    if name is not None:
        return name
    stem = file.stem if file is not None else _reference_name(dataset_uri or "")
    if not CONCEPT_NAME.fullmatch(stem):
        raise typer.BadParameter(
            f"the concept name would be {stem!r}, the stem of the dataset's name, but a concept name is 1 to 128 "
            "letters, digits, '.', '_' or '-': choose one with --name",
            param_hint="--name",
        )
    return stem


def _dataset_reference(
    dataset_uri: str, dataset_format: DatasetFormat | None, column: list[str] | None, rows: str | None
) -> dict[str, Any]:
    """The ``dataset`` the service's worker fetches: the URI and only the options that were given."""
    if not dataset_uri.startswith(DATASET_SCHEMES):
        raise typer.BadParameter(
            f"{dataset_uri} is not a URI the service fetches: s3://bucket/key, "
            "hf://datasets/org/name[@revision]/path or file:///abs/path (or upload a local FILE)",
            param_hint="--dataset-uri",
        )
    reference: dict[str, Any] = {"uri": dataset_uri}
    for key, value in (
        ("format", dataset_format.value if dataset_format else None),
        ("columns", _parse_columns(column or [])),
        ("rows", _parse_rows(rows)),
    ):
        if value is not None:
            reference[key] = value
    return reference


@concepts_app.command("add")
def concepts_add(
    ctx: typer.Context,
    model: Annotated[list[str], typer.Option("--model", "-m", help="Model to collect on (repeat for several).")],
    file: Annotated[
        Path | None,
        typer.Argument(exists=True, dir_okay=False, readable=True, help="JSONL, one record per line (or --dataset-uri)."),
    ] = None,
    dataset_uri: Annotated[
        str | None,
        typer.Option(
            "--dataset-uri",
            help="Instead of FILE: a dataset the service's worker fetches, s3://bucket/key, "
            "hf://datasets/org/name\\[@revision]/path or file:///abs/path (JSONL or Parquet).",
        ),
    ] = None,
    dataset_format: Annotated[
        DatasetFormat | None, typer.Option("--dataset-format", help="--dataset-uri's format (default: its extension).")
    ] = None,
    column: Annotated[
        list[str] | None,
        typer.Option(
            "--column",
            help="--dataset-uri: FIELD=COLUMN, the source column of a record field (repeat): text, "
            "prompt and completion, or messages.",
        ),
    ] = None,
    rows: Annotated[
        str | None, typer.Option(help="--dataset-uri: START:STOP, the rows to read (0-based, STOP excluded).")
    ] = None,
    template: Annotated[
        Template | None,
        typer.Option(help="chat: render prompt/completion records with the model's chat template as one-turn chats."),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Concept name (default: the stem of the file or of the URI's last segment).")
    ] = None,
    role: Annotated[Role, typer.Option(help="target (to edit) or reference (shapes the universe).")] = Role("target"),
    description: Annotated[str | None, typer.Option(help="Free text kept with the concept.")] = None,
    callback_url: CallbackOpt = None,
    module: Annotated[
        list[str] | None, typer.Option("--module", help="Collect only modules with this name suffix (repeat).")
    ] = None,
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Upload a concept dataset (or name one the service fetches) and watch its statistics being collected."""
    if (file is None) == (dataset_uri is None):
        raise typer.BadParameter("give a JSONL FILE or --dataset-uri (one of them)", param_hint="FILE/--dataset-uri")
    if dataset_uri is None and (dataset_format is not None or column or rows is not None):
        raise typer.BadParameter(
            "--dataset-format, --column and --rows describe a --dataset-uri", param_hint="--dataset-uri"
        )
    reference: dict[str, Any] | None = (
        None if dataset_uri is None else _dataset_reference(dataset_uri, dataset_format, column, rows)
    )
    name = _concept_name(name, file, dataset_uri)
    with session(ctx) as client:
        submission = client.add_concept(
            name,
            model,
            jsonl_path=file,
            dataset=reference,
            template=template.value if template else None,
            role=role.value,
            description=description,
            callback_url=callback_url,
            modules=module,
        )
        if reference is None:
            stderr.print(f"concept {name}: {submission.concept.num_records} records, collecting on {', '.join(model)}")
        else:
            stderr.print(f"concept {name}: {dataset_uri}, fetched by the worker, collecting on {', '.join(model)}")
        jobs = submission.jobs
        if not no_wait and jobs:
            jobs = watch(client, [job.job_id for job in jobs])
        concept = client.get_concept(name) if not no_wait else submission.concept
    emit(ctx, as_json, {"concept": concept, "jobs": jobs}, lambda: print_lines(concept_state_lines(concept)))
    for job in jobs:
        if job.status in {"failed", "cancelled"}:
            job_failed(job)


@concepts_app.command("list")
def concepts_list(ctx: typer.Context, limit: LimitOpt = None, cursor: CursorOpt = None, as_json: JsonFlag = False) -> None:
    """Concepts by name with their collection status per model (every page unless --limit/--cursor)."""
    with session(ctx) as client:
        concepts = client.list_concepts(limit=limit, cursor=cursor)
    emit(ctx, as_json, concepts, lambda: render_concepts(concepts))
    note_next_page(concepts.next_cursor)


@concepts_app.command("show")
def concepts_show(ctx: typer.Context, name: str, as_json: JsonFlag = False) -> None:
    """One concept."""
    with session(ctx) as client:
        concept = client.get_concept(name)
    emit(ctx, as_json, concept, lambda: render_concept(concept))


@concepts_app.command("delete")
def concepts_delete(
    ctx: typer.Context,
    name: str,
    statistics_only: Annotated[
        bool, typer.Option("--statistics-only", help="Delete only its statistics (the concept and its records stay).")
    ] = False,
    model: Annotated[str | None, typer.Option("--model", "-m", help="With --statistics-only: on this model only.")] = None,
) -> None:
    """Delete a concept with its statistics and records (those no other concept shares), or only its statistics."""
    if model is not None and not statistics_only:
        raise typer.BadParameter("--model goes with --statistics-only (a concept is deleted on every model)")
    with session(ctx) as client:
        if statistics_only:
            client.delete_statistics(name, model)
        else:
            client.delete_concept(name)
    what = f"the statistics of concept {name}" + (f" on {model}" if model else "") if statistics_only else f"concept {name}"
    stderr.print(f"deleted {what}")
