"""The human rendering of results on stdout: rich tables and one-line summaries.

Only what a person reads lives here; ``--json`` output is the API's own models, dumped by
:func:`engram_client.cli.output.emit`. IDs are never cut with an ellipsis, because users copy them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rich import filesize
from rich.table import Table
from rich.text import Text

from api_schemas import (
    CalibrateJob,
    CalibrationResult,
    Concept,
    EngramMap,
    EvaluateJob,
    EvaluationResult,
    GenerateJob,
    GenerationResult,
    Job,
    Model,
    Universe,
    UniverseUsage,
    Variant,
)
from engram_client.cli.output import jsonable, print_lines, stdout


def table(*columns: str) -> Table:
    """A borderless table with bold headers whose cells fold rather than lose characters."""
    rendered = Table(*columns, header_style="bold", show_edge=False, pad_edge=False)
    for column in rendered.columns:
        column.overflow = "fold"  # never cut an ID with an ellipsis: users copy them
    return rendered


def numeric_table(*columns: str) -> Table:
    """A :func:`table` whose columns after the first are right-aligned numbers."""
    rendered = table(*columns)
    for column in rendered.columns[1:]:
        column.justify = "right"
    return rendered


# ---------------------------------------------------------------- models and concepts


def render_models(models: Sequence[Model]) -> None:
    rows = table("model", "architecture", "parameters", "layers", "source")
    for m in models:
        rows.add_row(m.model_id, m.architecture, f"{m.num_parameters:,}", str(len(m.layers)), m.source)
    stdout.print(rows)


def render_model(model: Model) -> None:
    stdout.print(f"{model.model_id}: {model.architecture}, {model.num_parameters:,} parameters")
    stdout.print(f"source {model.source}  digest {model.digest}")
    rows = table("layer", "in", "out", "bias")
    for layer in model.layers:
        rows.add_row(layer.name, str(layer.in_features), str(layer.out_features), "yes" if layer.bias else "no")
    stdout.print(rows)
    if model.layers_not_in_checkpoint:  # never edited: the checkpoint holds no weight for them
        stdout.print(f"not in the checkpoint (never edited): {', '.join(model.layers_not_in_checkpoint)}")


def concept_state_lines(concept: Concept) -> list[str]:
    """Where a concept's dataset came from and how its collection stands on each model, a line each."""
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


def render_concepts(concepts: Sequence[Concept]) -> None:
    rows = table("concept", "role", "records", "models")
    for c in concepts:
        states = ", ".join(f"{m}: {s.status}" + (f" ({s.tokens} tokens)" if s.tokens else "") for m, s in c.models.items())
        rows.add_row(c.name, c.role, str(c.num_records), states)
    stdout.print(rows)


def render_concept(concept: Concept) -> None:
    stdout.print(f"{concept.name}: {concept.role}, {concept.num_records} records, dataset {concept.dataset_digest}")
    if concept.description:
        stdout.print(concept.description)
    print_lines(concept_state_lines(concept))


# ---------------------------------------------------------------- jobs and variants


def render_jobs(jobs: Sequence[Job]) -> None:
    if not jobs:
        stdout.print("no job is queued or running")
        return
    rows = table("job", "kind", "model", "status", "progress", "created")
    for job in jobs:
        p = job.progress
        progress = f"{p.done}/{p.total or '?'} {p.unit}"
        created = job.created_at.isoformat(timespec="seconds")
        rows.add_row(job.job_id, job.kind, job.model_id or "-", job.status, progress, created)
    stdout.print(rows)


def render_job(job: Job) -> None:
    p = job.progress
    percent = f" ({100 * p.done // p.total}%)" if p.total else ""
    stdout.print(f"{job.kind} job {job.job_id}: {job.status}, {p.done}/{p.total} {p.unit}{percent}")
    times = {"created": job.created_at, "started": job.started_at, "finished": job.finished_at}
    stdout.print("  ".join(f"{k} {v.isoformat(timespec='seconds')}" for k, v in times.items() if v is not None))
    if job.result:
        _render_result(job)
    if job.error is not None:
        stdout.print(Text(f"{job.error.title}: {job.error.detail}", style="red"))


RESULT_LINE_CHARS = 300  # a longer result of a kind without a table of its own is summarised


def _render_result(job: Job) -> None:
    """A typed result as the command that asked for it prints it; another: a short one as JSON, a long one by
    its keys."""
    if isinstance(job, EvaluateJob) and job.result is not None:
        render_evaluation(job.result)
    elif isinstance(job, GenerateJob) and job.result is not None:
        render_generation(job.result)
    elif isinstance(job, CalibrateJob) and job.result is not None:
        render_calibration(job.result)
    elif job.result is not None:
        _render_json_result(job.job_id, jsonable(job.result))


def _render_json_result(job_id: str, result: dict[str, Any]) -> None:
    text = json.dumps(result)
    if len(text) <= RESULT_LINE_CHARS:
        stdout.print(f"result {text}")
    else:
        stdout.print(f"result keys {', '.join(result)} (engram --json jobs show {job_id} for all of it)")


