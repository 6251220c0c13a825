"""Submitting a variant: resolve it once into its plan (:mod:`service.variants.plan`), check the plan,
and build the variant when it is new; its view.

The variant ID is a content hash of everything that determines the weights, the universe's ID
included, so the same request keeps giving the same variant while the model's current universe
stays the same (uploading an unrelated concept changes nothing until the universe is advanced).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from api_schemas import EditOptions, Variant, VariantSubmission
from service.context import Context
from service.engine.errors import EditError
from service.engine.expert_names import check_adapter_layers
from service.engine.gguf_rules import GgufWriteError, check_gguf_tokenizer, check_gguf_writable, default_gguf_quantization
from service.engine.layers import LayerSpec, unmatched_suffixes
from service.engine.layout import ModelLayout
from service.engine.lora_rules import rank_cap, vllm_bias_refusal, vllm_biased_layers
from service.errors import InvalidInput, NotFound
from service.jobs import callbacks
from service.jobs.admission import admit
from service.jobs.records import JobRecord, VariantPayload
from service.jobs.store import FINISHED, job_answer, new_job
from service.jobs.submit import attach_callbacks
from service.models.record import ModelRecord
from service.models.registry import get_model
from service.statistics.cover import check_cover_of
from service.storage.keys import VARIANTS, variant_manifest_key, variant_plan_key, variant_request_key
from service.storage.stored_json import skip_unreadable
from service.universes.members import EditUniverse, resolve_members
from service.universes.projection import Projection
from service.universes.records import current_pointer, find_manifest
from service.universes.retention import make_room, note_use
from service.universes.service import record_universe, set_current
from service.universes.spec import UniverseSpec
from service.variants.manifest import VariantManifest, read_variant_manifest
from service.variants.plan import VariantPlan, plan_variant
from service.variants.provenance import VariantFilter, check_reverts, find_provenance, metadata_of, record_provenance
from service.variants.spec import VariantRequest, VariantSpec


def coefficients_for_unlearn(concepts: Sequence[str], alpha: float) -> dict[str, float]:
    """Unlearning is composition with ``c_k = −α`` for every removed concept."""
    return {name: -float(alpha) for name in concepts}


def submit_variant(
    ctx: Context, model_id: str, terms: dict[str, float], alpha: float | None, options: EditOptions | Mapping[str, Any]
) -> tuple[Variant, JobRecord | None]:
    """Resolve a compose/unlearn request once into its plan, a content-addressed variant, and build it if new.

    Args:
        options: the request's edit options (an :class:`EditOptions`, or its fields, validated here).

    Returns:
        (variant view, the building job or None when the variant was already there).
    """
    variant, job, _ = submit_noted(ctx, model_id, terms, alpha, options)
    return variant, job


def submit_noted(
    ctx: Context, model_id: str, terms: dict[str, float], alpha: float | None, options: EditOptions | Mapping[str, Any]
) -> tuple[Variant, JobRecord | None, list[str]]:
    """:func:`submit_variant`, and its warnings (metadata an earlier identical request already set)."""
    meta = metadata_of(options)  # never part of the ID: stored beside the variant (service.variants.provenance)
    edit = edit_options(options)
    urls = callbacks.check_optional_url(edit.callback_url, ctx.settings)
    model = get_model(ctx, model_id)
    _check_options(model, edit)
    check_reverts(ctx, meta, model_id)
    spec = VariantSpec.from_options(edit, default_gguf_quantization(model.gguf.quantization if model.gguf else None))
    resolved = _resolve(ctx, model, terms, edit)
    with ctx.lock:
        if resolved.becomes_current is not None and current_pointer(ctx, model_id) is not None:
            resolved = _resolve(ctx, model, terms, edit)  # another request fixed the current universe first: use it
        # Planned and checked under the lock, once: the universe it names can no longer change under it.
        plan = plan_variant(ctx, model, terms, alpha, spec, resolved)
        _check_plan(ctx, model.layout, edit, plan)  # before anything is written: a refused request fixes nothing
        answered, job = _built_or_building(ctx, plan.variant_id)
        if not answered:  # before anything is written; a variant built or building starts no job and is never refused
            admit(ctx)
        # A variant whose job will build its universe must fit ENGRAM_UNIVERSE_BYTES_BUDGET (a 409 here
        # changes nothing: make_room); a variant already built is served without reading its universe.
        projected = None if variant_manifest(ctx, plan.variant_id) is not None else make_room(ctx, resolved.spec)
        if resolved.becomes_current is not None:  # the first request without a universe fixes it
            set_current(ctx, resolved.becomes_current)
        notes = record_provenance(ctx, plan.variant_id, meta, create=not answered)
        if answered:
            if job is not None:  # the same variant again: its build calls this URL back too
                job = attach_callbacks(ctx, job, urls)
            note_use(ctx, plan.universe_id)  # its universe is still asked for: keep it
            built = variant_manifest(ctx, plan.variant_id) is not None
            return variant_view(ctx, plan.variant_id), (None if built else job), notes
        job = _start_build(ctx, plan, resolved.spec, urls, projected)
    ctx.dispatch(job)
    return variant_view(ctx, plan.variant_id), ctx.jobs.get(job.job_id), notes


def _built_or_building(ctx: Context, variant_id: str) -> tuple[bool, JobRecord | None]:
    """Whether the variant is built or its job still runs, and its stored request's job (if any)."""
    existing = find_variant_request(ctx, variant_id)
    job = ctx.jobs.get(existing.job_id) if existing is not None and existing.job_id else None
    building = job is not None and job.status not in {"failed", "cancelled"}
    answered = existing is not None and (variant_manifest(ctx, variant_id, fresh=True) is not None or building)
    return answered, job


