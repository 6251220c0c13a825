"""The ``calibrate`` job body: search the edit space on cached engrams, then build the recommendation.

One job: the universe is built first if it is not yet (the same functions a ``universe`` job runs),
the model is loaded once, and every candidate the search asks for is evaluated in memory
(:class:`~service.calibration.candidates.InMemoryCandidates`: no checkpoint is written for a
candidate). The recommended candidate is then built as an ordinary unlearn variant in the requested
format, through :func:`~service.variants.service.submit_variant`, its ``variant`` job run inline by
this job's worker, so it is the same content-addressed variant a user's own request gives. The
result and the drawn front are stored last, content-addressed by the calibration's ID.

Progress counts candidates evaluated, towards the budget; a cancellation stops the job between two
candidates (or while the universe is built).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from api_schemas import EditOptions
from api_schemas.calibration import (
    CalibrationCandidate,
    CalibrationJobResult,
    CalibrationRecommendation,
    CandidateOptions,
    SplitScore,
)
from api_schemas.calibration_default import GENERAL_SET
from service.calibration.candidates import SPLITS, InMemoryCandidates, Measured, parse_probe
from service.calibration.classifier_goal import ClassifierCandidates, ClassifierGoalRun, is_classifier_goal
from service.calibration.goal import held_out_split
from service.calibration.goal_run import GoalRun, plain_sets
from service.calibration.goal_search import goal_search, ranked_for_goal, recommend_for_goal
from service.calibration.overlap import held_warning, retain_probes_held
from service.calibration.plot import default_axes, render_front_png
from service.calibration.records import CalibrationProbes, StoredCalibrationResult, read_calibration_result, read_record
from service.calibration.request import CalibrationRequest, Format
from service.calibration.search import (
    Arm,
    Candidate,
    SearchResult,
    SearchSettings,
    pareto_front,
    recommend,
    search,
)
from service.calibration.service import front_png_url
from service.calibration.space import arm_layers
from service.calibration.strengths import measure_strengths
from service.calibration.warnings import result_warnings
from service.context import Context
from service.engine.evaluate import TextProbe as Probe
from service.engine.layout import ModelLayout
from service.engrams.manifest import UniverseManifest
from service.errors import JobFailed
from service.jobs.progress import CancelOnly, JobCancelled, ProgressReporter
from service.jobs.records import CalibratePayload, JobRecord
from service.jobs.store import FINISHED
from service.jobs.templates import template_process
from service.models.loaded import check_model_unchanged, checked_model_files
from service.models.record import ModelRecord
from service.models.registry import get_model
from service.statistics.cover import unreached_by_every
from service.storage.keys import calibration_front_key, calibration_request_key, calibration_result_key, probes_key
from service.universes.build import ensure_universe
from service.variants.service import coefficients_for_unlearn, submit_variant, variant_view

RunJob = Callable[[Context, str], None]
# the search spells these as plain strings (search.py, goal_search.py); the result names them
Stopped = Literal["budget", "converged"]
Stage = Literal["coarse", "fine"]
_WAIT_POLL_S = 0.5


def run_calibration(ctx: Context, job: JobRecord, run_job: RunJob) -> CalibrationJobResult:
    """Answer a stored calibration request (see the module docstring): load the scorers, search,
    validate and build the recommendation, then store the result (last: the calibration is answered).

    Args:
        run_job: the job runner (:func:`service.execution.runner.run_job`), which runs the recommended
            variant's build job inline.
    """
    calibration_id = job.payload_of(CalibratePayload).calibration_id
    cached = ctx.storage.find_json(calibration_result_key(calibration_id))
    if cached is not None:
        stored = read_calibration_result(calibration_id, cached).model_dump(mode="json")
        return CalibrationJobResult.model_validate({**stored, "reused": True})
    request = CalibrationRequest.from_json(ctx.storage.get_json(calibration_request_key(calibration_id)), calibration_id)
    started = time.monotonic()
    progress = ProgressReporter(ctx, job.job_id, request.search.budget)
    scoring = _prepare(ctx, job, request, calibration_id, progress)
    searched_at = time.monotonic()
    found, best, measured = _search(ctx, request, scoring, progress)
    search_s = time.monotonic() - searched_at
    result = _answer(ctx, job, request, scoring, found, best, measured, run_job)
    seconds = {
        "total": round(time.monotonic() - started, 3),
        "model_load": round(scoring.load_s, 3),
        "search": round(search_s, 3),
        "per_candidate": round(search_s / max(1, len(found.candidates)), 4),
    }
    check_model_unchanged(ctx, scoring.model)  # its mapped weights were not rewritten while they were scored
    stored = result.model_copy(update={"seconds": seconds}).model_dump(mode="json")  # the job's one dump
    read_calibration_result(calibration_id, stored)  # it reads back as it is stored: a shape bug fails here
    ctx.storage.put_bytes(calibration_front_key(calibration_id), render_front_png(stored, *default_axes(stored)))
    ctx.storage.put_json(calibration_result_key(calibration_id), stored)  # last: the calibration is answered
    ctx.jobs.set_progress(job.job_id, len(found.candidates), len(found.candidates))
    return CalibrationJobResult.model_validate({**stored, "reused": False})


@dataclass
class _Scoring:
    """What a calibration scores candidates with, loaded once: the model, its universe, the layers
    any member reached, the in-memory scorer and, with an objective, the goal's run."""

    model: ModelRecord
    universe: UniverseManifest
    layout: ModelLayout
    candidates: InMemoryCandidates | ClassifierCandidates
    goal: GoalRun | ClassifierGoalRun | None
    searched: CalibrationProbes
    load_s: float
    # per reference concept, the retain probes that are its records (:mod:`service.calibration.overlap`)
    retain_held: dict[str, int] = dataclasses.field(default_factory=dict)
    retain_total: int = 0


