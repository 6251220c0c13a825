"""The variant job body: ``W + f_l · Σ_k c_k · E_k,l`` from a universe's stored engrams.

The variant's universe is built first when it is not yet (on first need, in this job, by the same
functions a ``universe`` job runs); then each layer is one read of ``W`` and of each term's engram,
summed in float64 and written through the streaming checkpoint, delta or PEFT writers. W-Norm's
``ρ_l`` comes from the norms recorded with the engrams (one term) or from the summed engram's norm.
No statistics are read, nothing is decomposed, and no ``O·D²`` product runs once the universe exists.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from api_schemas.jobs import TrackingRun
from service.context import Context
from service.engine.checkpoint import CheckpointReader
from service.engine.checkpoint_write import WrittenFiles, write_checkpoint, write_delta
from service.engine.compose import LayerEdit, layer_deltas, normalized_scales
from service.engine.errors import EditError
from service.engine.expert_names import check_adapter_layers
from service.engine.gguf_rules import GgufWriteError, check_gguf_writable
from service.engine.layers import LayerSpec, with_module_strengths
from service.engine.layout import ModelLayout
from service.engine.lora import layer_loras
from service.engine.lora_files import AdapterBase, AdapterReport, adapter_base, write_adapter
from service.engine.model_files import ModelSourceError
from service.engine.threads import arithmetic_threads, torch_threads
from service.engrams.manifest import UniverseManifest
from service.engrams.store import (
    StoredEngrams,
    relative_norms,
    stored_editor,
    stored_engrams,
)
from service.errors import JobFailed
from service.jobs.progress import CancelOnly, NoProgress, Progress, ProgressReporter, StepTimes
from service.jobs.records import JobRecord, VariantPayload
from service.jobs.results import VariantResult
from service.models.loaded import checked_model_files
from service.models.registry import get_model
from service.storage.base import scratch_dir
from service.storage.keys import variant_manifest_key, variant_plan_key, variant_request_key
from service.universes.build import ensure_universe
from service.universes.retention import note_use
from service.variants.manifest import VariantManifest
from service.variants.plan import VariantPlan
from service.variants.publish import UploadedWhileWritten, discard_variant_files, publish_variant_files
from service.variants.retention import expire_variants
from service.variants.tracking import track_variant

log = logging.getLogger("engram.variants")


def run_variant(ctx: Context, job: JobRecord) -> VariantResult:
    """Build a variant by arithmetic on its universe's engrams: no forward pass, no decomposition.

    The result's ``steps`` are the seconds of each part (``bench.e2e`` splits what a user waits
    for with them): ``request`` (the stored plan), ``model`` (the registration, checked against the
    plan's digest), ``universe`` (its manifest and engram index;
    building it when missing), ``model_files`` (the checkpoint's files opened and checked against
    the identity recorded at registration), ``scales``, ``write`` (each layer: ``W`` and the terms'
    engrams read, summed, written, each file hashed as it is written), ``upload`` (the files moved
    into the store: renamed on ``file://``, uploaded on S3) and ``manifest``.
    """
    timer = StepTimes()
    with timer.step("request"):
        variant_id = job.payload_of(VariantPayload).variant_id
        if ctx.storage.exists(variant_manifest_key(variant_id)):
            return _tracked(VariantResult(variant_id=variant_id, reused=True), track_variant(ctx, variant_id))
        plan = find_variant_plan(ctx, variant_id)
    progress = ProgressReporter(ctx, job.job_id, 0)
    started = time.monotonic()
    # Written where the store can take each file by a rename (file://), hashed while written: one pass.
    # On S3 each safetensors file is uploaded while it is written (publishing it completes the upload).
    with ctx.storage.staging_dir("variant") as tmp:
        written = UploadedWhileWritten(ctx.storage, variant_id)
        try:
            built = build_variant_files(ctx, plan, Path(tmp), progress, job_id=job.job_id, timer=timer, written=written)
        except BaseException:
            written.abort()
            raise
        with timer.step("upload"):
            files = publish_variant_files(ctx, variant_id, Path(tmp), written)
    seconds = round(time.monotonic() - started, 3)
    published = VariantManifest(
        variant_id=variant_id,
        files=files,
        scales=built.scales,
        seconds=seconds,
        universe_id=plan.universe_id,
        unreached_layers=tuple(built.unreached_layers),
        # per-layer ranks and errors of a peft adapter, shown on the variant
        lora=built.lora.model_dump(mode="json") if built.lora is not None else None,
    )
    with timer.step("manifest"):
        try:
            ctx.storage.put_json(variant_manifest_key(variant_id), published.to_json())  # last: the variant now exists
        except BaseException:
            discard_variant_files(ctx, variant_id)  # no manifest: nothing may stay under the variant's key
            raise
        note_use(ctx, plan.universe_id)  # a job that queued long must not leave its universe evictable
    _apply_retention(ctx, variant_id)
    result = VariantResult(
        variant_id=variant_id,
        reused=False,
        layers=len(built.scales),
        seconds=seconds,
        universe_built_s=built.universe_built_s,
        steps=timer.seconds,
    )
    # Once the variant exists: a tracker that fails costs a warning in the result, never the variant.
    return _tracked(result, track_variant(ctx, variant_id, {"build_seconds": seconds, "layers": float(len(built.scales))}))


def _tracked(result: VariantResult, tracked: TrackingRun | None) -> VariantResult:
    return result if tracked is None else result.model_copy(update={"tracking": tracked})


def find_variant_plan(ctx: Context, variant_id: str) -> VariantPlan:
    """The plan the variant's submit stored, as its job runs it.

    Raises:
        JobFailed: no plan beside a stored request (stored by a service before plans: ``engram-service
            migrate`` writes it), or no request at all.
        UnmigratedRecord: a plan of another format.
    """
    key = variant_plan_key(variant_id)
    stored = ctx.storage.find_json(key)
    if stored is not None:
        return VariantPlan.stored(key, stored)
    if ctx.storage.exists(variant_request_key(variant_id)):
        raise JobFailed(
            f"variant {variant_id} was requested before variants were planned at submit ({key} is missing): "
            "run `engram-service migrate` once, or submit the request again"
        )
    raise JobFailed(f"variant {variant_id} has no stored request: submit it again")


@dataclass(frozen=True)
class BuiltVariant:
    """What :func:`build_variant_files` wrote: per-layer scales, a peft report, the seconds spent
    building the universe first (None when it existed), and the selected layers left as they were
    because no concept of the universe reached them."""

    scales: dict[str, float]
    lora: AdapterReport | None
    universe_built_s: float | None
    unreached_layers: list[str] = field(default_factory=list)


def build_variant_files(
    ctx: Context,
    plan: VariantPlan,
    out: Path,
    progress: Progress | None = None,
    *,
    job_id: str | None = None,
    timer: StepTimes | None = None,
    written: WrittenFiles | None = None,
) -> BuiltVariant:
    """Write a variant's files into ``out`` (an empty directory), building its universe first if needed.

    Args:
        plan: the variant's stored plan (``variant-plans/<id>.json``): its layers, terms and universe
            as submit resolved them.
        progress: told of each layer written (a :class:`ProgressReporter` is given the layer count; the
            universe build before it only checks for cancellation).
        job_id: the variant job; given, a universe built first asks idle workers to help with it.
        timer: told the seconds of each step (see :func:`run_variant`).
        written: given, told the size and sha256 of each file as it is written (a peft adapter's
            files are not: their writer does not hash).

    Raises:
        JobFailed: the edit cannot be computed (a layer without statistics, a non-finite result), or
            the model was registered again with other weights since the plan was made.
    """
    timer = timer or StepTimes()
    with timer.step("model"):
        model = get_model(ctx, plan.model_id)
        plan.check_model(model)
        layout = model.layout
        spec = plan.spec
        # Layers no member's forward pass ran have zero engrams: written as they are (plan.unreached).
        layers = plan.layers(layout, plan.edited)
    steps = progress or NoProgress()
    try:
        if spec.format == "peft":
            check_adapter_layers(layers)  # before the universe is built
        if spec.format == "gguf":  # refused at submit; checked again for a request stored before a change
            check_gguf_writable({"architectures": [model.architecture]}, spec.gguf_quantization or "")
        with timer.step("universe"):
            source, universe, built_s = _engram_source(ctx, plan, steps, job_id, [s.name for s in layers])
        with timer.step("model_files"):
            reader = CheckpointReader(checked_model_files(ctx, model), layout)
        if isinstance(steps, ProgressReporter):
            steps.restart(len(layers))
        with timer.step("scales"):
            # W-Norm's f_l (or 1) first, then each module type's strength factor
            scales = with_module_strengths(variant_scales(layers, source, universe, spec.scaling, reader), spec.strengths)
        with timer.step("write"):
            base = adapter_base(model.model_id, model.source, spec.adapter_base_model)
            lora = write_variant(out, reader, layout, layers, source, scales, plan, steps, base, written=written)
    except (EditError, ModelSourceError, GgufWriteError) as exc:
        raise JobFailed(str(exc)) from None
    return BuiltVariant(scales, lora, built_s, list(plan.unreached))


def _engram_source(
    ctx: Context, plan: VariantPlan, progress: Progress, job_id: str | None, layers: Sequence[str] | None = None
) -> tuple[StoredEngrams, UniverseManifest, float | None]:
    """The variant's terms as stored engrams of its universe (built now if missing: the input groups
    of ``layers`` only, the rest deferred to the request that needs it)."""
    started = time.monotonic()
    cancel_only = CancelOnly(progress) if isinstance(progress, ProgressReporter) else progress
    universe, existed = ensure_universe(ctx, plan.universe_id, cancel_only, job_id=job_id, layers=layers)
    built_s = None if existed else round(time.monotonic() - started, 3)
    return stored_engrams(ctx, universe, plan.coefficients), universe, built_s


def variant_scales(
    layers: Sequence[LayerSpec],
    source: StoredEngrams,
    universe: UniverseManifest,
    scaling: str,
    reader: CheckpointReader,
) -> dict[str, float]:
    """Per-layer ``f_l``: 1 (uniform) or W-Norm's ``ρ_l / max ρ`` over the selection."""
    if scaling == "uniform":
        return {spec.name: 1.0 for spec in layers}
    if scaling != "weight_norm":
        raise EditError(f"unknown scaling {scaling!r}")
    return normalized_scales(relative_norms(layers, source, universe))


