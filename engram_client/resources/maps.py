"""Memory-trace maps: where each concept's engram lives, as data or as a PNG heatmap."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from api_schemas import EngramMap
from engram_client.errors import EngramError
from engram_client.resources.jobs import JobsResource
from engram_client.transport import PNG_SIGNATURE, _quote, _set_only


class MapsResource(JobsResource):
    """``/models/{id}/engram-map`` and its PNG: a map not computed yet is a job this waits for."""

    def engram_map(
        self,
        model_id: str,
        concepts: Sequence[str],
        reference: Sequence[str] | None = None,
        rcond: float | None = None,
        *,
        measure: str | None = None,
    ) -> EngramMap:
        """Where each concept's engram lives, by block and module type.

        Args:
            concepts: up to 8 concepts ready on the model.
            reference: the universe's other concepts (default: every concept ready on the model; ``[]``: none).
            rcond: the pseudo-inverse cut, as for :meth:`unlearn`.
            measure: ``data`` (the service's default): ``‖W_l⁺X‖_F / ‖W_l X‖_F`` over the universe's
                inputs, 0 to 1; ``weight``: the paper's ``‖W_l⁺‖_F / ‖W_l‖_F``.

        Returns:
            An :class:`~api_schemas.EngramMap` (``model_id, concepts, reference, rcond, measure, blocks, modules,
            maps: {concept: {rho, max, argmax}}, outside_blocks, layers, left_out``), which also reads as a dict
            (``["maps"]``); ``rho`` is a blocks × modules grid (``None`` where a block lacks that module). A map
            not computed yet is computed by a job on the service: this waits for it.

        Raises:
            EngramJobError: the map's job failed.
        """
        params = _map_params(concepts, reference, rcond, measure)
        return self._parse(EngramMap, self._answer_after_job("GET", f"/models/{_quote(model_id)}/engram-map", params=params))

    def engram_map_png(
        self,
        model_id: str,
        concepts: Sequence[str],
        reference: Sequence[str] | None = None,
        rcond: float | None = None,
        *,
        width: int | None = None,
        height: int | None = None,
        measure: str | None = None,
    ) -> bytes:
        """The map as a PNG heatmap, one panel per concept; ``width`` × ``height`` pixels (200 to 4000 each);
        ``measure`` as for :meth:`engram_map`.

        Raises:
            EngramError: the answer is not a PNG image.
        """
        params = _map_params(concepts, reference, rcond, measure) | _set_only(width=width, height=height)
        headers = {"Accept": "image/png, application/problem+json"}
        response = self._answer_after_job(
            "GET", f"/models/{_quote(model_id)}/engram-map.png", params=params, headers=headers
        )
        if not response.content.startswith(PNG_SIGNATURE):
            raise EngramError(f"the engram map of {model_id} is not a PNG ({response.headers.get('content-type')})")
        return response.content


def _names(names: Sequence[str] | str) -> str:
    """Concept names for a query (``a,b``); one bare name is one name, not its letters."""
    return names if isinstance(names, str) else ",".join(names)


def _map_params(
    concepts: Sequence[str], reference: Sequence[str] | None, rcond: float | None, measure: str | None
) -> dict[str, Any]:
    names = _names(reference) if reference is not None else None
    return _set_only(concepts=_names(concepts), reference=names, rcond=rcond, measure=measure)
