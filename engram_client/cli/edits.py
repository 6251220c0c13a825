"""``engram unlearn`` and ``engram compose``: build an edited variant, watch it, download it.

Both submit a variant of a model and take the same edit options (scaling, modules, layers, rcond,
reference, format, module strengths, LoRA target, universe), so they share :func:`_edit_options`
and :func:`_build_and_fetch`; they differ only in how the concepts are weighted: ``unlearn``
removes them with one strength α, ``compose`` takes a signed coefficient per concept.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from api_schemas import VariantSubmission
from engram_client.cli.options import (
    AdapterBaseModelOpt,
    CallbackOpt,
    Force,
    Format,
    FormatOpt,
    JsonFlag,
    LayerOpt,
    LoraRankOpt,
    LoraTarget,
    LoraTargetOpt,
    ModuleOpt,
    NoWait,
    OutDir,
    RcondOpt,
    ReferenceOpt,
    Scaling,
    ScalingOpt,
    StrengthOpt,
    UniverseOpt,
)
from engram_client.cli.output import emit, job_failed, stderr, stdout
from engram_client.cli.progress import download, watch
from engram_client.cli.render import render_variant
from engram_client.cli.root import session
from engram_client.client import EngramClient


def _edit_options(
    scaling: Scaling | None,
    module: list[str] | None,
    layer: list[int] | None,
    rcond: float | None,
    reference: list[str] | None,
    fmt: Format | None,
    lora_rank: int | None,
    callback_url: str | None,
    strength: list[str] | None = None,
    lora_target: LoraTarget | None = None,
    universe: str | None = None,
    adapter_base_model: str | None = None,
) -> dict[str, Any]:
    """The client's keyword arguments, named as :class:`api_schemas.EditOptions` names them (every one of
    its fields has a flag: tests/client/test_options.py); an option not given stays None and is not sent."""
    return {
        "scaling": scaling.value if scaling else None,
        "modules": module or None,  # typer gives [] for a repeatable option that was not used
        "layers": layer or None,
        "module_strengths": _parse_pairs(strength, "--strength", "SUFFIX=S (e.g. q_proj=1.5)") or None,
        "rcond": rcond,
        "reference": reference or None,
        "universe": universe,
        "format": fmt.value if fmt else None,
        "lora_rank": lora_rank,
        "lora_target": lora_target.value if lora_target else None,
        "adapter_base_model": adapter_base_model,
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
        # The variant, as without --no-wait (`jq -r .variant_id` reads both); its job_id is the build.
        emit(ctx, as_json, variant, lambda: stdout.print(variant.variant_id))
        return
    if variant.status == "ready":
        stderr.print(f"variant {variant.variant_id} exists already")
    else:
        job_id = submission.job.job_id if submission.job else variant.job_id
        stderr.print(f"building variant {variant.variant_id}")
        if job_id:
            job = watch(client, [job_id])[0]
            if job.status != "succeeded":
                job_failed(job)
        variant = client.wait_for_variant(variant.variant_id)
    if out is not None:
        download(client, variant, out, force)
    emit(ctx, as_json, variant, lambda: render_variant(variant))


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
    lora_target: LoraTargetOpt = None,
    strength: StrengthOpt = None,
    universe: UniverseOpt = None,
    adapter_base_model: AdapterBaseModelOpt = None,
    callback_url: CallbackOpt = None,
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Remove concepts from a model; watch the build and download the variant with --out."""
    options = _edit_options(
        scaling,
        module,
        layer,
        rcond,
        reference,
        fmt,
        lora_rank,
        callback_url,
        strength,
        lora_target,
        universe,
        adapter_base_model,
    )
    with session(ctx) as client:
        submission = client.unlearn(model, concept, alpha, **options)
        _build_and_fetch(ctx, client, submission, out, force, no_wait, as_json)


def _parse_terms(terms: Sequence[str]) -> dict[str, float]:
    """``NAME=COEFFICIENT`` pairs (``--term``)."""
    return _parse_pairs(terms, "--term", "NAME=COEFFICIENT (e.g. forget=-0.5)")


def _parse_pairs(pairs: Sequence[str] | None, flag: str, form: str) -> dict[str, float]:
    """``NAME=NUMBER`` pairs; a name given twice is a usage error rather than a silent overwrite."""
    parsed: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.rpartition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or not name or number is None:
            raise typer.BadParameter(f"{pair!r} is not {form}", param_hint=flag)
        if name in parsed:
            raise typer.BadParameter(f"{name!r} appears twice", param_hint=flag)
        parsed[name] = number
    return parsed


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
    lora_target: LoraTargetOpt = None,
    strength: StrengthOpt = None,
    universe: UniverseOpt = None,
    adapter_base_model: AdapterBaseModelOpt = None,
    callback_url: CallbackOpt = None,
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Engram arithmetic W + Σ c_k f_l W_k⁺; watch the build and download the variant with --out."""
    terms = _parse_terms(term)
    options = _edit_options(
        scaling,
        module,
        layer,
        rcond,
        reference,
        fmt,
        lora_rank,
        callback_url,
        strength,
        lora_target,
        universe,
        adapter_base_model,
    )
    with session(ctx) as client:
        submission = client.compose(model, terms, **options)
        _build_and_fetch(ctx, client, submission, out, force, no_wait, as_json)
