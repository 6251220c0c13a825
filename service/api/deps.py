"""Request dependencies as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.api.auth import request_principal
from service.api.lanes import Lanes
from service.context import Context
from service.jobs.admission import job_owner


# async: FastAPI runs a plain-def dependency in the shared thread pool, which waiting requests must
# never need.
async def get_context(request: Request) -> Context:
    # Every route that can submit work takes the Context: the jobs it creates are its key's
    # (service.jobs.admission). Set here, in the request's own task, the value reaches the handler
    # and the worker threads it calls (they run in a copy of this context).
    job_owner.set(request_principal(request).key_id)
    return request.app.state.ctx


async def get_lanes(request: Request) -> Lanes:
    return request.app.state.lanes


ContextDep = Annotated[Context, Depends(get_context)]
LanesDep = Annotated[Lanes, Depends(get_lanes)]
