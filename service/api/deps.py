"""Request dependencies as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.registry import Context


def get_context(request: Request) -> Context:
    return request.app.state.ctx


ContextDep = Annotated[Context, Depends(get_context)]
