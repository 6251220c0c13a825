"""Universes: the concepts an edit is relative to; build, list, read, delete, and their byte usage."""

from __future__ import annotations

from collections.abc import Sequence

from api_schemas import Universe, UniverseCreate, UniverseSubmission, UniverseUsage
from engram_client.bodies import fields_body
from engram_client.transport import Page, Transport, _quote, _set_only


class UniversesResource(Transport):
    """``/models/{id}/universes``, ``/universes/{id}`` and ``/universes/usage``."""

    def create_universe(
        self,
        model_id: str,
        concepts: Sequence[str] | None = None,
        rcond: float | None = None,
        callback_url: str | None = None,
    ) -> UniverseSubmission:
        """Build the universe of ``concepts`` (default: every concept ready on the model) and make it the
        model's current one; a universe already built answers at once (``job`` is then ``None``)."""
        given = {"concepts": list(concepts) if concepts else None, "rcond": rcond, "callback_url": callback_url}
        body = fields_body(UniverseCreate, given)
        return self._parse(UniverseSubmission, self._request("POST", f"/models/{_quote(model_id)}/universes", json=body))

    def list_universes(self, model_id: str, *, limit: int | None = None, cursor: str | None = None) -> Page[Universe]:
        """A model's universes, oldest first; ``current`` marks the one requests use. All of them, or
        one page with ``limit``/``cursor`` (see :meth:`_list`)."""
        return self._list(Universe, f"/models/{_quote(model_id)}/universes", None, limit, cursor)

    def get_universe(self, universe_id: str) -> Universe:
        """A universe: members, status, groups decomposed so far, bytes once built, last use."""
        return self._parse(Universe, self._request("GET", f"/universes/{_quote(universe_id)}"))

    def delete_universe(self, universe_id: str) -> None:
        """Delete a universe and its stored factors and engrams (an admin key; variants built from it
        stay). A 409 while a job builds or reads it, or while it is a model's current universe."""
        self._request("DELETE", f"/universes/{_quote(universe_id)}")

    def universe_usage(self, model_id: str | None = None) -> UniverseUsage:
        """Bytes the universes store (one model's, or all) against the service's budget."""
        params = _set_only(model_id=model_id)
        return self._parse(UniverseUsage, self._request("GET", "/universes/usage", params=params))
