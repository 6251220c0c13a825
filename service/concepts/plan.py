"""A collection resolved once: planned at submission, read back by its job, never decided again.

:func:`plan_collection` turns a concept posted for a model into its collect job's settings
(:class:`~service.statistics.spec.CollectionSpec`) and plan (:class:`~service.jobs.collect_plan.CollectionPlan`:
the statistics key's settings digest, the collected layers, a reference's first row), both stored in
the job's payload. The job reads them with :func:`read_collection`, the one place where a payload
queued without a plan is planned (then from the concept and the model as they are when it runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.concepts.record import ConceptRecord, read_concept
from service.config import Settings
from service.context import Context
from service.engine.layers import LayerSpec, select_layers
from service.engine.layout import ModelLayout
from service.errors import JobFailed
from service.jobs.collect_plan import CollectionPlan
from service.jobs.records import CollectPayload
from service.models.registry import get_model
from service.statistics.key import StatsKey
from service.statistics.spec import CollectionSpec
from service.storage.keys import concept_key
from service.storage.stored_json import find_record


def plan_collection(
    settings: Settings, layout: ModelLayout, concept: ConceptRecord, modules: Sequence[str] | None
) -> tuple[CollectionSpec, CollectionPlan]:
    """The settings and plan of ``concept``'s collection on a model of ``layout``.

    Args:
        modules: canonical module suffixes (only their layers are collected); ``None``: every layer.
    """
    selected = select_layers(layout.layers, modules)
    spec = CollectionSpec.of(settings, modules, concept.template, layout, selected=selected)
    plan = CollectionPlan(
        settings_digest=spec.digest(),
        layers=None if modules is None else tuple(s.name for s in selected),
        first_row=concept.dataset.start if concept.dataset is not None else None,
        samples=concept.samples if concept.dataset_digest is None else None,  # drawn by the job first
    )
    return spec, plan


@dataclass(frozen=True)
class Collection:
    """A collect job's payload as its body runs it: the settings read once, the plan, the key.

    Attributes:
        payload: the job's payload (``dataset_digest`` set once a reference is resolved).
        spec: its settings as the statistics floor reads them.
        plan: what the submission resolved.
    """

    payload: CollectPayload
    spec: CollectionSpec
    plan: CollectionPlan

    @property
    def key(self) -> StatsKey:
        """The statistics' key (the dataset resolved: a reference's job resolves it first)."""
        if self.payload.dataset_digest is None:
            raise ValueError("a collection's statistics key needs its dataset resolved first")
        return StatsKey(self.payload.model_digest, self.payload.dataset_digest, self.plan.settings_digest)

    def resolved(self, dataset_digest: str) -> Collection:
        """This collection over the dataset a reference resolved to."""
        payload = self.payload.model_copy(update={"dataset_digest": dataset_digest})
        return Collection(payload, self.spec, self.plan)

    def layers(self, layout: ModelLayout) -> list[LayerSpec]:
        """The planned layers of the model's layout (its digest checked unchanged: the same layout).

        Raises:
            JobFailed: a planned layer the layout lacks (the model's record was rewritten).
        """
        if self.plan.layers is None:
            return list(layout.layers)
        by_name = {spec.name: spec for spec in layout.layers}
        missing = [name for name in self.plan.layers if name not in by_name]
        if missing:
            raise JobFailed(
                f"model {self.payload.model_id} has no layer {missing[0]} its collection was planned with; "
                "post the concept again"
            )
        return [by_name[name] for name in self.plan.layers]


def read_collection(ctx: Context, payload: CollectPayload) -> Collection:
    """The collection a job's payload plans: its stored plan, or, for a payload queued before plans
    were stored, the plan its submission would have made (the one upgrade of such a payload)."""
    spec = CollectionSpec.of_job(payload.settings)
    plan = payload.plan if payload.plan is not None else _unplanned(ctx, payload, spec)
    return Collection(payload, spec, plan)


def _unplanned(ctx: Context, payload: CollectPayload, spec: CollectionSpec) -> CollectionPlan:
    """The plan of a payload stored without one: its layers selected on the registered model (whose
    digest the job checks against the payload's), a reference's first row from the concept."""
    layers = None
    if spec.module_list is not None:
        layout = get_model(ctx, payload.model_id).layout
        layers = tuple(s.name for s in select_layers(layout.layers, spec.module_list))
    reference = payload.dataset
    if reference is None:
        data = find_record(ctx.storage, concept_key(payload.concept))
        concept = read_concept(concept_key(payload.concept), data) if data is not None else None
        reference = concept.dataset if concept is not None else None
    first_row = reference.start if reference is not None else None
    return CollectionPlan(settings_digest=spec.digest(), layers=layers, first_row=first_row)
