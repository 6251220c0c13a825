"""``engram unlearn`` and ``engram compose``: build an edited variant, watch it, download it.

Both submit a variant of a model and take the same edit options (scaling, modules, layers, rcond,
reference, format, module strengths, LoRA target, universe), so they share :class:`EditFlags`
(stated once, given to both by :func:`edit_flags`) and :func:`_build_and_fetch`; they differ only
in how the concepts are weighted: ``unlearn`` removes them with one strength α, ``compose`` takes a
signed coefficient per concept.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer

from api_schemas import VariantSubmission
from engram_client.cli.options import (
    AdapterBaseModelOpt,
    CallbackOpt,
    Force,
    FormatOpt,
    GgufQuantizationOpt,
    JsonFlag,
    LayerOpt,
    LoraRankOpt,
    LoraTargetOpt,
    ModuleOpt,
    NoWait,
    OutDir,
    RcondOpt,
    ReferenceOpt,
    ScalingOpt,
    StrengthOpt,
    UniverseOpt,
)
from engram_client.cli.output import emit, job_failed, stderr, stdout
from engram_client.cli.progress import download, watch
from engram_client.cli.render import render_variant
from engram_client.cli.root import session
from engram_client.client import EngramClient


@dataclass(frozen=True)
class EditFlags:
    """The edit flags ``unlearn`` and ``compose`` share, stated once: one attribute per
    :class:`api_schemas.EditOptions` field (every field has a flag: tests/client/test_edit_options.py).
    :func:`edit_flags` gives a command these as its flags and hands them to it as one value, so a new
    option is one attribute here and one line in :meth:`options`.
    """

    scaling: ScalingOpt = None
    module: ModuleOpt = None
    layer: LayerOpt = None
    rcond: RcondOpt = None
    reference: ReferenceOpt = None
    fmt: FormatOpt = None
    lora_rank: LoraRankOpt = None
    lora_target: LoraTargetOpt = None
    strength: StrengthOpt = None
    universe: UniverseOpt = None
    adapter_base_model: AdapterBaseModelOpt = None
    gguf_quantization: GgufQuantizationOpt = None
    callback_url: CallbackOpt = None

    def options(self) -> dict[str, Any]:
        """The client's keyword arguments, named as :class:`api_schemas.EditOptions` names them; an
        option not given stays None and is not sent."""
        return {
            "scaling": self.scaling.value if self.scaling else None,
            "modules": self.module or None,  # typer gives [] for a repeatable option that was not used
            "layers": self.layer or None,
            "module_strengths": _parse_pairs(self.strength, "--strength", "SUFFIX=S (e.g. q_proj=1.5)") or None,
            "rcond": self.rcond,
            "reference": self.reference or None,
            "universe": self.universe,
            "format": self.fmt.value if self.fmt else None,
            "lora_rank": self.lora_rank,
            "lora_target": self.lora_target.value if self.lora_target else None,
            "adapter_base_model": self.adapter_base_model,
            "gguf_quantization": self.gguf_quantization.value if self.gguf_quantization else None,
            "callback_url": self.callback_url,
        }


_EDIT = "edit"  # the parameter of a command that receives its EditFlags


def edit_flags(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` with the :class:`EditFlags` attributes as its flags, in place of its ``edit``
    parameter (typer reads a command's flags from its signature, one parameter each)."""
    signature = inspect.signature(command, eval_str=True)
    hints = get_type_hints(EditFlags, include_extras=True)  # the Annotated flags, not their strings
    flags = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in fields(EditFlags)
    ]
    parameters = list(signature.parameters.values())
    at = [p.name for p in parameters].index(_EDIT)
    kinds = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in parameters[at + 1 :]]
    names = [f.name for f in fields(EditFlags)]

    @functools.wraps(command)
    def with_flags(*args: Any, **kwargs: Any) -> None:
        edit = EditFlags(**{name: kwargs.pop(name) for name in names if name in kwargs})
        command(*args, **{_EDIT: edit}, **kwargs)

    new = signature.replace(parameters=[*parameters[:at], *flags, *kinds])
    with_flags.__signature__ = new  # type: ignore[attr-defined]  # what inspect.signature, and so typer, reads
    with_flags.__annotations__ = {p.name: p.annotation for p in new.parameters.values()}
    return with_flags


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
    for warning in submission.warnings:  # on stderr, loud: stdout stays the variant (or its JSON)
        stderr.print(f"warning: {warning}", soft_wrap=True)  # its consoles print without markup
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


@edit_flags
def unlearn(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="The model to edit.")],
    concept: Annotated[list[str], typer.Option("--concept", "-c", help="Concept to remove (repeat for several).")],
    alpha: Annotated[
        float | None,
        typer.Option(
            help=(
                "Strength α in W − α Σ_k f_l W_k⁺. Omitted: the model's last calibration of these concepts, "
                "else a conservative 0.25 (a warning says which)."
            )
        ),
    ] = None,
    out: OutDir = None,
    force: Force = False,
    edit: EditFlags = EditFlags(),  # noqa: B008  # replaced by its flags (edit_flags)
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Remove concepts from a model; watch the build and download the variant with --out."""
    options = edit.options()
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


@edit_flags
def compose(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="The model to edit.")],
    term: Annotated[list[str], typer.Option("--term", "-t", help="NAME=COEFFICIENT (repeat); negative removes.")],
    out: OutDir = None,
    force: Force = False,
    edit: EditFlags = EditFlags(),  # noqa: B008  # replaced by its flags (edit_flags)
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Engram arithmetic W + Σ c_k f_l W_k⁺; watch the build and download the variant with --out."""
    terms = _parse_terms(term)
    options = edit.options()
    with session(ctx) as client:
        submission = client.compose(model, terms, **options)
        _build_and_fetch(ctx, client, submission, out, force, no_wait, as_json)