def _terms(variant: Variant) -> str:
    return ", ".join(f"{name}={coefficient:g}" for name, coefficient in variant.terms.items())


def _edit_options(variant: Variant) -> dict[str, str]:
    """The options that make two variants of the same terms different edits, as table cells."""
    strengths = variant.module_strengths or {}
    return {
        "alpha": "-" if variant.alpha is None else f"{variant.alpha:g}",
        "scaling": variant.scaling,
        "modules": ", ".join(variant.modules) if variant.modules else "all",
        "layers": ", ".join(str(layer) for layer in variant.layers) if variant.layers else "all",
        "strengths": ", ".join(f"{suffix}={s:g}" for suffix, s in strengths.items()) or "-",
        "format": variant.format,
    }


# Always shown, as before; the other edit options get a column only where the listed variants differ.
_ALWAYS_SHOWN = ("scaling", "format")


def render_variants(variants: Sequence[Variant]) -> None:
    options = [_edit_options(v) for v in variants]
    shown = [
        name for name in (options[0] if options else {}) if name in _ALWAYS_SHOWN or len({o[name] for o in options}) > 1
    ]
    rows = table("variant", "model", "terms", *shown, "status", "size")
    for v, option in zip(variants, options, strict=True):
        size = filesize.decimal(sum(f.size for f in v.files)) if v.files else "-"
        rows.add_row(v.variant_id, v.model_id, _terms(v), *(option[name] for name in shown), v.status, size)
    stdout.print(rows)


def render_variant(variant: Variant) -> None:
    stdout.print(f"variant {variant.variant_id} of {variant.model_id}: {variant.status}")
    stdout.print(f"terms {_terms(variant)}  scaling {variant.scaling}  format {variant.format}")
    stdout.print(f"reference {', '.join(variant.reference) or '-'}")
    selection = {"modules": variant.modules, "layers": variant.layers, "rcond": variant.rcond}
    chosen = "  ".join(f"{k} {v}" for k, v in selection.items() if v is not None)
    if chosen:
        stdout.print(chosen)
    if variant.unreached_layers:  # no concept ran them (a vision tower): written as they were
        stdout.print(f"unchanged, reached by no concept: {', '.join(variant.unreached_layers)}")
    if variant.files:
        rows = table("file", "size", "sha256")
        for f in variant.files:
            rows.add_row(f.path, str(f.size), f.sha256)
        stdout.print(rows)


# ---------------------------------------------------------------- universes


def _size(value: int | None) -> str:
    return "-" if value is None else filesize.decimal(value)


def render_universes(universes: Sequence[Universe]) -> None:
    if not universes:
        stdout.print("no universe yet: the first unlearn or compose, or engram universes build, makes one")
        return
    rows = table("universe", "current", "members", "status", "size", "last used")
    for u in universes:
        last = u.last_used.isoformat(timespec="seconds") if u.last_used else "-"
        members = ", ".join(m.name for m in u.members)
        rows.add_row(u.universe_id, "*" if u.current else "", members, u.status, _size(u.bytes), last)
    stdout.print(rows)


def render_universe(universe: Universe) -> None:
    current = ", current" if universe.current else ""
    stdout.print(f"universe {universe.universe_id} of {universe.model_id}: {universe.status}{current}")
    stdout.print(f"members {', '.join(m.name for m in universe.members) or '-'}")
    groups = f"{universe.groups.done}/{universe.groups.total if universe.groups.total is not None else '?'}"
    rcond = f"  rcond {universe.rcond:g}" if universe.rcond is not None else ""
    stdout.print(f"input groups {groups}  size {_size(universe.bytes)}  projected {_size(universe.projected_bytes)}{rcond}")
    if universe.last_used is not None:
        stdout.print(f"last used {universe.last_used.isoformat(timespec='seconds')}")


def render_universe_usage(usage: UniverseUsage) -> None:
    whose = f"universes of {usage.model_id}" if usage.model_id else "all universes"
    budget = filesize.decimal(usage.budget_bytes) if usage.budget_bytes else "no limit"
    stdout.print(f"{whose}: {filesize.decimal(usage.bytes.total)} stored, budget {budget}")
    stdout.print(
        f"factors {filesize.decimal(usage.bytes.groups)}  engrams {filesize.decimal(usage.bytes.engrams)}  "
        f"reserved {filesize.decimal(usage.reserved_bytes)}  evictable {filesize.decimal(usage.evictable_bytes)}"
    )
    counts = usage.universes
    stdout.print(f"ready {counts.ready}  building {counts.building}  failed {counts.failed}  evicted {counts.evicted}")
    if usage.budget_note:
        stdout.print(usage.budget_note)
    if usage.key_share_bytes is not None and usage.key_share is not None and usage.key_share < 1:
        share = filesize.decimal(usage.key_share_bytes)
        stdout.print(f"per API key: at most {share} kept alive (ENGRAM_UNIVERSE_KEY_SHARE {usage.key_share:g})")
    for entry in usage.keys:
        stdout.print(f"  {entry.key}: {filesize.decimal(entry.bytes)} in {entry.universes} universe(s)")


