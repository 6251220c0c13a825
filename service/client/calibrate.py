"""``engram calibrate``: find the edit strength and the layers from probes, as a table and a PNG.

The command submits ``POST /models/{id}/calibrate``, watches the job (a progress bar in candidates
evaluated), then prints every candidate (module set, scaling, α, forget and retain NLL ratios and
exact match; feasible ones marked, the Pareto front and the recommendation flagged) and the
recommended variant. ``--png`` writes the drawn front. The client calls live here too, as functions
of an :class:`EngramClient`.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import filesize
from rich.text import Text

from api_schemas import Calibration, CalibrationResult, CalibrationSubmission
from service.client.cli import (
    CallbackOpt,
    FormatOpt,
    JsonFlag,
    LoraRankOpt,
    NoWait,
    RcondOpt,
    ReferenceOpt,
    Scaling,
    _emit,
    _fail,
    _job_failed,
    _numeric_table,
    _read_probes,
    _session,
    _watch,
    _write_atomically,
    app,
    stderr,
    stdout,
)
from service.client.client import PNG_SIGNATURE, EngramClient, EngramError, _quote, _set_only

# ---------------------------------------------------------------- client calls


def calibrate(
    client: EngramClient,
    model_id: str,
    concepts: Sequence[str],
    forget: Sequence[dict[str, Any]],
    retain: Sequence[dict[str, Any]],
    **options: Any,
) -> CalibrationSubmission:
    """``POST /models/{model_id}/calibrate``; options left ``None`` are not sent (the service's defaults apply)."""
    body = {"concepts": list(concepts), "forget": list(forget), "retain": list(retain), **_set_only(**options)}
    response = client._request("POST", f"/models/{_quote(model_id)}/calibrate", json=body)
    return CalibrationSubmission.model_validate_json(response.content)


def get_calibration(client: EngramClient, calibration_id: str) -> Calibration:
    """``GET /calibrations/{calibration_id}``: its status and, once done, its result."""
    return Calibration.model_validate_json(client._request("GET", f"/calibrations/{_quote(calibration_id)}").content)


def calibration_front_png(client: EngramClient, calibration_id: str) -> bytes:
    """The drawn front of a finished calibration (PNG bytes)."""
    headers = {"Accept": "image/png, application/problem+json"}
    response = client._request("GET", f"/calibrations/{_quote(calibration_id)}/front.png", headers=headers)
    if not response.content.startswith(PNG_SIGNATURE):
        raise EngramError(f"the front of calibration {calibration_id} is not a PNG")
    return response.content


# ---------------------------------------------------------------- rendering


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


def _apps() -> list[typer.Typer]:
    """The CLI apps to register on: the module's, and ``__main__``'s under ``python -m service.client.cli``
    (the module then runs as ``__main__``, a second module object with an ``app`` of its own)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    extra = getattr(main, "app", None) if spec is not None and spec.name == "service.client.cli" else None
    return [app] + ([extra] if isinstance(extra, typer.Typer) and extra is not app else [])


for _app in _apps():
    _app.command("calibrate")(calibrate_command)