def _prepare(
    ctx: Context, job: JobRecord, request: CalibrationRequest, calibration_id: str, progress: ProgressReporter
) -> _Scoring:
    universe, _ = ensure_universe(ctx, request.universe_id, CancelOnly(progress))
    model = get_model(ctx, request.model_id)
    # Layers no member's forward pass ran have zero engrams: no candidate edits them.
    unreached = unreached_by_every(ctx, universe.member_prefixes)
    layout = dataclasses.replace(model.layout, layers=[s for s in model.layout.layers if s.name not in unreached])
    loaded = time.monotonic()
    raw = _stored_probes(ctx, calibration_id, request.probes_digest)
    searched, held = _split(raw, request.goal.held_out_fraction if request.goal is not None else None)
    if is_classifier_goal(request.goal):  # an image classifier: labelled images, its own metrics
        classifier = _classifier_scorer(ctx, model, layout, universe, request, searched)
        goal: GoalRun | ClassifierGoalRun | None = ClassifierGoalRun(ctx, _goal_of(request), classifier, held)
        candidates: InMemoryCandidates | ClassifierCandidates = classifier
    else:
        candidates, goal = _text_scorers(ctx, job, model, layout, universe, request, searched, held)
    retain_held = {} if is_classifier_goal(request.goal) else retain_probes_held(ctx, request.reference, raw.retain)
    load_s = time.monotonic() - loaded
    return _Scoring(model, universe, layout, candidates, goal, searched, load_s, retain_held, len(raw.retain))


def _goal_of(request: CalibrationRequest) -> Any:
    if request.goal is None:  # is_classifier_goal said it has one
        raise JobFailed("a classifier calibration without its objective")
    return request.goal


def _classifier_scorer(
    ctx: Context,
    model: ModelRecord,
    layout: ModelLayout,
    universe: UniverseManifest,
    request: CalibrationRequest,
    searched: CalibrationProbes,
) -> ClassifierCandidates:
    files = checked_model_files(ctx, model)
    return ClassifierCandidates(
        ctx,
        files,
        files.folder,  # this machine's checked folder (a worker's copy of a remote model), never model.path
        layout,
        universe,
        request.term_prefixes,
        ctx.settings.torch_device,
        _union(layout, request.search.arms),
        searched,
        batch_size=ctx.settings.collect_batch_size,
        max_pixels=ctx.settings.max_image_pixels,
    )


def _text_scorers(
    ctx: Context,
    job: JobRecord,
    model: ModelRecord,
    layout: ModelLayout,
    universe: UniverseManifest,
    request: CalibrationRequest,
    searched: CalibrationProbes,
    held: CalibrationProbes,
) -> tuple[InMemoryCandidates, GoalRun | None]:
    # chat probes are rendered once, here, by the job's bounded template process (killed on cancel)
    with template_process(ctx, job.job_id) as renderer:
        candidates = InMemoryCandidates(
            ctx,
            checked_model_files(ctx, model),
            layout,
            universe,
            request.term_prefixes,
            _plain_probes(request, searched),
            ctx.settings.torch_device,
            _union(layout, request.search.arms),
            renderer,
        )
        if request.goal is None:
            return candidates, None
        return candidates, GoalRun(ctx, job.job_id, request.goal, candidates, searched, held, renderer)


