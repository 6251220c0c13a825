"""One request-error layer for every JSON route (issue 40): what FastAPI's validation says, rewritten to
name the fix.

``POST /concepts`` parses its own body and already answered well; every other route answered "body:
Input should be a valid dictionary" for a missing content-type, "the request body is not valid JSON"
without a place, and "Extra inputs are not permitted" for a misspelt field. Here, for any route:

* a body that is not JSON because of its content-type: 415, naming the header to send;
* a JSON syntax error: 400 with its line and column (the words of Python's ``json``, as /concepts says);
* an unknown field: the closest known name of that very object, or the names it takes;
* a value outside a fixed set: the closest allowed value.

The route's own body model is read from the matched route (``scope["route"].body_field``), so a new
route gets the same answers without code of its own.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

from service.errors import InvalidInput, MalformedBody, ProblemError

_JSON_TYPES = ("application/json", "application/problem+json")
_NOT_AN_OBJECT = {"model_attributes_type", "dict_type", "model_type"}
_MAX_LISTED = 12  # an object with more fields is named by its closest matches only


class UnsupportedMediaType(ProblemError):
    status, title, slug = 415, "Unsupported media type", "unsupported-media-type"


class MalformedJson(MalformedBody):
    """A JSON syntax error (the title and type the API answered before this layer, kept)."""

    title, slug = "Malformed JSON", "malformed-json"


def validation_problem(request: Request, exc: RequestValidationError) -> ProblemError:
    """The problem to answer for ``exc``: a 415, a 400 or a 422 whose detail names the fix."""
    errors = list(exc.errors())
    content_type = request.headers.get("content-type", "")
    if _body_not_parsed_as_json(errors, content_type):
        return _unsupported_media_type(request, content_type)
    syntax = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if syntax is not None:
        return MalformedJson(_json_syntax(syntax, exc.body))
    return invalid_input(errors, _body_model(request), ("body",))


def invalid_input(errors: Sequence[Any], model: type[BaseModel] | None, prefix: tuple[str, ...] = ()) -> InvalidInput:
    """A 422 for pydantic's ``errors`` of validating ``model``, each unknown field or choice with its
    closest known one (the ``close_matches`` member: where -> suggestions).

    Args:
        prefix: where the model sits in each error's ``loc`` (FastAPI's body errors start with "body";
            a route that validates a parsed body itself, as /concepts does, has none).
    """
    entries = [_entry(error, model, prefix) for error in errors]
    detail = "; ".join(f"{entry['where']}: {entry['msg']}" for entry in entries)
    listed = [{"loc": entry["loc"], "msg": entry["msg"], "type": entry["type"]} for entry in entries]
    suggestions = {entry["where"]: entry["close_matches"] for entry in entries if entry.get("close_matches")}
    return InvalidInput(detail, errors=listed, extensions={"close_matches": suggestions} if suggestions else None)


def _body_not_parsed_as_json(errors: Sequence[Any], content_type: str) -> bool:
    """FastAPI hands a body it did not parse as JSON (no or another content-type) to the model as bytes."""
    if content_type.split(";")[0].strip().lower() in _JSON_TYPES:
        return False
    return any(
        tuple(e.get("loc", ())) == ("body",) and e.get("type") in _NOT_AN_OBJECT and isinstance(e.get("input"), bytes | str)
        for e in errors
    )


def _unsupported_media_type(request: Request, content_type: str) -> UnsupportedMediaType:
    where = f"{request.method} {request.url.path}"
    sent = f"content-type {content_type.split(';')[0]!r}" if content_type else "no content-type"
    fix = "send the header content-type: application/json (curl: -H 'content-type: application/json')"
    if content_type.startswith("multipart/form-data"):
        fix += "; of the JSON routes only POST /concepts also takes a form upload (-F dataset=@file.jsonl)"
    return UnsupportedMediaType(f"{where} reads a JSON object and the request had {sent}: {fix}")


def _json_syntax(error: Any, body: Any) -> str:
    """``Expecting value: line 1 column 17 (char 16)``, from the error's offset into the body."""
    reason = str((error.get("ctx") or {}).get("error", "JSON decode error"))
    loc = tuple(error.get("loc", ()))
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    if len(loc) < 2 or not isinstance(loc[1], int) or not isinstance(text, str):
        return f"the request body is not valid JSON: {reason}"
    position = loc[1]
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    return f"the request body is not valid JSON: {reason}: line {line} column {column} (char {position})"


