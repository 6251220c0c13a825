"""A concept (``concepts/<name>.json``) as a frozen record: what was posted, and one collection per model.

A :class:`~service.storage.records.StoredRecord`, read once through :func:`read_concept` (which
accepts the current ``format_version`` only: a concept stored by 0.1.0 is refused by name until
``engram-service migrate`` rewrote it, :mod:`service.concepts.migrate`); changed only through
:meth:`ConceptRecord.with_model` and :meth:`ConceptRecord.resolved`, which return a new record;
written with :meth:`ConceptRecord.to_json`, in the keys concepts always had (plus ``format_version``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from service.datasets.refs import StoredReference
from service.jobs.collect_plan import Sampling
from service.storage.records import FORMAT_VERSION, StoredRecord


class ConceptModelState(StoredRecord):
    """A concept's collection on one model.

    Attributes:
        job_id: the collection job.
        stats: the statistics prefix it publishes; None while a dataset reference is not resolved.
        modules: the module suffixes it collects (None: every editable layer).
    """

    absent_when_none: ClassVar[frozenset[str]] = frozenset({"modules"})

    job_id: str
    stats: str | None = None
    modules: tuple[str, ...] | None = None


class ConceptRecord(StoredRecord):
    """A concept: its name, role, records (by digest) or dataset reference, and its collections.

    Attributes:
        num_records, dataset_digest: None for a dataset reference no collection job has resolved yet.
        dataset: the dataset reference as posted (None: records posted inline or uploaded).
        template: ``"chat"`` when prompt/completion records are rendered with the chat template.
        samples: how its one model draws its texts, for a concept posted with ``samples`` (its
            dataset digest is None until its collection job drew them).
        models: model ID -> its collection.
        created_by, labels, reason: the key (fingerprint) whose request created it and what that
            request said about it; absent from a concept stored before they were recorded (None).
    """

    record_name: ClassVar[str] = "concept"
    # Keys a concept's document leaves out, rather than writes as null, when they have no value.
    absent_when_none: ClassVar[frozenset[str]] = frozenset(
        {"dataset", "template", "samples", "created_by", "labels", "reason"}
    )

    format_version: int = FORMAT_VERSION
    name: str
    role: str
    description: str | None
    num_records: int | None
    dataset_digest: str | None
    models: dict[str, ConceptModelState]
    created_at: str
    dataset: StoredReference | None = None
    template: str | None = None
    samples: Sampling | None = None
    created_by: str | None = None
    labels: dict[str, str] | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The stored document: the keys concepts always had (no ``dataset``/``template`` when none)."""
        data = super().to_json()
        data["models"] = {model_id: state.to_json() for model_id, state in self.models.items()}
        return data

    def with_model(self, model_id: str, state: ConceptModelState) -> ConceptRecord:
        """This concept with ``state`` as its collection on ``model_id``."""
        return self.model_copy(update={"models": {**self.models, model_id: state}})

    def resolved(self, digest: str, num_records: int) -> ConceptRecord:
        """This concept with its dataset reference resolved to ``digest``."""
        return self.model_copy(update={"dataset_digest": digest, "num_records": num_records})


def read_concept(key: str, data: Mapping[str, Any]) -> ConceptRecord:
    """A stored concept.

    Raises:
        UnmigratedRecord: it is of an older format (``engram-service migrate`` rewrites it).
        UnreadableRecord: its fields do not fit a concept (the first named).
    """
    return ConceptRecord.stored(key, data)
