"""The ``engram`` command line: register models, upload concepts, unlearn, download, evaluate and map.

Results (tables, or JSON with ``--json``) go to stdout; progress, status lines and errors go to
stderr, so ``engram --json unlearn ... | jq`` works while the build is being watched. On a terminal,
progress is a rich progress bar; anywhere else (pipes, CI logs) it is one plain line per change::

    collect 3f2a…e1 120/300 tokens (40%) running

Errors print the service's problem (title and detail) in red and exit 1; an interrupted watch exits
130 and leaves the job running. ``--url``/``ENGRAM_URL`` and ``--api-key``/``ENGRAM_API_KEY`` say
which service to talk to and how to authenticate.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import struct
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, NoReturn

import typer
from pydantic import BaseModel
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
from rich.table import Column, Table
from rich.text import Text

from api_schemas import CalibrationResult, Concept, Job, Model, Variant, VariantFile, VariantSubmission
from engram_client.calibrate import calibrate, calibration_front_png, get_calibration
from engram_client.client import (
    DEFAULT_URL,
    FINISHED,
    EngramAPIError,
    EngramClient,
    EngramConnectionError,
    EngramError,
    EngramJobError,
    EngramOutputExistsError,
)

SHORT_ID = 8  # characters of a job or variant ID shown in a progress bar
PLAIN_EVERY_S = 1.0  # at most one plain progress line per second per job: CI logs stay readable


def _console(stderr: bool) -> Console:
    """A console without markup (server text may hold ``[brackets]``); wide when it is not a terminal."""
    console = Console(stderr=stderr, markup=False, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        # Rich assumes 80 columns off a terminal, which would fold 32-character variant IDs in logs.
        console = Console(stderr=stderr, markup=False, highlight=False, width=200)
    return console


stdout = _console(stderr=False)  # results
stderr = _console(stderr=True)  # progress, status, errors

app = typer.Typer(
    name="engram",
    help="Make transformers models forget concepts with closed-form AI Engram edits (Engram Service client).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="Register and inspect models.", no_args_is_help=True)
concepts_app = typer.Typer(help="Upload concept datasets and watch their collection.", no_args_is_help=True)
jobs_app = typer.Typer(help="Watch, inspect and cancel jobs.", no_args_is_help=True)
variants_app = typer.Typer(help="List, inspect and download variants.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(concepts_app, name="concepts")
app.add_typer(jobs_app, name="jobs")
app.add_typer(variants_app, name="variants")


class Role(str, Enum):
    target = "target"
    reference = "reference"


class Scaling(str, Enum):
    uniform = "uniform"
    weight_norm = "weight_norm"


class Format(str, Enum):
    checkpoint = "checkpoint"
    delta = "delta"
    peft = "peft"


class Generator(str, Enum):
    base = "base"
    variant = "variant"


class DatasetFormat(str, Enum):
    jsonl = "jsonl"
    parquet = "parquet"


class Template(str, Enum):
    chat = "chat"


DATASET_FIELDS = ("text", "prompt", "completion", "messages")  # what --column may map


# Options shared by several commands (Annotated aliases keep the signatures short).
JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
NoWait = Annotated[bool, typer.Option("--no-wait", help="Submit and return at once; do not watch the job.")]
OutDir = Annotated[Path | None, typer.Option("--out", "-o", help="Download the variant into this new directory.")]
Force = Annotated[bool, typer.Option("--force", help="Replace a non-empty --out directory (only once all files verified).")]
ScalingOpt = Annotated[Scaling | None, typer.Option(help="Per-layer strength (weight_norm: the paper's W-Norm).")]
ModuleOpt = Annotated[list[str] | None, typer.Option("--module", help="Edit only modules with this name suffix (repeat).")]
LayerOpt = Annotated[list[int] | None, typer.Option("--layer", help="Edit only this block index (repeat).")]
RcondOpt = Annotated[float | None, typer.Option(help="Pseudo-inverse cut: keep eigenvalues above rcond·λmax.")]
ReferenceOpt = Annotated[
    list[str] | None, typer.Option("--reference", help="Reference concept (repeat; default: every ready concept).")
]
FormatOpt = Annotated[Format | None, typer.Option("--format", help="checkpoint, delta (changed tensors) or peft (LoRA).")]
LoraRankOpt = Annotated[int | None, typer.Option(help="Format peft: the largest LoRA rank.")]
CallbackOpt = Annotated[str | None, typer.Option(help="URL the service POSTs the job to when it ends.")]


@dataclass
class State:
    """The global options, handed to every command through the typer context."""

    url: str
    api_key: str | None
    json: bool
    timeout: float


def _print_version(value: bool) -> None:
    if value:
        stdout.print(f"engram {_package_version()}")
        raise typer.Exit()


def _package_version() -> str:
    try:
        return importlib.metadata.version("engram-client")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


@app.callback()
def main(
    ctx: typer.Context,
    url: Annotated[str, typer.Option(envvar="ENGRAM_URL", help="The service's base URL.")] = DEFAULT_URL,
    api_key: Annotated[
        str | None, typer.Option(envvar="ENGRAM_API_KEY", help="API key (sent as a Bearer token).", show_default=False)
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each HTTP answer.")] = 60.0,
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Engram Service client: every command talks to the service at --url (ENGRAM_URL)."""
    ctx.obj = State(url=url, api_key=api_key or None, json=json_output, timeout=timeout)