def write_variant(
    out: Path,
    reader: CheckpointReader,
    layout: ModelLayout,
    layers: Sequence[LayerSpec],
    source: StoredEngrams,
    scales: dict[str, float],
    plan: VariantPlan,
    progress: Progress,
    base: AdapterBase | None = None,
    *,
    written: WrittenFiles | None = None,
) -> AdapterReport | None:
    """Write the variant's files into ``out``; returns a peft adapter's report, else None."""
    edit_layer = stored_editor(source, reader.layer_weights, scales)
    edited = {name for name, scale in scales.items() if scale != 0.0}
    spec = plan.spec
    if spec.format == "checkpoint":
        with torch_threads(arithmetic_threads()):  # memory-bound: see service.engine.threads
            write_checkpoint(reader.files, out, layout, edit_layer, edited, on_layer=progress.advance, written=written)
        return None
    if spec.format == "gguf":
        _write_gguf_variant(out, reader, layout, edit_layer, edited, plan, progress)
        return None
    if spec.format == "peft":
        # Layer by layer: only each layer's low-rank factors outlive its float64 delta.
        rank, target = spec.lora_rank, spec.adapter_target
        loras = layer_loras(layer_deltas(layers, source, reader.layer_weights, scales), rank, lora_target=target)
        return write_adapter(
            out,
            base or plan.model_id,  # the base model peft's config names
            loras,
            max_rank=rank,
            tied=layout.tied_partners,
            on_layer=progress.advance,
            lora_target=target,
            task_type=None if layout.causal_lm is False else "CAUSAL_LM",  # an image classifier: peft's base PeftModel
        )
    metadata = {"variant_id": plan.variant_id, "terms": json.dumps(dict(plan.request.terms))}
    with torch_threads(arithmetic_threads()):
        write_delta(
            reader.files,
            out / "delta.safetensors",
            layout,
            edit_layer,
            edited,
            metadata,
            on_layer=progress.advance,
            written=written,
        )
    return None


