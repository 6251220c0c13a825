"""``engram calibrate``: search for the strongest unlearning that keeps the retain probes within a bound.

The probe files are text probes, or labelled image probes (``{"image", "label"}``, told by the first
record) for an image classifier, whose calibration is on its accuracies (and ToW with ``--retain-model``).

The client side of a calibration (submit, fetch, the front's PNG) is :class:`~engram_client.EngramClient`'s;
this module is only the command: its options, the watching, and where the results are printed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import filesize
from rich.text import Text

from engram_client.cli.attacks import parse_attack
from engram_client.cli.files import png_size, read_any_probes, read_probes, write_atomically
from engram_client.cli.options import (
    CallbackOpt,
    FormatOpt,
    JsonFlag,
    LoraRankOpt,
    NoWait,
    RcondOpt,
    ReferenceOpt,
    Scaling,
)
from engram_client.cli.output import emit, fail, job_failed, stderr, stdout
from engram_client.cli.progress import watch
from engram_client.cli.render import render_calibration
from engram_client.cli.root import session


def _module_sets(values: list[str] | None) -> list[Any] | None:
    """``all``/``qk_gate``/``attention``/``mlp``, or comma-separated suffixes (``q_proj,v_proj``)."""
    if not values:
        return None
    return [value if "," not in value else [s.strip() for s in value.split(",") if s.strip()] for value in values]


def _layer_sets(values: list[str] | None) -> list[list[int]] | None:
    """``0,1,2`` per value as the block indices of one layer set to search."""
    if not values:
        return None
    try:
        return [[int(b) for b in value.split(",") if b.strip()] for value in values]
    except ValueError:
        raise typer.BadParameter("a layer set is comma-separated block indices, e.g. 0,1,2", param_hint="--layers") from None


def _objective(maximize: str | None, minimize: str | None) -> dict[str, str] | None:
    if maximize is not None and minimize is not None:
        raise typer.BadParameter("give --maximize or --minimize, not both", param_hint="--maximize")
    if maximize is not None:
        return {"maximize": maximize}
    return {"minimize": minimize} if minimize is not None else None


_CONSTRAINT = re.compile(r"^\s*([A-Za-z0-9_]+)\s*(>=|<=)\s*([-+]?[0-9.]+(?:[eE][-+]?[0-9]+)?)(x?)\s*$")


def _constraints(values: list[str] | None) -> list[dict[str, Any]] | None:
    """``metric>=0.4``, ``metric<=2``, or relative to the base model: ``model_utility>=0.9x``."""
    if not values:
        return None
    constraints = []
    for value in values:
        match = _CONSTRAINT.match(value)
        if match is None:
            raise typer.BadParameter(
                f"{value!r}: a constraint is metric>=value or metric<=value (a trailing x: times the base's)",
                param_hint="--constraint",
            )
        metric, operator, number, relative = match.groups()
        side = "min" if operator == ">=" else "max"
        constraints.append({"metric": metric, f"{side}_ratio_to_base" if relative else side: float(number)})
    return constraints


def _attack_constraints(values: list[str] | None) -> list[dict[str, Any]] | None:
    """``ATTACK METRIC<=V`` (or ``>=``, a trailing x: times the base's): ``quantize:Q4_1 forget_exact_match<=0.2``,
    ``relearn:steps=10 recovered_fraction<=0.3`` (the attack as ``engram evaluate --attack`` writes it)."""
    if not values:
        return None
    constraints = []
    for value in values:
        attack, _, bound = value.strip().rpartition(" ")
        if not attack.strip():
            raise typer.BadParameter(
                f"{value!r}: an attack constraint is ATTACK METRIC<=V, e.g. 'quantize:Q4_1 forget_exact_match<=0.2'",
                param_hint="--attack-constraint",
            )
        (metric_bound,) = _constraints([bound]) or [{}]
        constraints.append({"attack": parse_attack(attack), **metric_bound})
    return constraints


def _utility(values: list[str] | None, general: Path | None = None) -> dict[str, list[dict[str, Any]]] | None:
    """``name=path.jsonl`` per utility set, and ``--general``'s text as the set ``general``."""
    if not values and general is None:
        return None
    sets = {} if general is None else {"general": general_probes(general)}
    for value in values or []:
        name, _, path = value.partition("=")
        if not name or not path or not Path(path).is_file():
            why = f"{value!r}: a utility set is name=path.jsonl (an existing file)"
            raise typer.BadParameter(why, param_hint="--utility")
        sets[name] = read_probes(Path(path))
    return sets


def general_probes(path: Path) -> list[dict[str, Any]]:
    """General text for the perplexity bound: a JSONL of probes, or plain text with one paragraph per
    non-empty line, each made a probe of its first word (prompt) and the rest (completion)."""
    if path.suffix == ".jsonl":
        return read_probes(path)
    probes = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        first, _, rest = line.strip().partition(" ")
        if not first:
            continue
        if not rest.strip():
            raise typer.BadParameter(f"{path}:{number}: a paragraph needs at least two words", param_hint="--general")
        probes.append({"prompt": first, "completion": " " + rest.strip()})
    if not probes:
        raise typer.BadParameter(f"{path} holds no paragraph", param_hint="--general")
    return probes


# What one candidate costs, the rule the estimate states: one teacher-forced forward pass over every
# searched probe (forget, retain, general text); the base is scored once, and the held-out check scores
# at most HELD_OUT_TRIES candidates on the held-out probes (service.calibration.goal_run).
HELD_OUT_TRIES = 4


def cost_estimate(budget: int, probes: int, held_out_fraction: float | None) -> str:
    """The search's cost before it starts, by the rule above, in forward passes over probes."""
    held = round(probes * held_out_fraction) if held_out_fraction else 0
    searched = probes - held
    passes = (budget + 1) * searched + (HELD_OUT_TRIES + 1) * held
    return (
        f"estimated cost: at most {budget} candidates, each one forward pass over {searched} probes, plus the base "
        f"and up to {HELD_OUT_TRIES} held-out checks over {held}: about {passes} probe passes (the result's "
        "seconds.per_candidate is the measured cost of one candidate)"
    )


def _render_warnings(result: Any) -> None:
    """The search's cost, then every warning, loud: what a user should know before shipping."""
    seconds = result.seconds or {}
    if seconds:
        stdout.print(
            f"search cost: {result.evaluations} candidates in {seconds.get('search', 0):.1f} s "
            f"({seconds.get('per_candidate', 0):.2f} s each), {seconds.get('total', 0):.1f} s in all"
        )
    for warning in result.warnings:
        # The consoles print without markup (server text may hold brackets): the style goes on a Text.
        stdout.print(Text("warning: ", style="bold yellow") + Text(warning), soft_wrap=True)


def _render_goal(result: Any) -> None:
    """With an objective: the bounds as applied, the recommendation's objective and bound metrics,
    and the held-out check."""
    if result.objective is None:
        return
    metric = result.objective.metric
    bounds = ", ".join(
        f"{b.metric} {'≥ ' + format(b.min, '.4g') if b.min is not None else ''}"
        f"{' ≤ ' + format(b.max, '.4g') if b.max is not None else ''}"
        for b in result.constraints or []
    )
    stdout.print(f"objective: {result.objective.sense} {metric}" + (f" subject to {bounds}" if bounds else ""))
    if result.recommended is not None and result.recommended.metrics is not None:
        named = [metric, *(b.metric for b in result.constraints or [])]
        values = ", ".join(f"{n} {result.recommended.metrics.get(n)}" for n in dict.fromkeys(named))
        stdout.print(f"recommended on the searched probes: {values}")
    if result.held_out is not None:
        held = result.held_out
        verdict = "meets every bound" if held.feasible else "MISSES a bound"
        named = [metric, *(b.metric for b in held.constraints)]
        values = ", ".join(f"{n} {_number(held.recommended.get(n))}" for n in dict.fromkeys(named))
        stdout.print(f"held-out probes {held.probes}: the recommended variant {verdict} ({values})")
        if held.margins:
            stdout.print("held-out margins: " + ", ".join(f"{n} {v:+.3g}" for n, v in held.margins.items()))


def _render_attack_gate(result: Any) -> None:
    """With attack constraints: each attacked candidate's scores after each attack, and which passed."""
    gate = result.attack_gate
    if gate is None:
        return
    bounds = ", ".join(
        f"{b.attack} {b.metric}{' ≥ ' + format(b.min, '.4g') if b.min is not None else ''}"
        f"{' ≤ ' + format(b.max, '.4g') if b.max is not None else ''}"
        for b in gate.constraints
    )
    stdout.print(f"attack gate on the held-out probes: {bounds}; candidates attacked {gate.attacked}, passed {gate.passed}")
    for index in gate.attacked:
        scores = result.candidates[index].attacked or {}
        for b in gate.constraints:
            stdout.print(f"  candidate {index}: {b.attack} {b.metric} {_number(scores.get(b.attack, {}).get(b.metric))}")


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _save_front(png: Path, image: bytes, calibration_id: str) -> None:
    """Write the drawn front atomically and say where it went and how big it is."""
    write_atomically(png, image)
    w, h = png_size(image)
    size = filesize.decimal(len(image))
    stderr.print(f"front of calibration {calibration_id} in {png}: {w}×{h} px, {size}")


def calibrate_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="The model to edit.")],
    concept: Annotated[list[str], typer.Option("--concept", "-c", help="Concept to remove (repeat for several).")],
    forget: Annotated[
        Path, typer.Option(exists=True, dir_okay=False, help="JSONL of probes it should forget (text, or labelled images).")
    ],
    retain: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="JSONL of probes it should keep.")],
    test: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="Image probes: JSONL of held-out images of every class (ToW)."),
    ] = None,
    max_retain_nll_ratio: Annotated[
        float | None,
        typer.Option(help="The older NLL-ratio search: retain NLL, variant / base, at most this (instead of exact match)."),
    ] = None,
    min_retain_exact_match_ratio: Annotated[
        float | None, typer.Option(help="Retain exact match at least this times the base's (default 0.9).")
    ] = None,
    max_perplexity_ratio: Annotated[
        float | None, typer.Option(help="Perplexity on general text, variant / base, at most this (default 1.1).")
    ] = None,
    general: Annotated[
        Path | None,
        typer.Option(
            exists=True, dir_okay=False, help="General text for the perplexity bound: a paragraph a line, or probes .jsonl."
        ),
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
    maximize: Annotated[
        str | None, typer.Option(help="A score to maximise instead (overall, …: TOFU's names; images: tow, …).")
    ] = None,
    minimize: Annotated[str | None, typer.Option(help="A score to minimise instead.")] = None,
    constraint: Annotated[
        list[str] | None,
        typer.Option("--constraint", help="With an objective: metric>=v, metric<=v, or model_utility>=0.9x (repeat)."),
    ] = None,
    retain_model: Annotated[
        str | None, typer.Option(help="With an objective: the model trained without the forget set.")
    ] = None,
    held_out_fraction: Annotated[
        float | None, typer.Option(help="With an objective: share of the probes kept to check the recommendation.")
    ] = None,
    utility: Annotated[
        list[str] | None, typer.Option("--utility", help="With an objective: a utility set, name=path.jsonl (repeat).")
    ] = None,
    holdout: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="With an objective: JSONL of facts no model saw.")
    ] = None,
    attack_constraint: Annotated[
        list[str] | None,
        typer.Option(
            "--attack-constraint",
            help="Checked on held-out probes: ATTACK METRIC<=V, e.g. 'quantize:Q4_1 forget_exact_match<=0.2' or "
            "'relearn recovered_fraction<=0.3' (repeat).",
        ),
    ] = None,
    png: Annotated[Path | None, typer.Option(dir_okay=False, help="Write the drawn front here.")] = None,
    callback_url: CallbackOpt = None,
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Find the strongest unlearning that keeps the retain probes within a bound: every candidate as a table,
    and the recommended variant built."""
    options = {
        "max_retain_nll_ratio": max_retain_nll_ratio,
        "min_retain_exact_match_ratio": min_retain_exact_match_ratio,
        "max_perplexity_ratio": max_perplexity_ratio,
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
        "objective": _objective(maximize, minimize),
        "constraints": _constraints(constraint),
        "retain_model": retain_model,
        "held_out_fraction": held_out_fraction,
        "utility": _utility(utility, general),
        "holdout": read_probes(holdout) if holdout is not None else None,
        "test": read_any_probes(test) if test is not None else None,
        "attack_constraints": _attack_constraints(attack_constraint),
    }
    with session(ctx) as client:
        probes = {"forget": read_any_probes(forget), "retain": read_any_probes(retain)}
        submission = client.calibrate(model, concept, probes["forget"], probes["retain"], **options)
        job = submission.job
        stderr.print(
            f"calibration {submission.calibration_id}: {len(probes['forget'])} forget and "
            f"{len(probes['retain'])} retain probes"
        )
        sets: dict[str, list[dict[str, Any]]] = options["utility"] or {}  # type: ignore[assignment]
        n_probes = len(probes["forget"]) + len(probes["retain"]) + sum(len(v) for v in sets.values())
        default_goal = maximize is None and minimize is None and max_retain_nll_ratio is None and test is None
        fraction = held_out_fraction if held_out_fraction is not None else (0.2 if default_goal else None)
        if job.status != "succeeded":
            stderr.print(cost_estimate(budget or 32, n_probes, fraction))
        if no_wait and job.status not in {"succeeded", "failed", "cancelled"}:
            stderr.print(f"calibrate job {job.job_id}: {job.status}; engram jobs watch {job.job_id}")
            emit(ctx, as_json, submission, lambda: stdout.print(submission.calibration_id))
            return
        if job.status == "succeeded":
            stderr.print("answered from storage: the same calibration ran before")
        else:
            job = watch(client, [job.job_id])[0]
        if job.status != "succeeded":
            job_failed(job)
        found = client.get_calibration(submission.calibration_id)
        image = client.calibration_front_png(submission.calibration_id) if png is not None else None
    if found.result is None:
        fail("Error", f"calibration {submission.calibration_id} has no result")
    result = found.result
    if png is not None and image is not None:
        _save_front(png, image, submission.calibration_id)

    def render() -> None:
        render_calibration(result)
        if any(c.metrics and "forget_accuracy" in c.metrics for c in result.candidates):
            stdout.print("image probes: ×NLL is the label's NLL ratio, exact the top-1 accuracy (as evaluate reports them)")
        _render_goal(result)
        _render_attack_gate(result)
        _render_warnings(result)

    emit(ctx, as_json, result, render)