def _search(
    ctx: Context, request: CalibrationRequest, scoring: _Scoring, progress: ProgressReporter
) -> tuple[SearchResult, Candidate | None, dict[tuple[Arm, float], Measured]]:
    """The search over the request's arms (the data_weighted arms' strengths measured first, from the
    universe's engrams and statistics, no forward pass), and its best candidate before validation."""
    candidates, goal = scoring.candidates, scoring.goal
    arms = measure_strengths(
        ctx, scoring.universe, request.term_prefixes, scoring.layout, candidates.reader, request.search.arms
    )
    measured: dict[tuple[Arm, float], Measured] = {}

    def scored(arm: Arm, alpha: float) -> Measured:
        measured[(arm, alpha)] = candidates.measure(arm, alpha)
        progress.advance(1)
        return measured[(arm, alpha)]

    if goal is None:
        found = search(arms, lambda arm, alpha: scored(arm, alpha).outcome, request.search.settings())
        return found, recommend(found.candidates), measured
    settings = request.search.goal_settings()
    found = goal_search(arms, lambda arm, alpha: goal.candidate_metrics(scored(arm, alpha)), goal.goal, settings)
    return found, recommend_for_goal(goal.goal, found.candidates), measured


def _answer(
    ctx: Context,
    job: JobRecord,
    request: CalibrationRequest,
    scoring: _Scoring,
    found: SearchResult,
    best: Candidate | None,
    measured: dict[tuple[Arm, float], Measured],
    run_job: RunJob,
) -> StoredCalibrationResult:
    """The result: the candidates, the goal's held-out check, the probes cut, the built recommendation
    and the warnings."""
    goal = scoring.goal
    result = assemble(request, scoring.candidates.base, found, measured)
    if goal is not None:
        held_out = None
        if best is not None and goal.has_held_out:
            best, held_out = goal.validated_on_held_out(ranked_for_goal(goal.goal, found.candidates))
        result = goal.amend(result, found, best)
        if held_out is not None:
            result = result.model_copy(update={"held_out": held_out})
    truncated = _truncated(goal if isinstance(goal, GoalRun) else scoring.candidates)
    if truncated:  # set only then: a calibration that cut no probe keeps its shape
        result = result.model_copy(update={"truncated_probes": truncated})
    if best is not None:
        built = _build_recommended(ctx, job.job_id, request, best, run_job)
        result = result.model_copy(update={"recommended": recommendation(result, best, built)})
    if request.goal is not None and request.goal.kind == "exact_match":
        general = GENERAL_SET in (scoring.searched.utility or {})
        result = result.model_copy(update={"perplexity_on": "general" if general else "retain"})
    if scoring.retain_held:  # set only then: a calibration whose retain probes no concept holds keeps its shape
        result = result.model_copy(update={"retain_probes_in_reference": scoring.retain_held})
    warnings = result_warnings(result, request.goal) + held_warning(scoring.retain_held, scoring.retain_total)
    return result.model_copy(update={"warnings": warnings})


def _truncated(scored: GoalRun | InMemoryCandidates | ClassifierCandidates) -> dict[str, int]:
    """Probe set -> probes whose prompt was cut to the probe bound (text probes; none: empty)."""
    if isinstance(scored, ClassifierCandidates):
        return {}
    return {name: sum(flags) for name, flags in sorted(scored.truncated().items()) if any(flags)}


def _plain_probes(request: CalibrationRequest, searched: CalibrationProbes) -> dict[str, list[Probe]]:
    """The probes every candidate is scored on by NLL and exact match: forget and retain, and the
    general text of the default objective."""
    if request.goal is not None and request.goal.kind == "exact_match":
        return plain_sets(searched)
    return {"forget": [parse_probe(p) for p in searched.forget], "retain": [parse_probe(p) for p in searched.retain]}


def _union(layout: ModelLayout, arms: Sequence[Arm]) -> list[Any]:
    names = {spec.name for arm in arms for spec in arm_layers(layout.layers, arm)}
    return [spec for spec in layout.layers if spec.name in names]


