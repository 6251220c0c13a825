"""Universes: build one ahead of a burst of requests, make it a model's current one, list and show
them, and what they hold in storage against the budget."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from api_schemas import Universe, UniverseCreate, UniverseSubmission, UniverseUsage
from service.api.deps import ContextDep, LanesDep
from service.api.pagination import PAGED_HEADERS, PageDep, SortKey
from service.universes import retention
from service.universes import service as universes

router = APIRouter(tags=["universes"])
ModelQuery = Annotated[str | None, Query(max_length=200, description="only this model's universes")]


@router.post("/models/{model_id:path}/universes", response_model=UniverseSubmission, status_code=202)
def create_universe(model_id: str, body: UniverseCreate, ctx: ContextDep, response: Response) -> UniverseSubmission:
    """Build the universe of these concepts (default: every ready one) and make it the model's current one;
    409 when it would not fit ENGRAM_UNIVERSE_BYTES_BUDGET even after evicting unused universes."""
    submission = universes.universe_submission(ctx, model_id, body.concepts, body.rcond, body.callback_url)
    response.status_code = 200 if submission.universe.status == "ready" else 202
    return submission


@router.get("/models/{model_id:path}/universes", response_model=list[Universe], responses=PAGED_HEADERS)
async def list_universes(model_id: str, ctx: ContextDep, lanes: LanesDep, page: PageDep) -> list[Universe]:
    """This model's universes, oldest first (by creation, then ID); ``current`` marks the one requests
    use. One page (``limit``, ``cursor``)."""
    found: dict[SortKey, Universe] = {
        (_created(u), u.universe_id): u for u in await lanes.status(universes.list_universes, ctx, model_id)
    }
    return page.answer(*page.select(sorted(found), lambda key: found[key]))


# Before /universes/{universe_id}: "usage" is no universe ID, and this route must match first.
@router.get(
    "/universes/usage",
    response_model=UniverseUsage,
    responses={404: {"description": "`model_id` names a model that is not registered"}},
)
async def universe_usage(ctx: ContextDep, lanes: LanesDep, model_id: ModelQuery = None) -> UniverseUsage:
    """Bytes stored by universes (factors, engrams), builds' reserved bytes, the budget and statuses;
    ``?model_id=`` for one model's universes (404 when it is not registered)."""
    return await lanes.status(retention.storage_summary, ctx, model_id)


@router.delete(
    "/universes/{universe_id}",
    status_code=204,
    response_class=Response,
    responses={
        404: {"description": "no such universe"},
        409: {"description": "a job not finished builds or reads it (named), or it is a model's current universe"},
    },
)
def delete_universe(universe_id: str, ctx: ContextDep) -> Response:
    """Delete a universe: its factors, engrams and records (admin); variants built from it stay."""
    universes.delete_universe(ctx, universe_id)
    return Response(status_code=204)


@router.get("/universes/{universe_id}", response_model=Universe)
async def get_universe(universe_id: str, ctx: ContextDep, lanes: LanesDep) -> Universe:
    """A universe: its members, status, groups decomposed so far, bytes once built, last use."""
    return await lanes.status(universes.universe_view, ctx, universe_id)


def _created(universe: Universe) -> str:
    """The creation time as stored (``datetime.isoformat()``, which this gives back), the list's
    first sort key and the cursor's: ``""`` for a universe recorded without one."""
    return universe.created_at.isoformat() if universe.created_at else ""
