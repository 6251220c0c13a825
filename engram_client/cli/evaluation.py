"""``engram evaluate``, ``engram generate`` and ``engram map``: look at what an edit did.

``evaluate`` and ``generate`` compare a variant with its base model (scores, or greedy text);
``map`` shows where a concept's memory lives in a model before anything is edited.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich import filesize

from api_schemas import Job
from engram_client.cli.files import png_size, read_probes, write_atomically
from engram_client.cli.options import CallbackOpt, Generator, JsonFlag, NoWait, RcondOpt, ReferenceOpt
from engram_client.cli.output import emit, fail, job_failed, stderr, stdout
from engram_client.cli.progress import watch
from engram_client.cli.render import render_evaluation, render_generation, render_map
from engram_client.cli.root import session
from engram_client.client import FINISHED, EngramClient


class Measure(str, Enum):
    data = "data"
    weight = "weight"


KindJob = TypeVar("KindJob", bound=Job)


def _finish_job(ctx: typer.Context, client: EngramClient, job: KindJob, no_wait: bool, as_json: bool) -> KindJob | None:
    """Watch a submitted job to its end and return it (a succeeded job with its result); exit 1 unless it
    succeeded. --no-wait: print it, None."""
    if no_wait and job.status not in FINISHED:
        stderr.print(f"{job.kind} job {job.job_id}: {job.status}; engram jobs watch {job.job_id}")
        emit(ctx, as_json, job, lambda: stdout.print(job.job_id))
        return None
    if job.status not in FINISHED:
        finished = watch(client, [job.job_id])[0]
        if not isinstance(finished, type(job)):  # the client reads a job by its kind: the same kind again
            fail(f"job {job.job_id} came back as a {finished.kind} job")
        job = finished
    if job.status != "succeeded":
        job_failed(job)
    if job.result is None:
        fail(f"{job.kind} job {job.job_id} succeeded without a result")
    return job


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
    metrics: Annotated[
        str | None,
        typer.Option(
            help="tofu: also TOFU's metric suite (OpenUnlearning's names), or a comma-separated list of its names."
        ),
    ] = None,
    retain_model: Annotated[
        str | None,
        typer.Option(help="--metrics: a model or variant trained without the forget set (forget quality, privacy)."),
    ] = None,
    holdout: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="--metrics: JSONL of facts no model saw (membership attacks)."),
    ] = None,
    utility: Annotated[
        list[str] | None,
        typer.Option(help="--metrics: NAME=JSONL, a probe set the forget set does not touch (model utility; repeat)."),
    ] = None,
    callback_url: CallbackOpt = None,
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Score a variant and its base model: mean answer NLL and greedy exact match on forget and retain probes
    (--metrics tofu: also TOFU's suite, one table of base / variant / retain)."""
    if forget is None and retain is None:
        raise typer.BadParameter("give --forget, --retain or both", param_hint="--forget/--retain")
    if metrics is None and (retain_model is not None or holdout is not None or utility):
        raise typer.BadParameter("--retain-model, --holdout and --utility serve --metrics", param_hint="--metrics")
    chosen: str | list[str] | None = metrics
    if metrics is not None and metrics != "tofu":
        chosen = [name.strip() for name in metrics.split(",") if name.strip()]
    with session(ctx) as client:
        probes = {split: read_probes(path) if path else [] for split, path in (("forget", forget), ("retain", retain))}
        utility_sets = {name: read_probes(path) for name, path in _utility_sets(utility or [])}
        submitted = client.evaluate(
            variant,
            probes["forget"],
            probes["retain"],
            metrics=chosen,
            retain_model=retain_model,
            holdout=read_probes(holdout) if holdout else (),
            utility=utility_sets or None,
            callback_url=callback_url,
        )
        counts = " and ".join(f"{len(items)} {split}" for split, items in probes.items() if items) or "no"
        stderr.print(f"evaluating variant {variant} and its base model on {counts} probes")
        job = _finish_job(ctx, client, submitted, no_wait, as_json)
    if job is None or job.result is None:  # --no-wait (_finish_job exits on a succeeded job without a result)
        return
    result = job.result
    if result.reused:
        stderr.print("answered from storage: the same probes were scored on this variant before")
    emit(ctx, as_json, result, lambda: render_evaluation(result))


def _utility_sets(options: list[str]) -> list[tuple[str, Path]]:
    """``NAME=PATH`` options as pairs; a malformed one or a missing file is a usage error naming it."""
    pairs = []
    for option in options:
        name, sep, path = option.partition("=")
        if not sep or not name or not path:
            raise typer.BadParameter(f"{option!r} is not NAME=JSONL", param_hint="--utility")
        if not Path(path).is_file():
            raise typer.BadParameter(f"{path} is not a file", param_hint="--utility")
        pairs.append((name, Path(path)))
    return pairs


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
    with session(ctx) as client:
        submitted = client.generate(variant, request, max_new_tokens, models, callback_url=callback_url)
        job = _finish_job(ctx, client, submitted, no_wait, as_json)
    if job is None or job.result is None:  # --no-wait (_finish_job exits on a succeeded job without a result)
        return
    result = job.result
    emit(ctx, as_json, result, lambda: render_generation(result))


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
    measure: Annotated[
        Measure | None,
        typer.Option(
            help="data (the default): ‖W⁺X‖F / ‖WX‖F over the universe's inputs, 0 to 1; "
            "weight: the paper's W-Norm ‖W⁺‖F / ‖W‖F."
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Where each concept's memory lives, by block and module type (the paper's Fig. 4): the share of each
    layer's output on the data that the concept's engram accounts for (--measure)."""
    if png is None and (width is not None or height is not None):
        raise typer.BadParameter("--width and --height size the --png image", param_hint="--width/--height")
    chosen = measure.value if measure else None
    with session(ctx) as client:
        if png is None:
            data = client.engram_map(model, concept, reference or None, rcond, measure=chosen)
        else:
            image = client.engram_map_png(
                model, concept, reference or None, rcond, width=width, height=height, measure=chosen
            )
            write_atomically(png, image)
    if png is None:
        emit(ctx, as_json, data, lambda: render_map(data))
        return
    w, h = png_size(image)
    stderr.print(f"engram map of {model} ({', '.join(concept)}) in {png}: {w}×{h} px, {filesize.decimal(len(image))}")
    emit(ctx, as_json, {"path": str(png), "width": w, "height": h, "bytes": len(image)}, lambda: None)