# ---------------------------------------------------------------- evaluate, generate, map


def render_evaluation(result: EvaluationResult) -> None:
    """Split × {base, variant}: mean answer NLL, the NLL ratio variant/base, greedy exact match."""
    rows = numeric_table("split", "probes", "base NLL", "variant NLL", "NLL ratio", "base exact", "variant exact")
    rows.caption = "NLL ratio = variant / base: above 1, the variant finds the answers less likely"
    for split in ("forget", "retain"):
        base, edited = result.summary.get("base", {}).get(split), result.summary.get("variant", {}).get(split)
        if base is None or edited is None:  # no probes of this split were sent
            continue
        ratio = f"{edited.mean_nll / base.mean_nll:.4g}" if base.mean_nll > 0 else "-"
        nll = (f"{base.mean_nll:.4g}", f"{edited.mean_nll:.4g}", ratio)
        rows.add_row(split, str(base.n), *nll, f"{base.exact_match:.1%}", f"{edited.exact_match:.1%}")
    stdout.print(rows)
    if result.tofu is not None:
        render_tofu(result)


def render_tofu(result: EvaluationResult) -> None:
    """TOFU's suite: one row per metric (OpenUnlearning's names), one column per model scored; a
    metric left out is ``-``, and why is listed under the table."""
    reports = result.tofu or {}
    models = [name for name in ("base", "variant", "retain") if name in reports]
    names: dict[str, None] = {}  # every name once, in the suite's order
    for name in models:
        names.update(dict.fromkeys(reports[name].values))
    for name in models:
        names.update(dict.fromkeys(reports[name].left_out))
    rows = numeric_table("metric", *models)
    if result.retain_model is not None:
        rows.caption = f"retain = {result.retain_model} (trained without the forget set)"
    for metric in names:
        rows.add_row(metric, *(_tofu_cell(reports[name].values, metric) for name in models))
    stdout.print(rows)
    reasons = {metric: why for name in models for metric, why in reports[name].left_out.items()}
    print_lines([f"left out: {metric}: {why}" for metric, why in reasons.items()])


def _tofu_cell(values: dict[str, float | None], metric: str) -> str:
    if metric not in values:
        return "-"
    value = values[metric]
    return "-inf" if value is None else f"{value:.4g}"


def render_generation(result: GenerationResult) -> None:
    for name, output in result.outputs.items():
        line = Text(f"{name}: ", style="bold")
        line.append(output.text)
        stdout.print(line, soft_wrap=True)


def render_map(data: EngramMap) -> None:
    """Per concept: its largest ρ and where, a blocks × module types table (3 significant digits), the rest."""
    for n, name in enumerate(data.concepts):
        entry = data.maps[name]
        if n:
            stdout.print()
        stdout.print(Text(f"{name}: max ρ {entry.max:.3g} at {entry.argmax}", style="bold"))
        rows = numeric_table("block", *data.modules)
        for block, row in zip(data.blocks, entry.rho, strict=True):
            rows.add_row(str(block), *("-" if rho is None else f"{rho:.3g}" for rho in row))
        stdout.print(rows)
        outside = data.outside_blocks.get(name) or {}
        if outside:
            stdout.print("outside the blocks: " + "  ".join(f"{layer} {rho:.3g}" for layer, rho in outside.items()))


# ---------------------------------------------------------------- calibrate


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def render_calibration(result: CalibrationResult) -> None:
    """Every candidate in evaluation order; ``✓`` feasible, ``P`` on the Pareto front, ``★`` recommended."""
    recommended = result.recommended.candidate if result.recommended else None
    rows = numeric_table(
        "#", "module set", "scaling", "α", "forget ×NLL", "retain ×NLL", "forget exact", "retain exact", "flags"
    )
    rows.columns[1].justify = rows.columns[2].justify = rows.columns[8].justify = "left"
    limit = result.constraint.get("max_retain_nll_ratio")  # absent with an objective: its bounds decide ✓
    feasible = f"retain ×NLL ≤ {limit:g}" if limit is not None else "every constraint met"
    rows.caption = f"×NLL = candidate / base mean answer NLL; ✓ {feasible}, P Pareto front, ★ recommended"
    for c in result.candidates:
        flags = ("✓" if c.feasible else " ") + ("P" if c.pareto else " ") + ("★" if c.index == recommended else "")
        blocks = "" if c.options.layers is None else f"@{','.join(map(str, c.options.layers))}"
        rows.add_row(
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
    stdout.print(rows)
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
    row = result.candidates[rec.candidate]
    line.append(
        f"α={rec.options.alpha:.4g} {rec.options.scaling} on {modules}: "
        f"forget exact {_share(row.forget.exact_match)} (base {_share(base['forget'].exact_match)}) "
        f"×NLL {_ratio(rec.forget_nll_ratio)}, "
        f"retain exact {_share(row.retain.exact_match)} (base {_share(base['retain'].exact_match)}) "
        f"×NLL {_ratio(rec.retain_nll_ratio)}; variant {rec.variant_id} ({rec.format})"
    )
    stdout.print(line, soft_wrap=True)