# ---------------------------------------------------------------- plumbing


@contextmanager
def _session(ctx: typer.Context) -> Iterator[EngramClient]:
    """A client for the command; every client error becomes a red message on stderr and exit code 1."""
    state: State = ctx.obj
    try:
        with EngramClient(state.url, state.api_key, timeout=state.timeout) as client:
            yield client
    except EngramAPIError as exc:
        _fail(f"{exc.title} ({exc.status})", exc.detail)
    except EngramJobError as exc:
        _job_failed(exc.job)
    except EngramConnectionError as exc:
        _fail("Connection error", f"{exc}; check --url or ENGRAM_URL")
    except EngramOutputExistsError as exc:
        _fail("Error", f"{exc}; choose a new directory or pass --force to replace it")
    except EngramError as exc:
        _fail("Error", str(exc))
    except OSError as exc:  # a local file: the dataset to upload, the download directory
        _fail("Error", str(exc))


def _fail(title: str, detail: str | None = None, code: int = 1) -> NoReturn:
    message = Text(title, style="bold red")
    if detail:
        message.append(f": {detail}", style="red")
    stderr.print(message)
    raise typer.Exit(code)


def _job_failed(job: Job) -> NoReturn:
    """Print why a job did not succeed (its problem, when it has one) and exit 1."""
    if job.error is not None:
        _fail(f"{job.kind} job {job.job_id} {job.status}: {job.error.title}", job.error.detail)
    _fail(f"{job.kind} job {job.job_id} {job.status}")


def _wants_json(ctx: typer.Context, flag: bool) -> bool:
    return flag or ctx.obj.json


def _jsonable(data: Any) -> Any:
    if isinstance(data, BaseModel):
        return data.model_dump(mode="json")
    if isinstance(data, (list, tuple)):
        return [_jsonable(item) for item in data]
    if isinstance(data, dict):
        return {key: _jsonable(value) for key, value in data.items()}
    return data


def _emit(ctx: typer.Context, as_json: bool, data: Any, render: Callable[[], None]) -> None:
    """JSON on stdout in ``--json`` mode, the human rendering otherwise."""
    if _wants_json(ctx, as_json):
        sys.stdout.write(json.dumps(_jsonable(data), indent=2) + "\n")
        sys.stdout.flush()
    else:
        render()


# ---------------------------------------------------------------- progress


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


def _watch(client: EngramClient, job_ids: Sequence[str]) -> list[Job]:
    """Watch jobs to the end with progress; Ctrl-C stops watching (exit 130), never the jobs."""
    try:
        with ProgressView(stderr) as view:
            return client.wait_for_jobs(job_ids, on_progress=view.job)
    except KeyboardInterrupt:
        hint = "; ".join(f"engram jobs watch {job_id}" for job_id in job_ids)
        _fail("Stopped watching", f"the service keeps working: {hint}", code=130)


def _download(client: EngramClient, variant: Variant, out: Path, force: bool) -> None:
    """Download a ready variant with one progress bar over all its bytes; say where it went."""
    total = sum(f.size for f in variant.files)
    received: dict[str, int] = {}

    with ProgressView(stderr) as view:
        label = f"download {variant.variant_id[:SHORT_ID] if stderr.is_terminal else variant.variant_id}"

        def progress(entry: VariantFile, done: int) -> None:
            received[entry.path] = done
            got = sum(received.values())
            view.show("download", label, got, total, "bytes", final=got == total)

        client.download_variant(variant.variant_id, out, overwrite=force, on_progress=progress)
    size = filesize.decimal(total)
    files = f"{len(variant.files)} file" + ("s" if len(variant.files) != 1 else "")
    stderr.print(f"variant {variant.variant_id} in {out}: {files}, {size}, sha256 verified")


# ---------------------------------------------------------------- rendering


def _table(*columns: str) -> Table:
    table = Table(*columns, header_style="bold", show_edge=False, pad_edge=False)
    for column in table.columns:
        column.overflow = "fold"  # never cut an ID with an ellipsis: users copy them
    return table


def _render_models(models: Sequence[Model]) -> None:
    table = _table("model", "architecture", "parameters", "layers", "source")
    for m in models:
        table.add_row(m.model_id, m.architecture, f"{m.num_parameters:,}", str(len(m.layers)), m.source)
    stdout.print(table)


