"""What changes a concept's statistics, as one frozen record: the collection job's configuration and,
by its digest, the statistics' identity (:class:`service.statistics.key.StatsKey`).

The collect job's configuration is :class:`service.jobs.records.CollectionSettings` (on the jobs'
floor, below this one); a :class:`CollectionSpec` is that record with what statistics make of it.
Its stored form (a collect job's ``payload.settings``, a statistics manifest's ``settings``) is
:meth:`CollectionSpec.dump`: the fields that are set, nothing else. An optional field enters the
digest only when it is not its default, so adding a field changes no published key (the digests of
published keys are pinned in ``tests/statistics/test_collection_spec.py``). A collect job's plan
(:class:`service.jobs.collect_plan.CollectionPlan`) holds the digest, computed once at submission.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.config import Settings
from service.engine.layers import LayerSpec, select_layers
from service.engine.layout import ModelLayout
from service.jobs.records import CollectionSettings
from service.statistics.key import StatsKey
from service.storage.keys import ENGINE_VERSION, canonical_digest

DEFAULT_STATS_DTYPE = "float64"


class CollectionSpec(CollectionSettings):
    """Everything that changes a statistic (and so is part of its key): the collect job's
    configuration (:class:`service.jobs.records.CollectionSettings`, its fields and stored form), as
    the statistics floor reads it: the spec of a collection, its key, its sums' dtype.

    ``None`` means "not part of the key": the default (every module, no template, float64 sums,
    the model's stored dtype), spelled by absence so that a new field leaves every published key as it is.
    """

    @classmethod
    def of_job(cls, settings: CollectionSettings) -> CollectionSpec:
        """The spec of a collect job's settings (a payload read back holds the base record)."""
        return settings if isinstance(settings, cls) else cls.model_validate(settings, from_attributes=True)

    @classmethod
    def of(
        cls,
        settings: Settings,
        modules: Sequence[str] | None = None,
        template: str | None = None,
        layout: ModelLayout | None = None,
        selected: Sequence[LayerSpec] | None = None,
    ) -> CollectionSpec:
        """The spec of a collection under ``settings``.

        Args:
            modules: the module suffixes a concept was posted with (only their input groups are
                collected); part of the key only when given, so keys without them stay as they were.
            template: ``"chat"``: prompt/completion records rendered as one-turn chats; part of the
                key only when set.
            layout: the model's layout. The collected layers enter the key when they include a layer
                stored under a renamed key (``renamed_layers``): versions before those were edited
                collected the same model without it, and a key shared with such statistics would reuse
                them, short of that layer. Other keys stay as they were.
            selected: the layers of ``layout`` that ``modules`` select, where the caller selected
                them already (its plan names them); selected here otherwise.
        """
        layers = None
        if layout is not None and layout.renamed_layers:
            chosen = select_layers(layout.layers, modules) if selected is None else selected
            collected = [spec.name for spec in chosen]
            if set(collected) & set(layout.renamed_layers):
                layers = canonical_digest(collected)
        return cls(
            max_length=settings.max_length,
            engine=ENGINE_VERSION,
            modules=tuple(canonical_modules(modules)) if modules is not None else None,
            layers=layers,
            template=template,
            stats_dtype=settings.stats_dtype if settings.stats_dtype != DEFAULT_STATS_DTYPE else None,
            collect_dtype=settings.collect_dtype if settings.collect_dtype != "stored" else None,  # Σ depends on it
        )

    def digest(self) -> str:
        """The settings digest of the statistics' key: byte for byte what it was as a dict."""
        return canonical_digest(self.dump())

    def key(self, model_digest: str, dataset_digest: str) -> StatsKey:
        return StatsKey(model_digest, dataset_digest, self.digest())

    @property
    def sums_dtype(self) -> str:
        """The dtype the statistics' sums are stored in (a ``torch`` attribute name)."""
        return self.stats_dtype or DEFAULT_STATS_DTYPE

    @property
    def module_list(self) -> list[str] | None:
        """The module selection as :func:`service.engine.layers.select_layers` takes it."""
        return list(self.modules) if self.modules is not None else None


def canonical_modules(modules: Sequence[str]) -> list[str]:
    """A module selection in the form that enters a statistics key: sorted, each suffix once."""
    return sorted(set(modules))