def _body_model(request: Request) -> type[BaseModel] | None:
    """The matched route's body model (None: no route, or a body that is not one pydantic model)."""
    route = request.scope.get("route")
    field = getattr(route, "body_field", None)  # an APIRoute with a body; other routes have none
    annotation = getattr(getattr(field, "field_info", None), "annotation", None)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _entry(error: Any, model: type[BaseModel] | None, prefix: tuple[str, ...]) -> dict[str, Any]:
    loc = [str(part) if not isinstance(part, int) else part for part in error.get("loc", ())]
    entry: dict[str, Any] = {
        "loc": loc,
        "where": ".".join(str(p) for p in loc),
        "msg": str(error.get("msg", "")),
        "type": str(error.get("type", "")),
    }
    inside = tuple(loc[: len(prefix)]) == prefix and len(loc) > len(prefix)
    if entry["type"] == "extra_forbidden" and inside and model is not None:
        known = _field_names(model, loc[len(prefix) : -1])
        if known:
            close = difflib.get_close_matches(str(loc[-1]), known, n=3, cutoff=0.6)
            entry["msg"] = _unknown_field_message(str(loc[-1]), known, close)
            entry["close_matches"] = close
    elif entry["type"] in {"literal_error", "enum"} and isinstance(error.get("input"), str):
        allowed = _allowed_values(error)
        close = difflib.get_close_matches(error["input"], allowed, n=3, cutoff=0.6)
        if close:
            entry["msg"] = f"{entry['msg']} (did you mean {' or '.join(repr(c) for c in close)}?)"
            entry["close_matches"] = close
    return entry


def _unknown_field_message(name: str, known: list[str], close: list[str]) -> str:
    if close:
        return f"unknown field {name!r}: did you mean {' or '.join(repr(c) for c in close)}?"
    if len(known) <= _MAX_LISTED:
        return f"unknown field {name!r}: this object takes {', '.join(sorted(known))}"
    return f"unknown field {name!r}: see this operation's schema at /docs"


def _allowed_values(error: Any) -> list[str]:
    """The choices a literal or enum error lists in its context (``'a', 'b' or 'c'``)."""
    expected = str((error.get("ctx") or {}).get("expected", ""))
    return [part.strip().strip("'\"") for part in expected.replace(" or ", ",").split(",") if part.strip()]


def _field_names(model: type[BaseModel], path: Sequence[str | int]) -> list[str]:
    """The names (aliases where set) the object at ``path`` inside ``model`` takes; [] where unknown."""
    current: list[type[BaseModel]] = [model]
    for part in path:
        if isinstance(part, int):  # an item of a list: the models are the same
            continue
        following: list[type[BaseModel]] = []
        for candidate in current:
            field = candidate.model_fields.get(part) or next(
                (f for f in candidate.model_fields.values() if f.alias == part), None
            )
            if field is not None:
                following += _models_in(field.annotation)
        if not following:  # a tagged union's tag (the member it names), or a dict's key (the same models)
            tagged = [candidate for candidate in current if _has_tag(candidate, part)]
            following = tagged or (current if part not in _all_field_names(current) else [])
        current = following
    return sorted({name for candidate in current for name in _all_field_names([candidate])})


def _has_tag(model: type[BaseModel], tag: str) -> bool:
    """Whether a ``Literal`` field of ``model`` takes ``tag`` (pydantic puts a discriminated union's tag in ``loc``)."""
    return any(
        typing.get_origin(field.annotation) is typing.Literal and tag in typing.get_args(field.annotation)
        for field in model.model_fields.values()
    )


def _all_field_names(models: Sequence[type[BaseModel]]) -> set[str]:
    return {field.alias or name for model in models for name, field in model.model_fields.items()}


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold: ``X``, ``X | None``, ``list[X]``, ``dict[str, X]``,
    ``Annotated[X, ...]`` and unions of these."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, tuple, set, frozenset, dict, Sequence):
        args = typing.get_args(annotation)
        if origin is dict:
            args = args[1:]
        return [model for arg in args for model in _models_in(arg)]
    return []