def _render_model(model: Model) -> None:
    stdout.print(f"{model.model_id}: {model.architecture}, {model.num_parameters:,} parameters")
    stdout.print(f"source {model.source}  digest {model.digest}")
    table = _table("layer", "in", "out", "bias")
    for layer in model.layers:
        table.add_row(layer.name, str(layer.in_features), str(layer.out_features), "yes" if layer.bias else "no")
    stdout.print(table)


def _concept_state_lines(concept: Concept) -> list[str]:
    lines = []
    if concept.dataset is not None:  # a reference: where it is and what it resolved to
        reference = concept.dataset
        resolved = f"{concept.num_records} records, " if concept.num_records is not None else ""
        lines.append(f"{concept.name}: {reference.uri} ({resolved}{reference.status})")
        if reference.error:
            lines.append(f"{concept.name}: {reference.error}")
    if concept.template:
        lines.append(f"{concept.name}: records rendered with the chat template ({concept.template})")
    for model_id, state in concept.models.items():
        tokens = f" ({state.tokens} tokens)" if state.tokens is not None else ""
        lines.append(f"{concept.name} on {model_id}: {state.status}{tokens}")
    return lines


def _print_lines(lines: Sequence[str]) -> None:
    for line in lines:
        stdout.print(line)


def _render_concepts(concepts: Sequence[Concept]) -> None:
    table = _table("concept", "role", "records", "models")
    for c in concepts:
        states = ", ".join(f"{m}: {s.status}" + (f" ({s.tokens} tokens)" if s.tokens else "") for m, s in c.models.items())
        table.add_row(c.name, c.role, str(c.num_records), states)
    stdout.print(table)


def _render_concept(concept: Concept) -> None:
    stdout.print(f"{concept.name}: {concept.role}, {concept.num_records} records, dataset {concept.dataset_digest}")
    if concept.description:
        stdout.print(concept.description)
    _print_lines(_concept_state_lines(concept))


def _render_job(job: Job) -> None:
    p = job.progress
    percent = f" ({100 * p.done // p.total}%)" if p.total else ""
    stdout.print(f"{job.kind} job {job.job_id}: {job.status}, {p.done}/{p.total} {p.unit}{percent}")
    times = {"created": job.created_at, "started": job.started_at, "finished": job.finished_at}
    stdout.print("  ".join(f"{k} {v.isoformat(timespec='seconds')}" for k, v in times.items() if v is not None))
    if job.result:
        stdout.print(f"result {json.dumps(job.result)}")
    if job.error is not None:
        stdout.print(Text(f"{job.error.title}: {job.error.detail}", style="red"))


def _terms(variant: Variant) -> str:
    return ", ".join(f"{name}={coefficient:g}" for name, coefficient in variant.terms.items())


def _render_variants(variants: Sequence[Variant]) -> None:
    table = _table("variant", "model", "terms", "scaling", "format", "status", "size")
    for v in variants:
        size = filesize.decimal(sum(f.size for f in v.files)) if v.files else "-"
        table.add_row(v.variant_id, v.model_id, _terms(v), v.scaling, v.format, v.status, size)
    stdout.print(table)


def _render_variant(variant: Variant) -> None:
    stdout.print(f"variant {variant.variant_id} of {variant.model_id}: {variant.status}")
    stdout.print(f"terms {_terms(variant)}  scaling {variant.scaling}  format {variant.format}")
    stdout.print(f"reference {', '.join(variant.reference) or '-'}")
    selection = {"modules": variant.modules, "layers": variant.layers, "rcond": variant.rcond}
    chosen = "  ".join(f"{k} {v}" for k, v in selection.items() if v is not None)
    if chosen:
        stdout.print(chosen)
    if variant.files:
        table = _table("file", "size", "sha256")
        for f in variant.files:
            table.add_row(f.path, str(f.size), f.sha256)
        stdout.print(table)


def _numeric_table(*columns: str) -> Table:
    """A :func:`_table` whose columns after the first are right-aligned numbers."""
    table = _table(*columns)
    for column in table.columns[1:]:
        column.justify = "right"
    return table


def _render_evaluation(result: dict[str, Any]) -> None:
    """Split × {base, variant}: mean answer NLL, the NLL ratio variant/base, greedy exact match."""
    summary = result["summary"]
    table = _numeric_table("split", "probes", "base NLL", "variant NLL", "NLL ratio", "base exact", "variant exact")
    table.caption = "NLL ratio = variant / base: above 1, the variant finds the answers less likely"
    for split in ("forget", "retain"):
        base, edited = summary["base"].get(split), summary["variant"].get(split)
        if base is None or edited is None:  # no probes of this split were sent
            continue
        ratio = f"{edited['mean_nll'] / base['mean_nll']:.4g}" if base["mean_nll"] > 0 else "-"
        nll = (f"{base['mean_nll']:.4g}", f"{edited['mean_nll']:.4g}", ratio)
        table.add_row(split, str(base["n"]), *nll, f"{base['exact_match']:.1%}", f"{edited['exact_match']:.1%}")
    stdout.print(table)


