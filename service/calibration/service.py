"""Submitting a calibration: check everything, name it by content, and start its job when it is new.

A calibration's ID is a content hash of what determines its answer: the model's weights, the
universe, the removed concepts' statistics, the probes, the constraint, the edit space, the budget
and the recommended variant's format. The same request therefore gives the same answer: while its
job runs or after it succeeded, a second request is given that job (200 once it finished); only a
failed or cancelled calibration is run again.

Storage layout:

- ``calibrations/<id>/request.json``: what the job reads, and the job that answers it
  (:class:`~service.calibration.request.CalibrationRequest`)
- ``calibrations/<id>/result.json``: every candidate, the Pareto front, the recommendation (written last)
- ``calibrations/<id>/front.png``: the front drawn (forget vs retain NLL ratio, recommended point marked)
- ``probes/<sha256>.json``: the probes, shared with evaluations
"""

from __future__ import annotations

import dataclasses

from api_schemas import CalibrateRequest, Calibration
from service.calibration.goal import GoalSpec, check_measurable, goal_spec
from service.calibration.plot import default_axes, plottable_metrics, render_front_png
from service.calibration.records import StoredCalibrationResult, read_calibration_result
from service.calibration.request import CalibrationRequest, has_messages, one_term_each, probes_digest, stored_probes
from service.calibration.space import EditSpace, SpaceError, arm_layers, edit_space
from service.context import Context
from service.engine.expert_names import is_expert_layer
from service.engine.layers import LayerSpec, summarize_names
from service.engine.layout import ModelLayout
from service.engine.lora_rules import vllm_bias_refusal, vllm_biased_layers
from service.errors import InvalidInput, NotFound
from service.evaluation.classifier_probes import check_image_probes, check_probe_kinds, model_classes, retain_classifier
from service.evaluation.service import resolve_retain_model as check_retain_model
from service.jobs import callbacks
from service.jobs.admission import admit
from service.jobs.records import CalibratePayload, JobRecord
from service.jobs.store import FINISHED, new_job
from service.jobs.submit import attach_callbacks
from service.models.record import ModelRecord
from service.models.registry import check_causal_lm, check_chat_templates, get_model
from service.statistics.cover import check_statistics_cover, unreached_by_every
from service.storage.keys import calibration_front_key, calibration_request_key, calibration_result_key, probes_key
from service.universes.members import EditUniverse, resolve_members
from service.universes.records import current_pointer, find_manifest
from service.universes.retention import make_room, note_use
from service.universes.service import record_universe, set_current


def front_png_url(calibration_id: str) -> str:
    """Where the API serves the drawn front (a relative URL, as job results give them)."""
    return f"/calibrations/{calibration_id}/front.png"


def valid_calibration_id(calibration_id: str) -> bool:
    return len(calibration_id) == 32 and all(c in "0123456789abcdef" for c in calibration_id)