def _stored_probes(ctx: Context, calibration_id: str, digest: str) -> CalibrationProbes:
    data = json.loads(ctx.storage.get_bytes(probes_key(digest)))
    return read_record(CalibrationProbes, calibration_id, probes_key(digest), data)


def _split(raw: CalibrationProbes, fraction: float | None) -> tuple[CalibrationProbes, CalibrationProbes]:
    """The stored probe sets as ``(searched, held out)``: forget, retain and each utility set split
    by ``held_out_fraction`` (none without one), and a classifier's test set; the holdout (non-member)
    facts are used whole by both."""
    forget, held_forget = held_out_split(raw.forget, fraction)
    retain, held_retain = held_out_split(raw.retain, fraction)
    test = held_test = None
    if raw.test is not None:  # an image classifier's test images: split as forget and retain are
        test, held_test = held_out_split(raw.test, fraction)
    utility, held_utility = {}, {}
    for name, items in (raw.utility or {}).items():
        utility[name], held_utility[name] = held_out_split(items, fraction)
    holdout = list(raw.holdout or [])
    searched = CalibrationProbes(forget=forget, retain=retain, test=test, holdout=holdout, utility=utility)
    held = CalibrationProbes(forget=held_forget, retain=held_retain, test=held_test, holdout=holdout, utility=held_utility)
    return searched, held


# ---------------------------------------------------------------- the result


def assemble(
    request: CalibrationRequest,
    base: Mapping[str, Mapping[str, float]],
    found: SearchResult,
    measured: Mapping[tuple[Arm, float], Measured],
) -> StoredCalibrationResult:
    """The calibration's answer before its recommendation is built: the base's scores, every
    candidate, the front (``recommended`` is set by :func:`recommendation` once the variant is built)."""
    front = {c.index for c in pareto_front(found.candidates)}
    rows = [_candidate(c, measured[(c.arm, c.alpha)], c.index in front) for c in found.candidates]
    best = recommend(found.candidates)
    settings = request.search.settings()
    limit = settings.limit
    return StoredCalibrationResult(
        calibration_id=request.calibration_id,
        model_id=request.model_id,
        concepts=list(request.concepts),
        universe_id=request.universe_id,
        reference=list(request.reference),
        constraint={"max_retain_nll_ratio": limit},
        base={split: _scores(base[split]) for split in SPLITS},
        candidates=rows,
        pareto_front=sorted(front, key=lambda i: rows[i].retain.nll_ratio or math.inf),
        recommended=None,
        note=None if best is not None else _no_feasible_note(found, limit),
        evaluations=len(found.candidates),
        budget=settings.budget,
        stopped=cast(Stopped, found.stopped),  # checked here: the model validates it
        arms=[arm.name for arm in request.search.arms],
        pruned_arms=found.pruned,
        unexplored_arms=found.unexplored,
        skipped_module_sets=list(request.skipped_module_sets),
        alpha_range=[settings.alpha_min, settings.alpha_max],
        grid_equivalent=grid_equivalent(len(request.search.arms), settings),
        front_png=front_png_url(request.calibration_id),
    )


def grid_equivalent(arms: int, settings: SearchSettings) -> int:
    """Candidates a full grid over the same arms would evaluate at the search's final resolution
    (``α`` steps of a factor ``1 + tol`` from ``α_min`` to ``α_max``)."""
    steps = math.ceil(math.log(settings.alpha_max / settings.alpha_min) / math.log(1 + settings.tol)) + 1
    return arms * steps


def _candidate(candidate: Candidate, measured: Measured, on_front: bool) -> CalibrationCandidate:
    outcome = candidate.outcome
    return CalibrationCandidate(
        index=candidate.index,
        options=_options(candidate),
        forget=_scores(measured.summary["forget"], outcome.forget_ratio),
        retain=_scores(measured.summary["retain"], outcome.retain_ratio),
        feasible=candidate.feasible,
        pareto=on_front,
        stage=cast(Stage, candidate.stage),  # checked here: the model validates it
    )


def _options(candidate: Candidate) -> CandidateOptions:
    arm = candidate.arm
    return CandidateOptions(
        alpha=candidate.alpha,
        scaling=arm.scaling,
        module_set=arm.module_set,
        modules=_list(arm.modules),
        layers=_list(arm.layers),
        module_strengths=dict(arm.strengths) or None,
    )