def _render_generation(result: dict[str, Any]) -> None:
    for name, output in result["outputs"].items():
        line = Text(f"{name}: ", style="bold")
        line.append(output["text"])
        stdout.print(line, soft_wrap=True)


def _render_map(data: dict[str, Any]) -> None:
    """Per concept: its largest ρ and where, a blocks × module types table (3 significant digits), the rest."""
    for n, name in enumerate(data["concepts"]):
        entry = data["maps"][name]
        if n:
            stdout.print()
        stdout.print(Text(f"{name}: max ρ {entry['max']:.3g} at {entry['argmax']}", style="bold"))
        table = _numeric_table("block", *data["modules"])
        for block, row in zip(data["blocks"], entry["rho"], strict=True):
            table.add_row(str(block), *("-" if rho is None else f"{rho:.3g}" for rho in row))
        stdout.print(table)
        outside = data["outside_blocks"].get(name) or {}
        if outside:
            stdout.print("outside the blocks: " + "  ".join(f"{layer} {rho:.3g}" for layer, rho in outside.items()))


# ---------------------------------------------------------------- models


def _source_uri(source: str) -> str:
    """A bare local directory becomes ``file:///abs/dir``; URIs pass unchanged."""
    if "://" not in source and Path(source).is_dir():
        return Path(source).resolve().as_uri()
    return source


@models_app.command("add")
def models_add(
    ctx: typer.Context,
    model_id: Annotated[str, typer.Argument(help="Hugging Face style ID: name or org/name.")],
    source: Annotated[str, typer.Argument(help="file:///abs/dir, s3://bucket/prefix/, hf://org/name[@rev] or a local dir.")],
    as_json: JsonFlag = False,
) -> None:
    """Register a model checkpoint (the same registration again is a no-op)."""
    with _session(ctx) as client:
        model = client.register_model(model_id, _source_uri(source))
    _emit(
        ctx,
        as_json,
        model,
        lambda: stdout.print(
            f"model {model.model_id}: {model.architecture}, {model.num_parameters:,} parameters, "
            f"{len(model.layers)} editable layers"
        ),
    )


@models_app.command("list")
def models_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Every registered model."""
    with _session(ctx) as client:
        models = client.list_models()
    _emit(ctx, as_json, models, lambda: _render_models(models))


@models_app.command("show")
def models_show(ctx: typer.Context, model_id: str, as_json: JsonFlag = False) -> None:
    """One model and its editable layers."""
    with _session(ctx) as client:
        model = client.get_model(model_id)
    _emit(ctx, as_json, model, lambda: _render_model(model))


# ---------------------------------------------------------------- concepts


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
            "hf://datasets/org/name[@revision]/path or file:///abs/path (JSONL or Parquet).",
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
    role: Annotated[Role, typer.Option(help="target (to edit) or reference (shapes the universe).")] = Role.target,
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
    reference: dict[str, Any] | None = None
    if dataset_uri is not None:
        reference = {"uri": dataset_uri}
        for key, value in (
            ("format", dataset_format.value if dataset_format else None),
            ("columns", _parse_columns(column or [])),
            ("rows", _parse_rows(rows)),
        ):
            if value is not None:
                reference[key] = value
    name = name or (file.stem if file is not None else _reference_name(dataset_uri or ""))
    with _session(ctx) as client:
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
            jobs = _watch(client, [job.job_id for job in jobs])
        concept = client.get_concept(name) if not no_wait else submission.concept
    _emit(ctx, as_json, {"concept": concept, "jobs": jobs}, lambda: _print_lines(_concept_state_lines(concept)))
    for job in jobs:
        if job.status in {"failed", "cancelled"}:
            _job_failed(job)


@concepts_app.command("list")
def concepts_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Every concept with its collection status per model."""
    with _session(ctx) as client:
        concepts = client.list_concepts()
    _emit(ctx, as_json, concepts, lambda: _render_concepts(concepts))


@concepts_app.command("show")
def concepts_show(ctx: typer.Context, name: str, as_json: JsonFlag = False) -> None:
    """One concept."""
    with _session(ctx) as client:
        concept = client.get_concept(name)
    _emit(ctx, as_json, concept, lambda: _render_concept(concept))


@concepts_app.command("delete")
def concepts_delete(ctx: typer.Context, name: str) -> None:
    """Delete a concept (its statistics and the variants built from it stay)."""
    with _session(ctx) as client:
        client.delete_concept(name)
    stderr.print(f"deleted concept {name}")


# ---------------------------------------------------------------- unlearn and compose


def _edit_options(
    scaling: Scaling | None,
    module: list[str] | None,
    layer: list[int] | None,
    rcond: float | None,
    reference: list[str] | None,
    fmt: Format | None,
    lora_rank: int | None,
    callback_url: str | None,
) -> dict[str, Any]:
    """The client's keyword arguments; an option not given stays None and is not sent."""
    return {
        "scaling": scaling.value if scaling else None,
        "modules": module or None,  # typer gives [] for a repeatable option that was not used
        "layers": layer or None,
        "rcond": rcond,
        "reference": reference or None,
        "format": fmt.value if fmt else None,
        "lora_rank": lora_rank,
        "callback_url": callback_url,
    }