def submit_calibration(ctx: Context, model_id: str, options: CalibrateRequest) -> tuple[str, JobRecord, bool]:
    """Check a calibration request and start its job, or find the one that answers it.

    Args:
        options: the request as the route validated it.

    Returns:
        (calibration ID, its job, whether that job had finished already).

    Raises:
        NotFound, Conflict, InvalidInput: an unknown model or concept, a concept without ready
            statistics, an edit space this model does not have, a layer the statistics lack,
            a variant format the edit space cannot carry; nothing is written then.
    """
    urls = callbacks.check_optional_url(options.callback_url, ctx.settings)
    options = one_term_each(options)
    model = get_model(ctx, model_id)
    _check_probes(ctx, model, options)
    full = model.layout
    space = request_space(full, options)
    if has_messages(options):
        check_chat_templates({model_id: model}, "messages probes")
    goal = _goal(ctx, model_id, options)
    resolved = _resolve(ctx, model, options)
    # Layers no member reached (a vision tower) are never edited: what a candidate can carry is
    # checked on the others, as the job evaluates them (service.calibration.build).
    unreached = unreached_by_every(ctx, [m.stats for m in resolved.spec.members])
    layout = dataclasses.replace(full, layers=[spec for spec in full.layers if spec.name not in unreached])
    _check_format(space, layout, options)
    _check_cover(ctx, full, resolved, space)
    probes = stored_probes(options)
    digest = probes_digest(probes)
    with ctx.lock:
        if resolved.becomes_current is not None and current_pointer(ctx, model_id) is not None:
            resolved = _resolve(ctx, model, options)  # another request fixed the current universe first: use it
            _check_cover(ctx, layout, resolved, space)
        request = CalibrationRequest.new(model, options, resolved, space, digest, goal)
        calibration_id = request.calibration_id
        existing = _answering_job(ctx, calibration_id)
        if existing is None:  # before anything is written; a calibration answered already is never refused
            admit(ctx)
        if resolved.becomes_current is not None:  # the first request without a universe fixes it
            set_current(ctx, resolved.becomes_current)
        if existing is not None:
            return calibration_id, attach_callbacks(ctx, existing, urls), existing.status in FINISHED
        projected = make_room(ctx, resolved.spec)  # a 409 here changes nothing
        ctx.storage.put_bytes(probes_key(digest), probes)  # before the job: it reads them
        payload = CalibratePayload(calibration_id=calibration_id, model_id=model_id)
        job = ctx.jobs.create(new_job("calibrate", payload, unit="candidates", callback_urls=urls))
        built = find_manifest(ctx, resolved.spec.universe_id) is not None
        record_universe(ctx, resolved.spec, None if built else job.job_id)  # this job builds it if need be
        note_use(ctx, resolved.spec.universe_id, projected=projected, rebuilding=not built)
        ctx.storage.put_json(calibration_request_key(calibration_id), request.with_job(job.job_id).to_json())
    ctx.dispatch(job)
    return calibration_id, ctx.jobs.get(job.job_id) or job, False


def _check_probes(ctx: Context, model: ModelRecord, options: CalibrateRequest) -> None:
    """The probes are of the model's kind (a 422 naming the first that is not, and the model's kind):
    labelled images for an image classifier, each decoded under the pixel bound (413) with a label of
    its classes (422), as evaluate checks them; text probes for a causal LM."""
    probes = {
        name: [p.model_dump(exclude_none=True) for p in getattr(options, name)] for name in ("forget", "retain", "test")
    }
    check_probe_kinds(probes, model)  # before the causal-LM check: it names the probe and the model's kind
    if model.kind == "image":
        check_image_probes(probes, model_classes(model), ctx.settings.max_image_pixels)
    else:
        check_causal_lm(model, "calibration's evaluations")


def _goal(ctx: Context, model_id: str, options: CalibrateRequest) -> GoalSpec | None:
    """An objective's goal: its retain model found and checked (404/422 as evaluate's), every metric
    it names measurable on these probes (422 naming what is missing). Without an objective: the
    exact-match default goal, or None when ``max_retain_nll_ratio`` asks for the NLL-ratio search
    (image probes: an image classifier's calibration always has one, its default if none is asked)."""
    if options.kind == "image":
        retain = None
        if options.retain_model is not None:  # evaluate's check of a retrained classifier
            retain = retain_classifier(ctx, get_model(ctx, model_id), options.retain_model)
        check_measurable(options, retain is not None)
        return goal_spec(options, retain)
    if options.objective is None:
        return goal_spec(options, None)
    retain = None
    if options.retain_model is not None:
        # evaluate's own check (a registered model or a ready variant, the base's vocabulary)
        retain = check_retain_model(ctx, model_id, options.retain_model)
    check_measurable(options, retain is not None)
    return goal_spec(options, retain)


def request_space(layout: ModelLayout, options: CalibrateRequest) -> EditSpace:
    """The arms the request spans on this model (a 422 naming what it lacks)."""
    try:
        return edit_space(layout.layers, options.module_sets, options.layer_sets, options.scalings)
    except SpaceError as exc:
        raise InvalidInput(str(exc)) from None


def union_layers(layout: ModelLayout, space: EditSpace) -> list[LayerSpec]:
    """Every layer some arm edits, in layout order."""
    names = {spec.name for arm in space.arms for spec in arm_layers(layout.layers, arm)}
    return [spec for spec in layout.layers if spec.name in names]


