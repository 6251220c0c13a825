"""A variant's edit options, typed once: what shapes its weights, its identity, its stored request.

:class:`VariantSpec` is built from the request's :class:`~api_schemas.EditOptions` (where the
options are named on the wire) with the normalisations that keep variant IDs stable.
:class:`VariantRequest` is the stored request (``variants/<id>/request.json``): what the variant job
reads, written and read here only. :func:`variant_identity` is the one place a variant's ID is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from api_schemas import EditOptions
from service.engine.errors import EditError
from service.engine.lora_rules import EXACT_RTOL, LoraTarget
from service.models.record import ModelRecord
from service.models.stored import FORMAT_VERSION, check_format
from service.storage.keys import ENGINE_VERSION, canonical_digest
from service.universes.members import EditUniverse

Strengths = tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class VariantSpec:
    """The edit options that shape a variant's weights, besides its terms and universe.

    Attributes:
        scaling: ``uniform`` or ``weight_norm`` (W-Norm's per-layer ``f_l``).
        format: ``checkpoint``, ``delta``, ``peft`` or ``gguf``.
        modules: module-name suffixes in the request's order (None: every editable layer).
        layers: block indices in the request's order (None: every block).
        module_strengths: ``(suffix, s)`` per module type, sorted, without factors of 1 (empty: all
            1), so that a request giving only ones names the same variant as one without them.
        lora_rank: ``peft``: the largest rank (``vllm``: the one rank); None: exact, or the smallest.
        lora_target: ``peft``: what loads the adapter; None for the other formats (and for peft
            adapters stored before the option, which are ``peft``).
        adapter_base_model: ``peft``: the base the adapter names (None: the model's default).
        gguf_quantization: ``gguf``: the GGUF type its matrices are written in, resolved at submit
            (the request's, else the model's default); None for the other formats.
    """

    scaling: str = "uniform"
    format: str = "checkpoint"
    modules: tuple[str, ...] | None = None
    layers: tuple[int, ...] | None = None
    module_strengths: Strengths = ()
    lora_rank: int | None = None
    lora_target: str | None = None
    adapter_base_model: str | None = None
    gguf_quantization: str | None = None

    @classmethod
    def from_options(cls, options: EditOptions, default_gguf: str | None = None) -> VariantSpec:
        """The spec of a validated request (its layout checks are the caller's).

        Args:
            default_gguf: format ``gguf``: the quantization when the request names none (the
                model's: :func:`service.engine.gguf_write.default_gguf_quantization`).
        """
        given = options.module_strengths or {}
        return cls(
            scaling=options.scaling,
            format=options.format,
            modules=_tuple(options.modules),
            layers=_tuple(options.layers),
            module_strengths=tuple((s, float(v)) for s, v in sorted(given.items()) if float(v) != 1.0),
            lora_rank=options.lora_rank,
            lora_target=options.lora_target if options.format == "peft" else None,
            adapter_base_model=options.adapter_base_model if options.format == "peft" else None,
            gguf_quantization=(options.gguf_quantization or default_gguf) if options.format == "gguf" else None,
        )

    @property
    def strengths(self) -> dict[str, float] | None:
        """``module_strengths`` as the request and the view spell it: None when all are 1."""
        return dict(self.module_strengths) or None

    @property
    def adapter_target(self) -> LoraTarget:
        """The adapter layout a peft variant is written for (``peft`` when not given).

        Raises:
            EditError: a stored value that is neither ``peft`` nor ``vllm``.
        """
        target = self.lora_target or "peft"
        if target not in ("peft", "vllm"):
            raise EditError(f"unknown lora_target {target!r}: peft or vllm")
        return "vllm" if target == "vllm" else "peft"

    def identity(self) -> dict[str, Any]:
        """The options' part of the variant's identity. Options added later join it only when they
        differ from what variants made before them had, so that those keep their IDs."""
        identity: dict[str, Any] = {
            "scaling": self.scaling,
            "modules": _list(self.modules),
            "layers": _list(self.layers),
            "format": self.format,
        }
        if self.module_strengths:
            identity["module_strengths"] = dict(self.module_strengths)
        if self.format == "peft":  # only adapters depend on these
            lora: dict[str, Any] = {"rank": self.lora_rank, "rtol": EXACT_RTOL}
            if self.adapter_target != "peft":
                lora["target"] = self.adapter_target
            if self.adapter_base_model is not None:  # written into adapter_config.json
                lora["base_model"] = self.adapter_base_model
            identity["lora"] = lora
        if self.format == "gguf":  # a format added later: the other formats' identities are as before
            identity["gguf"] = {"quantization": self.gguf_quantization}
        return identity


def variant_identity(
    model_digest: str,
    terms: Mapping[str, float],
    term_stats: Mapping[str, str],
    universe_id: str,
    rcond: float | None,
    spec: VariantSpec,
) -> dict[str, Any]:
    """Everything that determines a variant's weights; its ID is the digest of this.

    Args:
        terms: concept name -> coefficient; ``term_stats``: each name's statistics prefix (names
            are labels: the identity holds the prefixes).
        rcond: the universe's cut.
    """
    return {
        "engine": ENGINE_VERSION,
        "model_digest": model_digest,
        "terms": sorted((term_stats[name], float(c)) for name, c in terms.items()),
        "universe_id": universe_id,
        "rcond": rcond,
        **spec.identity(),
    }


def variant_id_of(identity: Mapping[str, Any]) -> str:
    return canonical_digest(identity)[:32]


class VariantRequest(BaseModel):
    """The stored request of a variant (``variants/<id>/request.json``): what its job reads.

    Stored flat, in the keys (and their order) requests have always been stored with, plus
    ``format_version``; :attr:`spec` gives the options typed.

    Attributes:
        terms: concept name -> coefficient, in the request's order.
        reference: the names shown as the variant's reference.
        module_strengths: sorted, without factors of 1; None when all are 1.
        rcond: the universe's cut.
        term_stats: each term's statistics prefix.
        universe_id: the universe whose engrams the job sums (a request stored before universes
            were gets its universe from ``engram-service migrate``).
        universe_stats: the universe's statistics prefixes.
        job_id: the job that builds the variant (None until it is created).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int = FORMAT_VERSION
    variant_id: str
    model_id: str
    terms: dict[str, float]
    alpha: float | None
    reference: tuple[str, ...]
    scaling: str
    modules: tuple[str, ...] | None
    layers: tuple[int, ...] | None
    format: str
    rcond: float | None
    lora_rank: int | None
    lora_target: str | None
    module_strengths: dict[str, float] | None
    term_stats: dict[str, str]
    universe_id: str
    universe_stats: tuple[str, ...]
    job_id: str | None = None
    # absent from requests stored without it, so that they are stored as before
    adapter_base_model: str | None = Field(default=None, exclude_if=lambda v: v is None)
    gguf_quantization: str | None = Field(default=None, exclude_if=lambda v: v is None)

    @classmethod
    def new(
        cls,
        model: ModelRecord,
        terms: Mapping[str, float],
        alpha: float | None,
        spec: VariantSpec,
        resolved: EditUniverse,
    ) -> VariantRequest:
        """The request of an edit of ``model`` in the universe it resolved to, named by its identity."""
        universe = resolved.spec
        identity = variant_identity(model.digest, terms, resolved.terms, universe.universe_id, universe.rcond, spec)
        return cls(
            variant_id=variant_id_of(identity),
            model_id=model.model_id,
            terms={name: float(c) for name, c in terms.items()},
            alpha=alpha,
            reference=tuple(resolved.reference),
            scaling=spec.scaling,
            modules=spec.modules,
            layers=spec.layers,
            format=spec.format,
            rcond=universe.rcond,
            lora_rank=spec.lora_rank,
            lora_target=spec.lora_target,
            module_strengths=spec.strengths,
            term_stats=dict(resolved.terms),
            universe_id=universe.universe_id,
            universe_stats=tuple(universe.prefixes),
            adapter_base_model=spec.adapter_base_model,
            gguf_quantization=spec.gguf_quantization,
        )

    @classmethod
    def stored(cls, key: str, data: Mapping[str, Any]) -> VariantRequest:
        """A stored request (refused by name when it is of an older format: ``engram-service migrate``)."""
        return cls.model_validate(check_format("variant request", key, data))

    @property
    def spec(self) -> VariantSpec:
        return VariantSpec(
            scaling=self.scaling,
            format=self.format,
            modules=self.modules,
            layers=self.layers,
            module_strengths=tuple((s, float(v)) for s, v in (self.module_strengths or {}).items()),
            lora_rank=self.lora_rank,
            lora_target=self.lora_target,
            adapter_base_model=self.adapter_base_model,
            gguf_quantization=self.gguf_quantization,
        )

    def with_job(self, job_id: str) -> VariantRequest:
        return self.model_copy(update={"job_id": job_id})


def _tuple(values: Any) -> tuple[Any, ...] | None:
    return None if values is None else tuple(values)


def _list(values: tuple[Any, ...] | None) -> list[Any] | None:
    return None if values is None else list(values)