def _build_and_fetch(
    ctx: typer.Context,
    client: EngramClient,
    submission: VariantSubmission,
    out: Path | None,
    force: bool,
    no_wait: bool,
    as_json: bool,
) -> None:
    """Watch a submitted variant's build (unless it exists already), then download it to ``out``."""
    variant = submission.variant
    if no_wait and variant.status != "ready":
        stderr.print(f"variant {variant.variant_id}: {variant.status}")
        _emit(ctx, as_json, submission, lambda: stdout.print(variant.variant_id))
        return
    if variant.status == "ready":
        stderr.print(f"variant {variant.variant_id} exists already")
    else:
        job_id = submission.job.job_id if submission.job else variant.job_id
        stderr.print(f"building variant {variant.variant_id}")
        if job_id:
            job = _watch(client, [job_id])[0]
            if job.status != "succeeded":
                _job_failed(job)
        variant = client.wait_for_variant(variant.variant_id)
    if out is not None:
        _download(client, variant, out, force)
    _emit(ctx, as_json, variant, lambda: _render_variant(variant))


@app.command()
def unlearn(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="The model to edit.")],
    concept: Annotated[list[str], typer.Option("--concept", "-c", help="Concept to remove (repeat for several).")],
    alpha: Annotated[float, typer.Option(help="Strength α in W − α Σ_k f_l W_k⁺.")] = 1.0,
    out: OutDir = None,
    force: Force = False,
    scaling: ScalingOpt = None,
    module: ModuleOpt = None,
    layer: LayerOpt = None,
    rcond: RcondOpt = None,
    reference: ReferenceOpt = None,
    fmt: FormatOpt = None,
    lora_rank: LoraRankOpt = None,
    callback_url: CallbackOpt = None,
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Remove concepts from a model; watch the build and download the variant with --out."""
    options = _edit_options(scaling, module, layer, rcond, reference, fmt, lora_rank, callback_url)
    with _session(ctx) as client:
        submission = client.unlearn(model, concept, alpha, **options)
        _build_and_fetch(ctx, client, submission, out, force, no_wait, as_json)


def _parse_terms(terms: Sequence[str]) -> dict[str, float]:
    """``NAME=COEFFICIENT`` pairs; a concept given twice is a usage error rather than a silent overwrite."""
    parsed: dict[str, float] = {}
    for term in terms:
        name, sep, value = term.rpartition("=")
        try:
            coefficient = float(value)
        except ValueError:
            coefficient = None
        if not sep or not name or coefficient is None:
            raise typer.BadParameter(f"{term!r} is not NAME=COEFFICIENT (e.g. forget=-0.5)", param_hint="--term")
        if name in parsed:
            raise typer.BadParameter(f"concept {name!r} appears twice", param_hint="--term")
        parsed[name] = coefficient
    return parsed


@app.command()
def compose(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="The model to edit.")],
    term: Annotated[list[str], typer.Option("--term", "-t", help="NAME=COEFFICIENT (repeat); negative removes.")],
    out: OutDir = None,
    force: Force = False,
    scaling: ScalingOpt = None,
    module: ModuleOpt = None,
    layer: LayerOpt = None,
    rcond: RcondOpt = None,
    reference: ReferenceOpt = None,
    fmt: FormatOpt = None,
    lora_rank: LoraRankOpt = None,
    callback_url: CallbackOpt = None,
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Engram arithmetic W + Σ c_k f_l W_k⁺; watch the build and download the variant with --out."""
    terms = _parse_terms(term)
    options = _edit_options(scaling, module, layer, rcond, reference, fmt, lora_rank, callback_url)
    with _session(ctx) as client:
        submission = client.compose(model, terms, **options)
        _build_and_fetch(ctx, client, submission, out, force, no_wait, as_json)


# ---------------------------------------------------------------- evaluate, generate, map


def _is_probe(record: Any) -> bool:
    """``{"prompt", "completion"}`` strings, or ``{"messages": [...]}`` (the service checks the turns)."""
    if not isinstance(record, dict):
        return False
    if "messages" in record:
        return isinstance(record["messages"], list)
    return all(isinstance(record.get(k), str) for k in ("prompt", "completion"))


def _read_probes(path: Path) -> list[dict[str, Any]]:
    """The ``{"prompt", "completion"}`` or ``{"messages"}`` records of a JSONL file; a bad line is named."""
    probes = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if not _is_probe(record):
                    _fail(
                        "Error",
                        f'{path} line {number} is not a {{"prompt": ..., "completion": ...}} or {{"messages": [...]}} '
                        "JSON record",
                    )
                probes.append(record)
    except UnicodeDecodeError as exc:
        _fail("Error", f"{path} is not UTF-8 text ({exc})")
    return probes


