"""A variant's plan: its request resolved once, at submit, into everything its job runs.

Submit resolves a compose/unlearn request once: its universe, its ID (hashed once, by
:meth:`VariantRequest.new`), the layers its modules/layers select, those no member's forward pass
reached, and each statistics prefix with the summed coefficient of the terms it holds. Every check
on submit reads the plan; the plan is stored (``variant-plans/<id>.json``) before the request and
before the job is dispatched, and the job runs it as stored: it selects nothing, re-keys no term and
reads no statistics header. It is stored by the variant's ID rather than in the job's payload: a
job names the variant it builds, and the plan is the variant's (a second request of a failed
variant writes its plan again, for its new job). What may change between submit and job is the model's registration: the job
refuses by name a model registered again with other weights (:meth:`VariantPlan.check_model`).

The stored request (``request.json``) stays the variant's view and identity record, the JSON
variants have always been stored with; the plan nests it. A request stored without a plan (by a
service before plans) is given one by ``engram-service migrate`` (:func:`plan_of_stored`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import ClassVar

from service.context import Context
from service.engine.layers import LayerSpec, select_layers
from service.engine.layout import ModelLayout
from service.errors import JobFailed
from service.models.record import ModelRecord
from service.statistics.cover import unreached_by_every
from service.storage.records import FORMAT_VERSION, StoredRecord
from service.universes.members import EditUniverse
from service.variants.spec import VariantRequest, VariantSpec


class PlanTerm(StoredRecord):
    """One statistics prefix of the edit and the coefficient its engram is summed with: the sum of
    the coefficients of the terms that name it (two names of one statistics are one engram)."""

    stats: str
    coefficient: float
    names: tuple[str, ...]


class VariantPlan(StoredRecord):
    """The frozen, stored plan of one variant (``variant-plans/<id>.json``).

    Attributes:
        request: the stored request, whose ``variant_id`` is the identity's digest (made once).
        model_digest: the weights the ID was hashed with; the job refuses another registration.
        selected: the layers the request's modules/layers select, in the layout's order.
        unreached: the selected layers no member of the universe reached (zero engrams): written
            as they are and named on the variant; :attr:`edited` is the rest.
        terms: what the job sums, per statistics prefix, in the order the request names them.
        universe: ``(concept name, statistics prefix)`` of every member of the universe.
    """

    record_name: ClassVar[str] = "variant plan"

    format_version: int = FORMAT_VERSION
    request: VariantRequest
    model_digest: str
    selected: tuple[str, ...]
    unreached: tuple[str, ...]
    terms: tuple[PlanTerm, ...]
    universe: tuple[tuple[str, str], ...]

    @classmethod
    def new(
        cls,
        model: ModelRecord,
        request: VariantRequest,
        universe: Sequence[tuple[str, str]],
        unreached: Collection[str],
        *,
        model_digest: str | None = None,
    ) -> VariantPlan:
        """The plan of ``request`` on ``model``: the one place a variant's layers are selected.

        Args:
            universe: ``(name, prefix)`` of the universe's members.
            unreached: the layers no member's statistics reached (:func:`unreached_by_every`).
            model_digest: the digest the ID was hashed with (None: the model's, as at submit).
        """
        spec = request.spec
        selected = [layer.name for layer in select_layers(model.layout.layers, spec.modules, spec.layers)]
        return cls(
            request=request,
            model_digest=model.digest if model_digest is None else model_digest,
            selected=tuple(selected),
            unreached=tuple(name for name in selected if name in unreached),
            terms=_summed_terms(request.terms, request.term_stats),
            universe=tuple(sorted(set(universe))),
        )

    @property
    def variant_id(self) -> str:
        return self.request.variant_id

    @property
    def model_id(self) -> str:
        return self.request.model_id

    @property
    def universe_id(self) -> str:
        return self.request.universe_id

    @property
    def spec(self) -> VariantSpec:
        return self.request.spec

    @property
    def edited(self) -> tuple[str, ...]:
        """The selected layers the edit changes: those some member reached."""
        unreached = set(self.unreached)
        return tuple(name for name in self.selected if name not in unreached)

    @property
    def coefficients(self) -> dict[str, float]:
        """Statistics prefix -> coefficient: what the job sums."""
        return {term.stats: term.coefficient for term in self.terms}

    def layers(self, layout: ModelLayout, names: Sequence[str] | None = None) -> list[LayerSpec]:
        """The layers of ``names`` (the selected ones when None) looked up in ``layout``, in order.

        Raises:
            JobFailed: a planned layer the layout no longer has (it was read again differently).
        """
        by_name = {layer.name: layer for layer in layout.layers}
        missing = [name for name in (self.selected if names is None else names) if name not in by_name]
        if missing:
            raise JobFailed(
                f"variant {self.variant_id}: planned layer {missing[0]} is not a layer of model {self.model_id} "
                "as it reads now: submit the request again"
            )
        return [by_name[name] for name in (self.selected if names is None else names)]

    def check_model(self, model: ModelRecord) -> None:
        """Refuse a job whose model was registered again with other weights since its plan was made.

        Raises:
            JobFailed: naming the model, both digests and what to do.
        """
        if model.digest != self.model_digest:
            raise JobFailed(
                f"variant {self.variant_id}: model {self.model_id} was registered again with other weights "
                f"(digest {model.digest[:12]}, planned with {self.model_digest[:12]}): the variant names the old "
                "weights; submit the request again for a variant of these"
            )

    def with_job(self, job_id: str) -> VariantPlan:
        return self.model_copy(update={"request": self.request.with_job(job_id)})


def plan_variant(
    ctx: Context,
    model: ModelRecord,
    terms: Mapping[str, float],
    alpha: float | None,
    spec: VariantSpec,
    resolved: EditUniverse,
) -> VariantPlan:
    """Resolve a request once into its plan: its ID, its layers, what no member reached."""
    request = VariantRequest.new(model, terms, alpha, spec, resolved)
    universe = [(m.name, m.stats) for m in resolved.spec.members]
    # Layers no member reached are written as they are: no bias of theirs moves.
    return VariantPlan.new(model, request, universe, unreached_by_every(ctx, resolved.spec.prefixes))


def plan_of_stored(
    ctx: Context, model: ModelRecord, request: VariantRequest, universe: Sequence[tuple[str, str]], model_digest: str
) -> VariantPlan:
    """The plan of a request stored without one (``engram-service migrate``): the one its submit
    would have made.

    Args:
        model: its model's current registration (its layout selects the layers).
        universe: ``(name, prefix)`` of the members of the request's universe.
        model_digest: the weights its universe was made of, which its ID was hashed with (the job
            refuses the request if the model was registered again with other weights since).
    """
    unreached = unreached_by_every(ctx, request.universe_stats)
    return VariantPlan.new(model, request, universe, unreached, model_digest=model_digest)


def _summed_terms(terms: Mapping[str, float], term_stats: Mapping[str, str]) -> tuple[PlanTerm, ...]:
    """Names keyed by their statistics, once: each prefix's coefficients summed, in first-named order
    (the order the job's float64 sums run in)."""
    summed: dict[str, tuple[float, tuple[str, ...]]] = {}
    for name, coefficient in terms.items():
        total, names = summed.get(term_stats[name], (0.0, ()))
        summed[term_stats[name]] = (total + float(coefficient), (*names, name))
    return tuple(PlanTerm(stats=s, coefficient=c, names=n) for s, (c, n) in summed.items())