def _start_build(
    ctx: Context, plan: VariantPlan, universe: UniverseSpec, urls: list[str], projected: Projection | None
) -> JobRecord:
    """Create the variant's job and store its plan, then its request (the variant's view), under the lock."""
    built = find_manifest(ctx, plan.universe_id) is not None
    # Not built: it builds its universe first, far more than a copy, a GPU worker's work.
    payload = VariantPayload(variant_id=plan.variant_id, model_id=plan.model_id, queue=None if built else "gpu")
    job = ctx.jobs.create(new_job("variant", payload, unit="layers", callback_urls=urls))
    # The universe names the job that builds it: this one, on first need, unless built already.
    record_universe(ctx, universe, None if built else job.job_id)
    note_use(ctx, plan.universe_id, projected=projected, rebuilding=not built)
    planned = plan.with_job(job.job_id)
    ctx.storage.put_json(variant_plan_key(plan.variant_id), planned.model_dump(mode="json"))  # what the job runs
    ctx.storage.put_json(variant_request_key(plan.variant_id), planned.request.model_dump(mode="json"))
    ctx.reads.forget(variant_request_key(plan.variant_id))
    return job


def _check_options(model: ModelRecord, options: EditOptions) -> None:
    """The refusals the options and the model's registration decide alone, before the universe is resolved."""
    _check_lora_rank(options)
    _check_modules(model.layout, options.modules)
    _check_servable(options)
    _check_adapter_kind(model, options)
    _check_gguf_writable(model, options)


def check_options_first(ctx: Context, model_id: str, options: EditOptions) -> None:
    """What a submission refuses on the options and the model alone, for a route that resolves concepts
    before submitting (an unlearn without alpha): the same refusal comes first, whatever the concepts."""
    _check_options(get_model(ctx, model_id), options)


def _check_plan(ctx: Context, layout: ModelLayout, options: EditOptions, plan: VariantPlan) -> None:
    """Every refusal that depends on the layers the plan selected (a 422 or 409 naming what to change)."""
    selected = plan.layers(layout)
    if not selected:
        raise InvalidInput("the modules/layers selection matches no editable layer")
    _check_strengths(selected, options)
    _check_adapter_layers(selected, options)
    edited = plan.layers(layout, plan.edited)  # never-reached layers are written as they are
    _check_conv_adapters(edited, options)
    _check_vllm_biases(edited, options)
    check_cover_of(ctx, layout, plan.universe, selected, plan.unreached)  # every member covers every edited layer


def edit_options(options: EditOptions | Mapping[str, Any]) -> EditOptions:
    """The edit options as the wire contract types them: fields given as a mapping are validated
    (a 422 naming what is wrong, as the route's own validation would be)."""
    if isinstance(options, EditOptions):
        return options
    try:
        return EditOptions.model_validate(dict(options))
    except ValidationError as exc:
        raise InvalidInput("; ".join(_field_error(e) for e in exc.errors())) from None


def _field_error(error: Mapping[str, Any]) -> str:
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else str(error["msg"])


def _check_adapter_layers(selected: Sequence[LayerSpec], options: EditOptions) -> None:
    """A peft adapter cannot carry expert layers (slices of fused parameters): a 422 naming them,
    before anything is written (the job checks again, for requests stored before this check)."""
    if options.format != "peft":
        return
    try:
        check_adapter_layers(selected)
    except EditError as exc:
        raise InvalidInput(str(exc)) from None


