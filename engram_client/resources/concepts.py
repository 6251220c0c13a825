"""Concepts: store one and start its collections (inline, uploaded or referenced records), read, delete."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from api_schemas import Concept, ConceptSubmission
from engram_client.transport import Page, Transport, _quote, _set_only


class ConceptsResource(Transport):
    """``/concepts``: a concept's records go inline, as a multipart upload, or as a reference."""

    def add_concept(
        self,
        name: str,
        models: Sequence[str],
        records: Sequence[Mapping[str, Any]] | None = None,
        jsonl_path: str | os.PathLike[str] | None = None,
        role: str = "target",
        description: str | None = None,
        callback_url: str | None = None,
        modules: Sequence[str] | None = None,
        dataset: Mapping[str, Any] | None = None,
        template: str | None = None,
    ) -> ConceptSubmission:
        """Store a concept and start collecting its statistics on each model.

        Args:
            name: the concept's name (letters, digits, ``.``, ``_``, ``-``).
            models: model IDs to collect on.
            records: inline records, ``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages": [...]}``;
                for small datasets.
            jsonl_path: a JSONL file, one record per line, streamed as a multipart upload; for large ones.
            dataset: a dataset reference the service's worker fetches: ``{"uri": "s3://…" | "hf://datasets/…"
                | "file:///…", "format"?, "columns"?, "rows"?}``.
            role: ``target`` (to be edited) or ``reference`` (only shapes the universe).
            description: free text kept with the concept.
            callback_url: POSTed each collection job when it ends (its host must be allowlisted).
            modules: module-name suffixes: collect only these layers' input groups (an edit must then
                select among them); default every editable layer.
            template: ``"chat"``: prompt/completion records rendered with the model's chat template.

        Returns:
            The concept and its collection jobs (already finished ones too, when the post repeats).

        Raises:
            ValueError: not exactly one of ``records``, ``jsonl_path`` and ``dataset``.
        """
        if sum(x is not None for x in (records, jsonl_path, dataset)) != 1:
            raise ValueError("pass exactly one of records= (inline), jsonl_path= (multipart upload), dataset= (reference)")
        fields = _set_only(
            name=name, models=list(models), role=role, description=description, callback_url=callback_url, template=template
        )
        if modules is not None:
            fields["modules"] = list(modules)
        if records is not None or dataset is not None:
            body = {"records": list(records)} if records is not None else {"dataset": dict(dataset or {})}
            response = self._request("POST", "/concepts", json={**fields, **body})
            return self._parse(ConceptSubmission, response)
        path = Path(jsonl_path)  # type: ignore[arg-type]  # checked above
        with path.open("rb") as upload:  # streamed from disk: a large dataset is never held in memory
            files = {"dataset": (path.name, upload, "application/x-ndjson")}
            response = self._request("POST", "/concepts", data=fields, files=files)
        return self._parse(ConceptSubmission, response)

    def list_concepts(self, *, limit: int | None = None, cursor: str | None = None) -> Page[Concept]:
        """Concepts by name with their per-model collection status: all of them, or one page with
        ``limit``/``cursor`` (see :meth:`_list`)."""
        return self._list(Concept, "/concepts", None, limit, cursor)

    def get_concept(self, name: str) -> Concept:
        """One concept."""
        return self._parse(Concept, self._request("GET", f"/concepts/{_quote(name)}"))

    def delete_concept(self, name: str) -> None:
        """Delete a concept with its statistics and dataset (those no other concept names); a 409
        names what still needs it (a job, the variants whose universe includes it)."""
        self._request("DELETE", f"/concepts/{_quote(name)}")

    def delete_statistics(self, name: str, model_id: str | None = None) -> None:
        """Delete a concept's statistics on ``model_id`` (every model: None); the concept stays."""
        params = {"model_id": model_id} if model_id is not None else None
        self._request("DELETE", f"/concepts/{_quote(name)}/statistics", params=params)
