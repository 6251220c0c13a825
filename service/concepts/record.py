"""A concept (``concepts/<name>.json``) as a frozen record: what was posted, and one collection per model.

Read once through :func:`read_concept` (which accepts the current ``format_version`` only: a concept
stored by 0.1.0 is refused by name until ``engram-service migrate`` rewrote it,
:mod:`service.concepts.migrate`); changed only through :meth:`ConceptRecord.with_model` and
:meth:`ConceptRecord.resolved`, which return a new record; written with :meth:`ConceptRecord.to_json`,
in the keys concepts always had (plus ``format_version``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from service.datasets.refs import StoredReference
from service.errors import first_validation_error
from service.models.stored import FORMAT_VERSION, check_format
from service.storage.stored_json import UnreadableRecord

# Keys a concept's document leaves out, rather than writes as null, when they have no value.
_ABSENT_WHEN_NONE = ("dataset", "template")


class ConceptModelState(BaseModel):
    """A concept's collection on one model.

    Attributes:
        job_id: the collection job.
        stats: the statistics prefix it publishes; None while a dataset reference is not resolved.
        modules: the module suffixes it collects (None: every editable layer).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str
    stats: str | None = None
    modules: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        if data["modules"] is None:
            del data["modules"]
        return data


class ConceptRecord(BaseModel):
    """A concept: its name, role, records (by digest) or dataset reference, and its collections.

    Attributes:
        num_records, dataset_digest: None for a dataset reference no collection job has resolved yet.
        dataset: the dataset reference as posted (None: records posted inline or uploaded).
        template: ``"chat"`` when prompt/completion records are rendered with the chat template.
        models: model ID -> its collection.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

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

    def to_json(self) -> dict[str, Any]:
        """The stored document: the keys concepts always had (no ``dataset``/``template`` when none)."""
        data = self.model_dump(mode="json")
        data["models"] = {model_id: state.to_json() for model_id, state in self.models.items()}
        for key in _ABSENT_WHEN_NONE:
            if data[key] is None:
                del data[key]
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
    current = check_format("concept", key, data)
    try:
        return ConceptRecord.model_validate(current)
    except ValidationError as exc:
        raise UnreadableRecord(key, f"not a concept ({first_validation_error(exc)})") from None
