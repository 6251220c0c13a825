"""Universes: build one ahead of a burst of requests, make it a model's current one, list and show them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from api_schemas import Universe, UniverseCreate, UniverseSubmission
from service.api.deps import ContextDep, LanesDep
from service.api.routes.jobs import job_view
from service.universes import service as universes

router = APIRouter(tags=["universes"])


@router.post("/models/{model_id:path}/universes", response_model=UniverseSubmission, status_code=202)
def create_universe(model_id: str, body: UniverseCreate, ctx: ContextDep, response: Response) -> dict[str, Any]:
    """Build the universe of these concepts (default: every ready one) and make it the model's current one."""
    universe, job = universes.submit_universe(ctx, model_id, body.concepts, body.rcond, body.callback_url)
    response.status_code = 200 if universe["status"] == "ready" else 202
    return {"universe": universe, "job": job_view(job) if job else None}


@router.get("/models/{model_id:path}/universes", response_model=list[Universe])
async def list_universes(model_id: str, ctx: ContextDep, lanes: LanesDep) -> list[dict[str, Any]]:
    """Every universe of this model, oldest first; ``current`` marks the one requests use."""
    return await lanes.status(universes.list_universes, ctx, model_id)


@router.get("/universes/{universe_id}", response_model=Universe)
async def get_universe(universe_id: str, ctx: ContextDep, lanes: LanesDep) -> dict[str, Any]:
    """A universe: its members, status, groups decomposed so far, and bytes once built."""
    return await lanes.status(universes.universe_view, ctx, universe_id)
