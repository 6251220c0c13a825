"""``engram evaluate``, ``engram generate`` and ``engram map``: look at what an edit did.

``evaluate`` and ``generate`` compare a variant with its base model (scores, or greedy text);
``map`` shows where a concept's memory lives in a model before anything is edited.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich import filesize

from api_schemas import Job
from api_schemas.evaluation import ClassifierEvaluation, EvaluationResult
from engram_client.cli.attacks import parse_attack, render_attacks
from engram_client.cli.files import png_size, read_any_probes, read_probes, write_atomically
from engram_client.cli.options import CallbackOpt, Generator, JsonFlag, NoWait, RcondOpt, ReferenceOpt
from engram_client.cli.output import emit, fail, job_failed, print_lines, stderr, stdout
from engram_client.cli.progress import watch
from engram_client.cli.render import numeric_table, render_evaluation, render_generation, render_map
from engram_client.cli.root import session
from engram_client.client import FINISHED, EngramClient
from engram_client.errors import EngramAPIError


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
        typer.Option(
            exists=True,
            dir_okay=False,
            help="JSONL of prompt/completion (or messages) probes it should forget; an image classifier's: "
            '{"image": base64 PNG/JPEG/WebP, "label": class id or name}.',
        ),
    ] = None,
    retain: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="JSONL of probes it should keep (the same kinds as --forget)."),
    ] = None,
    test: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="JSONL of held-out image probes of every class (ToW's test set)."),
    ] = None,
    metrics: Annotated[
        str | None,
        typer.Option(
            help="tofu: also TOFU's metric suite (OpenUnlearning's names), or a comma-separated list of its names."
        ),
    ] = None,
    retain_model: Annotated[
        str | None,
        typer.Option(
            help="--metrics: a model or variant trained without the forget set (forget quality, privacy); image "
            "probes: the classifier retrained without the forget classes (ToW, CKA)."
        ),
    ] = None,
    holdout: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="--metrics: JSONL of facts no model saw (membership attacks)."),
    ] = None,
    utility: Annotated[
        list[str] | None,
        typer.Option(help="--metrics: NAME=JSONL, a probe set the forget set does not touch (model utility; repeat)."),
    ] = None,
    attack: Annotated[
        list[str] | None,
        typer.Option(
            help="an attack on the forgetting, scored per model (repeat): quantize:Q4_1 (Q8_0, Q4_0, int8, nf4), "
            "relearn (or relearn:steps=10,lr=2e-5,seed=0,train_probes=5), rephrase:chat_template (no_template, "
            "paraphrased)."
        ),
    ] = None,
    callback_url: CallbackOpt = None,
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Score a variant and its base model: mean answer NLL and greedy exact match on forget and retain probes
    (--metrics tofu: also TOFU's suite, one table of base / variant / retain). Image probes (an image
    classifier): top-1 accuracy, label NLL and the forgotten classes' confusion per set and model, and
    with --retain-model ToW and CKA against the retrained classifier."""
    if forget is None and retain is None:
        raise typer.BadParameter("give --forget, --retain or both", param_hint="--forget/--retain")
    chosen: str | list[str] | None = metrics
    if metrics is not None and metrics != "tofu":
        chosen = [name.strip() for name in metrics.split(",") if name.strip()]
    with session(ctx) as client:
        files = (("forget", forget), ("retain", retain), ("test", test))
        probes = {split: read_any_probes(path) if path else [] for split, path in files}
        images = any("image" in probe for items in probes.values() for probe in items)
        if metrics is None and ((retain_model is not None and not images) or holdout is not None or utility):
            raise typer.BadParameter(
                "--retain-model (for text probes), --holdout and --utility serve --metrics", param_hint="--metrics"
            )
        utility_sets = {name: read_probes(path) for name, path in _utility_sets(utility or [])}
        try:
            submitted = client.evaluate(
                variant,
                probes["forget"],
                probes["retain"],
                test=probes["test"],
                metrics=chosen,
                retain_model=retain_model,
                holdout=read_probes(holdout) if holdout else (),
                utility=utility_sets or None,
                attacks=[parse_attack(text) for text in attack or []],
                callback_url=callback_url,
            )
        except EngramAPIError as exc:
            sent = {split: path for split, path in (*files, ("holdout", holdout)) if path is not None}
            raise EngramAPIError(exc.status, exc.title, named_by_line(exc.detail, sent), exc.problem) from None
        counts = " and ".join(f"{len(items)} {split}" for split, items in probes.items() if items) or "no"
        stderr.print(f"evaluating variant {variant} and its base model on {counts} probes")
        job = _finish_job(ctx, client, submitted, no_wait, as_json)
    if job is None or job.result is None:  # --no-wait (_finish_job exits on a succeeded job without a result)
        return
    result = job.result
    # An identical request is answered by the job that scored it (succeeded when submitted); a stored
    # result another request left is read as reused.
    if result.reused or submitted.status == "succeeded":
        stderr.print(
            f"{job.kind} job {job.job_id} answered from storage (the same probes were scored on this variant "
            "before): succeeded"
        )
    emit(ctx, as_json, result, lambda: _render(result))