def _check_adapter_kind(model: ModelRecord, options: EditOptions) -> None:
    """A vLLM adapter of an image classifier: a 422 naming why, before anything is written (vLLM
    serves no image classifier; the bias or conv refusals would name a layer instead)."""
    if options.format != "peft":
        return
    if options.lora_target == "vllm" and model.kind == "image":
        raise InvalidInput(
            f'lora_target "vllm": model {model.model_id} is an image classifier, which vLLM does not serve; '
            'use lora_target "peft" (or format "checkpoint")'
        )


def _check_gguf_writable(model: ModelRecord, options: EditOptions) -> None:
    """Format ``gguf``: a 422 naming what the GGUF writer does not map (an architecture other than
    LlamaForCausalLM: a mixture of experts, an image classifier...; a tokenizer that is not a
    byte-level BPE ``tokenizer.json``), before anything is written."""
    if options.format != "gguf":
        return
    quantization = options.gguf_quantization or default_gguf_quantization(model.gguf.quantization if model.gguf else None)
    try:
        check_gguf_writable({"architectures": [model.architecture]}, quantization)
        check_gguf_tokenizer(Path(model.path))
    except GgufWriteError as exc:
        raise InvalidInput(f"model {model.model_id}: {exc}") from None


def refuse_gguf_loading(ctx: Context, variant_ids: Iterable[str | None], what: str) -> None:
    """A 422 when a variant to be loaded by a job is a ``gguf`` one: the jobs load safetensors
    checkpoints, deltas and adapters, not GGUF files (the same request's checkpoint variant holds
    the same edit unquantized). IDs that are not variants (a registered model) pass."""
    for variant_id in variant_ids:
        request = find_variant_request(ctx, variant_id) if variant_id else None
        if request is not None and request.format == "gguf":
            raise InvalidInput(
                f'variant {variant_id} is format "gguf", which {what} cannot load: evaluate the checkpoint '
                'variant of the same request (format "checkpoint"), which holds the same edit unquantized'
            )


def _check_conv_adapters(edited: Sequence[LayerSpec], options: EditOptions) -> None:
    """A conv layer a peft adapter cannot carry (:meth:`ConvKernel.adapter_refusal`): a 422 naming it,
    before any job. ``edited``: the selected layers some concept of the edit reached (a
    vision-language model's vision tower under text concepts is not)."""
    if options.format != "peft":
        return
    for spec in edited:
        if spec.kernel is None:
            continue
        if reason := spec.kernel.adapter_refusal(options.lora_target):
            raise InvalidInput(f'format "peft" cannot carry the conv layer {spec.name}: {reason}')


def _check_servable(options: EditOptions) -> None:
    """``lora_target: "vllm"``: a peft adapter at a rank vLLM serves; anything else is refused by
    name before anything is written (its layers: :func:`_check_vllm_biases`)."""
    target = options.lora_target
    if target == "peft":
        return
    if options.format != "peft":
        raise InvalidInput(f'lora_target {target!r} applies to format "peft" only, not {options.format!r}')
    try:
        rank_cap(options.lora_rank, target)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def _check_vllm_biases(edited: Sequence[LayerSpec], options: EditOptions) -> None:
    """``lora_target: "vllm"``: the edited layers (those some concept of the edit reached) have no
    bias (vLLM loads no lora_bias), a 422 naming them."""
    if options.lora_target != "vllm":
        return
    biased = vllm_biased_layers(edited)
    if biased:
        raise InvalidInput(vllm_bias_refusal(biased, edited))


def _check_strengths(selected: Sequence[LayerSpec], options: EditOptions) -> None:
    """Every ``module_strengths`` suffix, a factor of 1 included, matches an edited layer (a 422
    naming those that do not); :meth:`VariantSpec.from_options` then drops the ones."""
    given = options.module_strengths or {}
    missing = unmatched_suffixes(selected, list(given))
    if missing:
        raise InvalidInput(f"module_strengths: suffix(es) match no edited layer: {', '.join(missing)}")


def _resolve(ctx: Context, model: ModelRecord, terms: Mapping[str, float], options: EditOptions) -> EditUniverse:
    return resolve_members(
        ctx,
        model,
        list(terms),
        reference=options.reference,
        universe_id=options.universe,
        rcond=options.rcond,
    )


def _check_modules(layout: ModelLayout, modules: list[str] | None) -> None:
    """Every module suffix matches some layer of the model (the selection itself: :func:`_check_plan`)."""
    if modules:
        missing = unmatched_suffixes(layout.layers, modules)
        if missing:
            raise InvalidInput(f"module suffix(es) match no layer: {', '.join(missing)}")


def _check_lora_rank(options: EditOptions) -> None:
    """``lora_rank`` shapes a peft adapter only: with another format it would be silently ignored."""
    if options.lora_rank is not None and options.format != "peft":
        raise InvalidInput(f'lora_rank applies to format "peft" only, not {options.format!r}')