def _check_format(space: EditSpace, layout: ModelLayout, options: CalibrateRequest) -> None:
    """Refuse by name what a candidate could not be evaluated as, or its variant not be built as."""
    union = union_layers(layout, space)
    fused = [spec.name for spec in union if spec.name in layout.expert_slices]
    if fused:
        raise InvalidInput(
            f"calibration evaluates candidates as whole modules; the expert layers {summarize_names(fused)} are "
            "slices of a fused parameter: choose module_sets that leave the experts out"
        )
    if options.format == "peft":
        experts = [spec.name for spec in union if is_expert_layer(spec.name)]
        if experts:
            raise InvalidInput(
                f'format "peft" cannot carry the expert layers {summarize_names(experts)}; use format "checkpoint" or '
                '"delta", or module_sets that leave the experts out'
            )
    if options.lora_target == "vllm":
        biased = vllm_biased_layers(union)
        if biased:
            raise InvalidInput(vllm_bias_refusal(biased, union))


def _resolve(ctx: Context, model: ModelRecord, options: CalibrateRequest) -> EditUniverse:
    return resolve_members(
        ctx, model, list(options.concepts), reference=options.reference, universe_id=options.universe, rcond=options.rcond
    )


def _check_cover(ctx: Context, layout: ModelLayout, resolved: EditUniverse, space: EditSpace) -> None:
    """Every arm's layers have statistics in every member of the universe (a 409 naming them)."""
    members = [(m.name, m.stats) for m in resolved.spec.members]
    for arm in space.arms:
        modules = list(arm.modules) if arm.modules is not None else None
        layers = list(arm.layers) if arm.layers is not None else None
        check_statistics_cover(ctx, layout, members, modules, layers)


def _answering_job(ctx: Context, calibration_id: str) -> JobRecord | None:
    """The job that answers this calibration: running, or succeeded (its result stored); else None."""
    stored = find_request(ctx, calibration_id)
    job = ctx.jobs.get(stored.job_id) if stored and stored.job_id else None
    if job is None or job.status in {"failed", "cancelled"}:
        return None
    if job.status == "succeeded" and not ctx.storage.exists(calibration_result_key(calibration_id)):
        return None
    return job


def find_request(ctx: Context, calibration_id: str) -> CalibrationRequest | None:
    if not valid_calibration_id(calibration_id):
        return None
    stored = ctx.storage.find_json(calibration_request_key(calibration_id))
    return None if stored is None else CalibrationRequest.from_json(stored, calibration_id)


# ---------------------------------------------------------------- views


def calibration_result(ctx: Context, calibration_id: str) -> StoredCalibrationResult | None:
    """The stored result (``result.json``) as its record; None before."""
    stored = ctx.storage.find_json(calibration_result_key(calibration_id))
    return None if stored is None else read_calibration_result(calibration_id, stored)


def calibration_view(ctx: Context, calibration_id: str) -> Calibration:
    """A calibration: its request's subject, its job's status, and its result once there."""
    request = find_request(ctx, calibration_id)
    if request is None:
        raise NotFound(f"calibration {calibration_id} does not exist")
    job = ctx.jobs.get(request.job_id) if request.job_id else None
    result = calibration_result(ctx, calibration_id)
    status = "succeeded" if result is not None else (job.status if job else "failed")
    return Calibration(
        calibration_id=calibration_id,
        model_id=request.model_id,
        concepts=list(request.concepts),
        universe_id=request.universe_id,
        status=status,
        job_id=request.job_id,
        result=result,
    )


def front_png(ctx: Context, calibration_id: str, x: str | None = None, y: str | None = None) -> bytes:
    """The drawn front of a finished calibration (404 before): as the job stored it, or with ``x``
    and/or ``y`` any two metrics its candidates carry, drawn from its result (422 naming an unknown one)."""
    if find_request(ctx, calibration_id) is None:
        raise NotFound(f"calibration {calibration_id} does not exist")
    key = calibration_front_key(calibration_id)
    if not ctx.storage.exists(key):
        raise NotFound(f"calibration {calibration_id} has no front yet (its job has not succeeded)")
    if x is None and y is None:
        return ctx.storage.get_bytes(key)
    record = calibration_result(ctx, calibration_id)
    if record is None:
        raise NotFound(f"calibration {calibration_id} has no result yet (its job has not succeeded)")
    result = record.model_dump(mode="json")
    known = plottable_metrics(result)
    unknown = [name for name in (x, y) if name is not None and name not in known]
    if unknown:
        raise InvalidInput(f"the candidates carry no metric {', '.join(unknown)}; known: {', '.join(known)}")
    default_x, default_y = default_axes(result)
    return render_front_png(result, x or default_x, y or default_y)