GGUF_FILE = "model.gguf"  # a gguf variant's one file


def _write_gguf_variant(
    out: Path,
    reader: CheckpointReader,
    layout: ModelLayout,
    edit_layer: Callable[[LayerSpec], LayerEdit | None],
    edited: Collection[str],
    plan: VariantPlan,
    progress: Progress,
) -> None:
    """The edited checkpoint, written to a scratch folder of this job, then as one GGUF file in ``out``
    (hashed when published: the GGUF writer does not hash). The scratch folder goes with the function,
    whatever happens; a failure leaves ``out`` to the caller, which discards it."""
    from service.engine.gguf_write import write_gguf  # torch and gguf: jobs only

    quantization = plan.spec.gguf_quantization
    if quantization is None:
        raise EditError(f"variant {plan.variant_id} is format gguf but names no gguf_quantization")
    with scratch_dir("gguf-variant") as tmp:
        checkpoint = Path(tmp)
        with torch_threads(arithmetic_threads()):  # memory-bound: see service.engine.threads
            write_checkpoint(reader.files, checkpoint, layout, edit_layer, edited, on_layer=progress.advance)
        write_gguf(checkpoint, out / GGUF_FILE, quantization, plan.variant_id)


def _apply_retention(ctx: Context, variant_id: str) -> None:
    """ENGRAM_VARIANT_BYTES_BUDGET once the new variant's size is known (never evicting it); a
    failure is logged, not the build's: the variant is built, and the janitor applies the rule again."""
    try:
        expire_variants(ctx, keep=variant_id)
    except Exception:
        log.exception("variant %s: applying the variant retention rule failed", variant_id)