# ---------------------------------------------------------------- views


def find_variant_request(ctx: Context, variant_id: str, *, recent: bool = False) -> VariantRequest | None:
    """The stored request; ``recent``: as of at most a second ago (views only, never a write's input)."""
    if not variant_id.isalnum():
        return None
    key = variant_request_key(variant_id)
    stored = ctx.reads.recent_json(key) if recent else ctx.storage.find_json(key)
    return None if stored is None else VariantRequest.stored(key, stored)


def variant_manifest(ctx: Context, variant_id: str, *, fresh: bool = False) -> VariantManifest | None:
    """The built variant's manifest (None: unknown, or not ready).

    Args:
        fresh: read storage, not this process's cache: a variant deleted by another process (a
            DELETE on another API process, the retention rule in a job or the janitor) is gone
            for a submission at once; views read the request first, cached for a second only.
    """
    if not variant_id.isalnum():
        return None
    key = variant_manifest_key(variant_id)
    # Written once, last, and never changed while the variant exists: cached once found.
    stored = ctx.storage.find_json(key) if fresh else ctx.reads.immutable_json(key)
    if fresh:
        ctx.reads.forget(key)
    return None if stored is None else read_variant_manifest(variant_id, stored)


VARIANT_FIELDS = (  # of the stored request, in the view
    "variant_id",
    "model_id",
    "terms",
    "alpha",
    "scaling",
    "format",
    "lora_rank",
    "lora_target",
    "gguf_quantization",
    "modules",
    "layers",
    "module_strengths",
    "rcond",
    "reference",
    "universe_id",
    "job_id",
)


def variant_view(ctx: Context, variant_id: str) -> Variant:
    """The variant as the routes answer it: the contract's :class:`~api_schemas.Variant` (404 when unknown)."""
    request = find_variant_request(ctx, variant_id, recent=True)
    if request is None:
        raise NotFound(f"variant {variant_id} does not exist")
    stored = request.model_dump(mode="json")
    fields: dict[str, Any] = {k: stored.get(k) for k in VARIANT_FIELDS}  # gguf_quantization: gguf only
    job = ctx.jobs.get(request.job_id) if request.job_id else None  # before the manifest: see concept_model_state
    provenance = find_provenance(ctx, variant_id, recent=True)
    if provenance is not None:
        fields |= provenance.model_dump(include={"created_at", "created_by", "labels", "reason", "reverts"})
    manifest = variant_manifest(ctx, variant_id)
    if manifest is not None:
        ready = {"status": "ready", "files": manifest.file_views, "lora": manifest.lora}
        return Variant.model_validate(fields | ready | {"unreached_layers": list(manifest.unreached_layers)})
    building = job is not None and job.status not in FINISHED
    return Variant.model_validate(fields | {"files": [], "status": "building" if building else "failed"})


def variant_submission(
    ctx: Context, model_id: str, terms: dict[str, float], alpha: float | None, options: EditOptions
) -> VariantSubmission:
    """:func:`submit_variant` as the routes answer it: the variant, and its build job when one runs."""
    variant, job, notes = submit_noted(ctx, model_id, terms, alpha, options)
    return VariantSubmission(variant=variant, job=job_answer(job) if job else None, warnings=notes)


def variant_ids(ctx: Context, model_id: str | None = None) -> list[str]:
    """Every variant's ID, sorted (404 when ``model_id`` names no registered model; its variants are
    told apart by :func:`variant_of`)."""
    if model_id is not None:
        get_model(ctx, model_id)
    return sorted({k.split("/")[1] for k in ctx.reads.recent_listing(VARIANTS) if k.endswith("/request.json")})


def variant_of(ctx: Context, variant_id: str, model_id: str | None, narrowed: VariantFilter | None = None) -> Variant | None:
    """The variant when it exists, is ``model_id``'s (any model's: None) and ``narrowed`` admits it,
    else None (and when its records cannot be read: left out of a listing with a warning naming it;
    reading it by ID refuses it)."""
    try:
        variant = skip_unreadable(variant_request_key(variant_id), lambda: variant_view(ctx, variant_id))
    except NotFound:  # gone since it was listed
        return None
    if variant is None or (model_id is not None and variant.model_id != model_id):
        return None
    return variant if narrowed is None or narrowed.admits(variant) else None


def list_variants(ctx: Context, model_id: str | None = None) -> list[Variant]:
    """Every variant, or those of one model (404 when that model is not registered)."""
    found = (variant_of(ctx, v, model_id) for v in variant_ids(ctx, model_id))
    return [v for v in found if v is not None]