def _finish_job(ctx: typer.Context, client: EngramClient, job: Job, no_wait: bool, as_json: bool) -> Job | None:
    """Watch a submitted job to its end and return it; exit 1 unless it succeeded. --no-wait: print it, None."""
    if no_wait and job.status not in FINISHED:
        stderr.print(f"{job.kind} job {job.job_id}: {job.status}; engram jobs watch {job.job_id}")
        _emit(ctx, as_json, job, lambda: stdout.print(job.job_id))
        return None
    if job.status not in FINISHED:
        job = _watch(client, [job.job_id])[0]
    if job.status != "succeeded":
        _job_failed(job)
    return job


@app.command()
def evaluate(
    ctx: typer.Context,
    variant: Annotated[str, typer.Argument(help="A ready variant; its base model is scored alongside.")],
    forget: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="JSONL of prompt/completion (or messages) probes it should forget."),
    ] = None,
    retain: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="JSONL of prompt/completion (or messages) probes it should keep."),
    ] = None,
    callback_url: CallbackOpt = None,
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Score a variant and its base model: mean answer NLL and greedy exact match on forget and retain probes."""
    if forget is None and retain is None:
        raise typer.BadParameter("give --forget, --retain or both", param_hint="--forget/--retain")
    with _session(ctx) as client:
        probes = {split: _read_probes(path) if path else [] for split, path in (("forget", forget), ("retain", retain))}
        submitted = client.evaluate(variant, probes["forget"], probes["retain"], callback_url=callback_url)
        counts = " and ".join(f"{len(items)} {split}" for split, items in probes.items() if items) or "no"
        stderr.print(f"evaluating variant {variant} and its base model on {counts} probes")
        job = _finish_job(ctx, client, submitted, no_wait, as_json)
    if job is None:
        return
    result = job.result or {}
    if result.get("reused"):
        stderr.print("answered from storage: the same probes were scored on this variant before")
    _emit(ctx, as_json, result, lambda: _render_evaluation(result))


@app.command()
def generate(
    ctx: typer.Context,
    variant: Annotated[str, typer.Argument(help="A ready variant.")],
    prompt: Annotated[str, typer.Argument(help="The text to continue (--chat: the user's message).")],
    max_new_tokens: Annotated[int, typer.Option(help="The most tokens to generate (greedy; stops at EOS).")] = 32,
    chat: Annotated[
        bool, typer.Option("--chat", help="Send PROMPT as a user message, rendered with the model's chat template.")
    ] = False,
    system: Annotated[str | None, typer.Option(help="--chat: a system message before PROMPT.")] = None,
    model: Annotated[
        list[Generator] | None, typer.Option("--model", "-m", help="base or variant (repeat; default: both).")
    ] = None,
    callback_url: CallbackOpt = None,
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Greedy continuation of PROMPT by the variant and its base model, one line each."""
    models = [m.value for m in model] if model else None  # typer gives [] when --model was not used
    if system is not None and not chat:
        raise typer.BadParameter("--system is a chat message: add --chat", param_hint="--system")
    turns = [{"role": "system", "content": system}] if system is not None else []
    request: str | list[dict[str, str]] = [*turns, {"role": "user", "content": prompt}] if chat else prompt
    with _session(ctx) as client:
        submitted = client.generate(variant, request, max_new_tokens, models, callback_url=callback_url)
        job = _finish_job(ctx, client, submitted, no_wait, as_json)
    if job is None:
        return
    result = job.result or {}
    _emit(ctx, as_json, result, lambda: _render_generation(result))