# The service names a probe by its place in the request body, 0-based (``body.forget.3.completion``);
# the reader knows it by the file's line, 1-based, as the CLI's own checks and concept uploads count.
_PROBE_PLACE = re.compile(r"\bbody\.(?P<field>[a-z_]+)\.(?P<index>\d+)(?:\.(?P<rest>[\w.-]+))?")


def named_by_line(detail: str, files: Mapping[str, Path]) -> str:
    """``detail`` with each ``body.<field>.<i>[.<rest>]`` of a probe read from ``files[field]`` named as
    ``<file> line <n>[ (<rest>)]``: the line of the file's ``i``-th record (blank lines hold none)."""

    def by_line(place: re.Match[str]) -> str:
        path = files.get(place["field"])
        lines = record_lines(path) if path is not None else []
        index = int(place["index"])
        if index >= len(lines):  # not a probe of a file (or not one we sent): the service's words
            return place[0]
        return f"{path} line {lines[index]}" + (f" ({place['rest']})" if place["rest"] else "")

    return _PROBE_PLACE.sub(by_line, detail)


def record_lines(path: Path) -> list[int]:
    """The 1-based line of each record of a JSONL file, in order: blank lines are skipped as read_probes skips them."""
    with path.open(encoding="utf-8", errors="replace") as lines:
        return [number for number, line in enumerate(lines, 1) if line.strip()]


def _render(result: EvaluationResult) -> None:
    """The classifier's tables for image probes, else the text evaluation's."""
    if result.classifier is None:
        render_evaluation(result)
        if result.attacks:
            render_attacks(result)
        return
    render_classifier(result.classifier, result.retain_model)


CLASSIFIER_MODELS = ("base", "variant", "retrained")


def render_classifier(section: ClassifierEvaluation, retain_model: str | None) -> None:
    """Per model and probe set: probes, top-1 accuracy, mean label NLL, and for each forgotten class the
    share of its probes still predicted as it; then the features' DA and NMI, ToW and CKA."""
    forgotten = [str(c) for c in section.forgotten_classes]
    rows = numeric_table("model", "set", "probes", "accuracy", "label NLL", *(f"class {c} → {c}" for c in forgotten))
    rows.columns[1].justify = "left"  # a name, not a number
    if retain_model is not None:
        rows.caption = f"retrained = {retain_model} (trained without the forget classes)"
    models = [name for name in CLASSIFIER_MODELS if name in section.models]
    for name in models:
        for set_name, report in section.models[name].sets.items():
            kept = [_kept(report.confusion, c) for c in forgotten]
            rows.add_row(name, set_name, str(report.n), f"{report.accuracy:.1%}", f"{report.label_nll:.4g}", *kept)
    stdout.print(rows)
    scores = section.scores
    figures = numeric_table("score", *models)
    figures.add_row("DA", *(_figure(section.models[m].da) for m in models))
    figures.add_row("NMI", *(_figure(section.models[m].nmi) for m in models))
    stdout.print(figures)
    lines = [f"ToW (variant vs retrained): {_figure(scores.tow)}"]
    lines += [f"CKA variant-base on {s}: {v:.4f}" for s, v in scores.cka_to_base.items()]
    lines += [f"CKA variant-retrained on {s}: {v:.4f}" for s, v in (scores.cka_to_retrained or {}).items()]
    lines += [f"left out: {what}: {why}" for what, why in scores.left_out.items()]
    print_lines(lines)


def _kept(confusion: dict[str, list[float]] | None, label: str) -> str:
    """The share of class ``label``'s probes predicted as it (``-``: the set has none of them)."""
    if confusion is None or label not in confusion:
        return "-"
    return f"{confusion[label][int(label)]:.1%}"


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


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
