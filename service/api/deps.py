"""Request dependencies as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.api.lanes import Lanes
from service.context import Context


# async: FastAPI runs a plain-def dependency in the shared thread pool, which waiting requests must
# never need.
async def get_context(request: Request) -> Context:
    return request.app.state.ctx


async def get_lanes(request: Request) -> Lanes:
    return request.app.state.lanes


ContextDep = Annotated[Context, Depends(get_context)]
LanesDep = Annotated[Lanes, Depends(get_lanes)]