@app.command("map")
def engram_map(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="A registered model.")],
    concept: Annotated[list[str], typer.Option("--concept", "-c", help="Concept to map (repeat; up to 8).")],
    reference: ReferenceOpt = None,
    rcond: RcondOpt = None,
    png: Annotated[
        Path | None, typer.Option(dir_okay=False, help="Write the heatmap here instead of printing tables.")
    ] = None,
    width: Annotated[int | None, typer.Option(help="--png width in pixels (200 to 4000).")] = None,
    height: Annotated[int | None, typer.Option(help="--png height in pixels (200 to 4000).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Where each concept's memory lives: ρ = ‖W⁺‖F / ‖W‖F by block and module type (the paper's Fig. 4)."""
    if png is None and (width is not None or height is not None):
        raise typer.BadParameter("--width and --height size the --png image", param_hint="--width/--height")
    with _session(ctx) as client:
        if png is None:
            data = client.engram_map(model, concept, reference or None, rcond)
        else:
            image = client.engram_map_png(model, concept, reference or None, rcond, width=width, height=height)
            _write_atomically(png, image)
    if png is None:
        _emit(ctx, as_json, data, lambda: _render_map(data))
        return
    w, h = struct.unpack(">II", image[16:24])  # the IHDR chunk, right after the PNG signature
    stderr.print(f"engram map of {model} ({', '.join(concept)}) in {png}: {w}×{h} px, {filesize.decimal(len(image))}")
    _emit(ctx, as_json, {"path": str(png), "width": w, "height": h, "bytes": len(image)}, lambda: None)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write a hidden sibling, then rename it over ``path``: nobody ever sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")
    try:
        with partial.open("xb") as sink:  # a new file, so the umask applies as to any other
            sink.write(data)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- jobs


@jobs_app.command("watch")
def jobs_watch(ctx: typer.Context, job_id: str, as_json: JsonFlag = False) -> None:
    """Show a job's progress until it ends; exit 0 when it succeeded, 1 when it failed or was cancelled."""
    with _session(ctx) as client:
        job = _watch(client, [job_id])[0]
    _emit(ctx, as_json, job, lambda: _render_job(job))
    if job.status != "succeeded":
        _job_failed(job)


@jobs_app.command("show")
def jobs_show(ctx: typer.Context, job_id: str, as_json: JsonFlag = False) -> None:
    """A job's status and progress."""
    with _session(ctx) as client:
        job = client.get_job(job_id)
    _emit(ctx, as_json, job, lambda: _render_job(job))


@jobs_app.command("cancel")
def jobs_cancel(ctx: typer.Context, job_id: str, as_json: JsonFlag = False) -> None:
    """Cancel a job: a queued one at once, a running one at its next checkpoint."""
    with _session(ctx) as client:
        job = client.cancel_job(job_id)
    if job.status not in FINISHED:
        stderr.print(f"cancellation of job {job_id} requested; it stops at its next checkpoint")
    _emit(ctx, as_json, job, lambda: _render_job(job))


# ---------------------------------------------------------------- variants


@variants_app.command("list")
def variants_list(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only the variants of this model.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Every variant (or one model's) with its terms, options and status."""
    with _session(ctx) as client:
        variants = client.list_variants(model)
    _emit(ctx, as_json, variants, lambda: _render_variants(variants))


@variants_app.command("show")
def variants_show(ctx: typer.Context, variant_id: str, as_json: JsonFlag = False) -> None:
    """A variant: terms, options, status and files."""
    with _session(ctx) as client:
        variant = client.get_variant(variant_id)
    _emit(ctx, as_json, variant, lambda: _render_variant(variant))


@variants_app.command("download")
def variants_download(
    ctx: typer.Context,
    variant_id: str,
    out: Annotated[Path, typer.Option("--out", "-o", help="A new directory for the variant's files.")],
    force: Force = False,
    as_json: JsonFlag = False,
) -> None:
    """Download a ready variant; every file's size and sha256 is verified before the directory appears."""
    with _session(ctx) as client:
        variant = client.get_variant(variant_id)
        _download(client, variant, out, force)
    _emit(ctx, as_json, variant, lambda: None)


# ---------------------------------------------------------------- calibrate

# rendering


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def render_calibration(result: CalibrationResult) -> None:
    """Every candidate in evaluation order; ``✓`` feasible, ``P`` on the Pareto front, ``★`` recommended."""
    recommended = result.recommended.candidate if result.recommended else None
    table = _numeric_table(
        "#", "module set", "scaling", "α", "forget ×NLL", "retain ×NLL", "forget exact", "retain exact", "flags"
    )
    table.columns[1].justify = table.columns[2].justify = table.columns[8].justify = "left"
    limit = result.constraint["max_retain_nll_ratio"]
    table.caption = f"×NLL = candidate / base mean answer NLL; ✓ retain ×NLL ≤ {limit:g}, P Pareto front, ★ recommended"
    for c in result.candidates:
        flags = ("✓" if c.feasible else " ") + ("P" if c.pareto else " ") + ("★" if c.index == recommended else "")
        blocks = "" if c.options.layers is None else f"@{','.join(map(str, c.options.layers))}"
        table.add_row(
            str(c.index),
            c.options.module_set + blocks,
            c.options.scaling,
            f"{c.options.alpha:.3g}",
            _ratio(c.forget.nll_ratio),
            _ratio(c.retain.nll_ratio),
            _share(c.forget.exact_match),
            _share(c.retain.exact_match),
            flags,
        )
    stdout.print(table)
    base = result.base
    stdout.print(
        f"base: forget NLL {_ratio(base['forget'].mean_nll)} (exact {_share(base['forget'].exact_match)}), "
        f"retain NLL {_ratio(base['retain'].mean_nll)} (exact {_share(base['retain'].exact_match)}); "
        f"{result.evaluations} of {result.budget} evaluations ({result.stopped}), "
        f"a full grid at this resolution: {result.grid_equivalent}"
    )
    if result.recommended is None:
        stdout.print(Text(f"nothing recommended: {result.note}", style="bold red"))
        return
    rec = result.recommended
    modules = "every layer" if rec.options.modules is None else ", ".join(rec.options.modules)
    line = Text("recommended: ", style="bold")
    line.append(
        f"α={rec.options.alpha:.4g} {rec.options.scaling} on {modules}: forget ×{_ratio(rec.forget_nll_ratio)}, "
        f"retain ×{_ratio(rec.retain_nll_ratio)}; variant {rec.variant_id} ({rec.format})"
    )
    stdout.print(line, soft_wrap=True)


# ---------------------------------------------------------------- the command


def _module_sets(values: list[str] | None) -> list[Any] | None:
    """``all``/``qk_gate``/``attention``/``mlp``, or comma-separated suffixes (``q_proj,v_proj``)."""
    if not values:
        return None
    return [value if "," not in value else [s.strip() for s in value.split(",") if s.strip()] for value in values]


def _layer_sets(values: list[str] | None) -> list[list[int]] | None:
    if not values:
        return None
    try:
        return [[int(b) for b in value.split(",") if b.strip()] for value in values]
    except ValueError:
        raise typer.BadParameter("a layer set is comma-separated block indices, e.g. 0,1,2", param_hint="--layers") from None


@app.command("calibrate")
def calibrate_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="The model to edit.")],
    concept: Annotated[list[str], typer.Option("--concept", "-c", help="Concept to remove (repeat for several).")],
    forget: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="JSONL of probes it should forget.")],
    retain: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="JSONL of probes it should keep.")],
    max_retain_nll_ratio: Annotated[
        float | None, typer.Option(help="The constraint: retain NLL, variant / base, at most this (default 2).")
    ] = None,
    budget: Annotated[int | None, typer.Option(help="The most candidates evaluated (default 32).")] = None,
    alpha_min: Annotated[float | None, typer.Option(help="The weakest α tried (default 0.05).")] = None,
    alpha_max: Annotated[float | None, typer.Option(help="The strongest α tried (default 4).")] = None,
    module_set: Annotated[
        list[str] | None,
        typer.Option("--module-set", help="all, qk_gate, attention, mlp, or suffixes a,b (repeat; default: every preset)."),
    ] = None,
    scaling: Annotated[
        list[Scaling] | None, typer.Option("--scaling", help="Scalings searched (repeat; default both).")
    ] = None,
    layers: Annotated[list[str] | None, typer.Option("--layers", help="A block set to search, e.g. 0,1 (repeat).")] = None,
    rcond: RcondOpt = None,
    reference: ReferenceOpt = None,
    universe: Annotated[str | None, typer.Option(help="A universe of the model (default: its current one).")] = None,
    fmt: FormatOpt = None,
    lora_rank: LoraRankOpt = None,
    png: Annotated[Path | None, typer.Option(dir_okay=False, help="Write the drawn front here.")] = None,
    callback_url: CallbackOpt = None,
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Find the strongest unlearning that keeps the retain probes within a bound: every candidate as a table,
    and the recommended variant built."""
    options = {
        "max_retain_nll_ratio": max_retain_nll_ratio,
        "budget": budget,
        "alpha_min": alpha_min,
        "alpha_max": alpha_max,
        "module_sets": _module_sets(module_set),
        "scalings": [s.value for s in scaling] if scaling else None,
        "layer_sets": _layer_sets(layers),
        "rcond": rcond,
        "reference": reference or None,
        "universe": universe,
        "format": fmt.value if fmt else None,
        "lora_rank": lora_rank,
        "callback_url": callback_url,
    }
    with _session(ctx) as client:
        probes = {"forget": _read_probes(forget), "retain": _read_probes(retain)}
        submission = calibrate(client, model, concept, probes["forget"], probes["retain"], **options)
        job = submission.job
        stderr.print(
            f"calibration {submission.calibration_id}: {len(probes['forget'])} forget and "
            f"{len(probes['retain'])} retain probes"
        )
        if no_wait and job.status not in {"succeeded", "failed", "cancelled"}:
            stderr.print(f"calibrate job {job.job_id}: {job.status}; engram jobs watch {job.job_id}")
            _emit(ctx, as_json, submission, lambda: stdout.print(submission.calibration_id))
            return
        if job.status == "succeeded":
            stderr.print("answered from storage: the same calibration ran before")
        else:
            job = _watch(client, [job.job_id])[0]
        if job.status != "succeeded":
            _job_failed(job)
        found = get_calibration(client, submission.calibration_id)
        image = calibration_front_png(client, submission.calibration_id) if png is not None else None
    if found.result is None:
        _fail("Error", f"calibration {submission.calibration_id} has no result")
    result = found.result
    if png is not None and image is not None:
        _write_atomically(png, image)
        w, h = struct.unpack(">II", image[16:24])  # the IHDR chunk, right after the PNG signature
        size = filesize.decimal(len(image))
        stderr.print(f"front of calibration {submission.calibration_id} in {png}: {w}×{h} px, {size}")
    _emit(ctx, as_json, result, lambda: render_calibration(result))


if __name__ == "__main__":
    app()