def _list(values: tuple[Any, ...] | None) -> list[Any] | None:
    return None if values is None else list(values)


def _scores(summary: Mapping[str, float], ratio: float | None = None) -> SplitScore:
    """One split's scores (a candidate's with its NLL ratio to the base; the base's without)."""
    return SplitScore(
        mean_nll=_finite(summary["mean_nll"]),
        exact_match=_finite(summary["exact_match"]),
        n=int(summary["n"]),
        nll_ratio=None if ratio is None else _finite(ratio),
    )


def _finite(value: float) -> float | None:
    """JSON has no infinity or NaN: a broken edit's NLL is shown as null."""
    return float(value) if math.isfinite(value) else None


def recommendation(result: StoredCalibrationResult, best: Candidate, built: BuiltVariant) -> CalibrationRecommendation:
    """The recommended candidate as its row of ``result`` shows it (options, forget ratio and, with an
    objective, metrics), and the variant it was built as."""
    row = result.candidates[best.index]
    return CalibrationRecommendation(
        candidate=best.index,
        options=row.options,
        forget_nll_ratio=row.forget.nll_ratio,
        retain_nll_ratio=best.outcome.retain_ratio,
        variant_id=built.variant_id,
        variant_job_id=built.variant_job_id,
        format=built.format,
        metrics=row.metrics,
        forget_exact_match=row.forget.exact_match,
        retain_exact_match=row.retain.exact_match,
    )


def _no_feasible_note(found: SearchResult, limit: float) -> str:
    if not found.candidates:
        return "no candidate was evaluated"
    gentlest = min(found.candidates, key=lambda c: c.outcome.retain_ratio)
    return (
        f"no candidate keeps the retain NLL ratio within {limit:g}: the gentlest evaluated "
        f"({gentlest.arm.name} at α={gentlest.alpha:.3g}) has {gentlest.outcome.retain_ratio:.3g}; "
        "lower alpha_min, or allow a larger max_retain_nll_ratio"
    )


# ---------------------------------------------------------------- the recommended variant


def _build_recommended(
    ctx: Context, job_id: str, request: CalibrationRequest, best: Candidate, run_job: RunJob
) -> BuiltVariant:
    """Build the recommended candidate as an unlearn variant of the calibrated universe, in the
    requested format: the variant job runs inline here (a job body may not queue another job in
    embedded mode, and the universe is on this worker's disk already)."""
    arm, variant, alpha = best.arm, request.variant, float(best.alpha)
    edit = EditOptions(
        scaling=arm.scaling,
        modules=_list(arm.modules),
        layers=_list(arm.layers),
        module_strengths=dict(arm.strengths) or None,
        universe=request.universe_id,
        format=variant.format,
        lora_rank=variant.lora_rank,
        lora_target=variant.lora_target,
    )

    def run_here(created: JobRecord) -> None:  # the variant's job, in this job's process
        run_job(inline, created.job_id)

    inline = dataclasses.replace(ctx, dispatch=run_here)
    terms = coefficients_for_unlearn(request.concepts, alpha)
    view, variant_job = submit_variant(inline, request.model_id, terms, alpha, edit)
    if variant_job is not None and variant_job.status not in FINISHED:
        variant_job = _wait(ctx, job_id, variant_job.job_id)  # built by another request's job
    view = variant_view(ctx, view.variant_id)
    if view.status != "ready":
        job = ctx.jobs.get(view.job_id) if view.job_id else None
        why = job.error.detail if job is not None and job.error is not None else None
        raise JobFailed(f"the recommended variant {view.variant_id} did not build: {why or view.status}")
    return BuiltVariant(view.variant_id, view.job_id, variant.format)


@dataclass(frozen=True)
class BuiltVariant:
    """The recommended candidate as built: its variant, the job that built it and its format."""

    variant_id: str
    variant_job_id: str | None
    format: Format


def _wait(ctx: Context, job_id: str, other: str) -> JobRecord | None:
    """Wait for another job to end, stopping when this one is cancelled."""
    while True:
        found = ctx.jobs.get(other)
        if found is None or found.status in FINISHED:
            return found
        mine = ctx.jobs.get(job_id)
        if mine is not None and mine.cancel_requested:
            raise JobCancelled()
        time.sleep(_WAIT_POLL_S)
