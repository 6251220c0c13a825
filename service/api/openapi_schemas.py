"""Request and schema shapes the generated OpenAPI document needs fixed by hand: the concepts
body (JSON or multipart, records capped by ``ENGRAM_MAX_RECORDS``), schemas FastAPI leaves out or in
unused, the engram map's query parameters, and callback URLs restricted to the allowed hosts.
:mod:`service.api.openapi` builds the document and applies these.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

import api_schemas

SCHEMA_REF = "#/components/schemas/"


def concepts_body(doc: dict[str, Any], schemas: dict[str, Any], max_records: int) -> None:
    """``POST /concepts``: the JSON body is ``ConceptCreate``; the multipart form mirrors its rules."""
    operation = doc["paths"].get("/concepts", {}).get("post")
    if operation is None:
        return
    create = model_schema(api_schemas.ConceptCreate, schemas)
    # Optional, never null (ConceptCreate refuses an explicit null for each).
    for name in ("records", "dataset", "samples", "template"):
        create["properties"][name] = _non_null(create["properties"][name])
    create["properties"]["records"]["maxItems"] = max_records
    create["description"] = (
        'A concept\'s records inline, or a `dataset` reference the worker fetches. Each record is `{"text"}` '
        '(every token counts), `{"prompt", "completion"}` (only the completion tokens enter the statistics) or '
        '`{"messages": [{"role", "content"}, …]}` (rendered with the model\'s chat template; only the assistant '
        'turns enter the statistics). ShareGPT `{"conversations": [{"from", "value"}, …]}`, Alpaca '
        '`{"instruction", "input", "output"}` and message contents given as a list of text parts are read '
        f"as these; at most {max_records} records (`ENGRAM_MAX_RECORDS`)."
    )
    schemas["ConceptCreate"] = create
    props = create["properties"]
    multipart = {
        "type": "object",
        "required": ["name", "models", "dataset"],
        "properties": {
            "name": {"type": "string", "pattern": CONCEPT_NAME_NO_DOTS},
            "models": {
                "type": "string",
                "minLength": 1,
                "description": "model IDs, repeated or comma-separated",
            },
            "role": _non_null(props["role"]),
            "description": _non_null(props["description"]),
            "callback_url": {**_non_null(props["callback_url"]), "description": "POSTed each collection job when it ends"},
            "template": props["template"],
            "dataset": {
                "type": "string",
                "format": "binary",
                "description": (
                    "JSON Lines, plain or gzip-compressed (told by its first bytes; `.jsonl.gz`): one record per "
                    f"line, the same objects as `records` (at most {max_records})"
                ),
            },
        },
    }
    content = operation.setdefault("requestBody", {"required": True}).setdefault("content", {})
    content["application/json"] = {"schema": {"$ref": SCHEMA_REF + "ConceptCreate"}}
    content["multipart/form-data"] = {"schema": multipart}


# CONCEPT_NAME_PATTERN without "." and ".." (which ConceptCreate refuses), as one regular expression:
# a name that does not start with ".", or "." and a non-dot, or ".." and at least one more character.
CONCEPT_NAME_NO_DOTS = (
    r"^([A-Za-z0-9_-][A-Za-z0-9._-]{0,127}|\.[A-Za-z0-9_-][A-Za-z0-9._-]{0,126}|\.\.[A-Za-z0-9._-]{1,126})$"
)


def _non_null(schema: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [X, {"type": "null"}]`` (an optional field) -> X, with the field's annotations."""
    options = schema.get("anyOf")
    if not options:
        return {k: v for k, v in schema.items() if k not in ("title", "default")}
    base = next(o for o in options if o != {"type": "null"})
    extras = {k: v for k, v in schema.items() if k not in ("anyOf", "title", "default")}
    return {**base, **extras}


def model_schema(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    """``model``'s validation JSON schema; the models it nests go into ``schemas`` (if not there yet)."""
    generated = model.model_json_schema(ref_template=SCHEMA_REF + "{model}", mode="validation")
    for name, schema in generated.pop("$defs", {}).items():
        schemas.setdefault(name, schema)
    return generated


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield ref
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def add_missing_schemas(doc: dict[str, Any], schemas: dict[str, Any]) -> None:
    """Generate every ``#/components/schemas/X`` that is referenced but absent, from ``api_schemas.X``."""
    while True:
        missing = {r[len(SCHEMA_REF) :] for r in refs(doc) if r.startswith(SCHEMA_REF)} - schemas.keys()
        if not missing:
            return
        for name in sorted(missing):
            # a module's namespace looked up by a schema name: the name may not be exported
            model = getattr(api_schemas, name, None)
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise LookupError(f"the OpenAPI document references {SCHEMA_REF}{name}, which no api_schemas model is")
            schemas[name] = model_schema(model, schemas)


def drop_unused_schemas(doc: dict[str, Any], schemas: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if name in schemas:
            others = {k: v for k, v in schemas.items() if k != name}
            if SCHEMA_REF + name not in set(refs(doc["paths"])) | set(refs(others)) | set(
                refs(doc["components"].get("responses", {}))
            ):
                del schemas[name]


def engram_map_queries(doc: dict[str, Any]) -> None:
    """``?concepts=``: 1 to 8 names (``service.maps.service.MAX_CONCEPTS``).

    The service splits every value at commas, so ``?concepts=a,b`` (OpenAPI's ``explode: false``)
    and ``?concepts=a&concepts=b`` (the exploded form the schema describes) are the same request.
    """
    from service.maps.service import MAX_CONCEPTS

    name = {"type": "string", "pattern": ONE_NAME_PATTERN}
    for path in ("/models/{model_id}/engram-map", "/models/{model_id}/engram-map.png"):
        operation = doc["paths"].get(path, {}).get("get")
        for parameter in (operation or {}).get("parameters", []):
            if parameter["name"] == "concepts" and parameter["schema"].get("type") == "array":
                parameter["schema"].update(minItems=1, maxItems=MAX_CONCEPTS, items=dict(name))
                parameter["schema"].pop("description", None)
                parameter["description"] = f"1 to {MAX_CONCEPTS} concept names: `?concepts=a&concepts=b` or `?concepts=a,b`"
            if parameter["name"] == "reference" and parameter["schema"].get("anyOf"):
                array = next(o for o in parameter["schema"]["anyOf"] if o.get("type") == "array")
                array["items"] = dict(name)


ONE_NAME_PATTERN = r"^[^,]*[^,\s][^,]*$"  # one concept name (values are split at commas and stripped)


def callback_urls(doc: dict[str, Any], schemas: dict[str, Any], allowed: frozenset[str]) -> None:
    """``callback_url``: an absolute http(s) URL to an allowlisted host (``ENGRAM_CALLBACK_HOSTS``).

    Without an allowlist, callbacks are off and the only value accepted is ``null`` (or none).
    """
    if allowed:
        rule: dict[str, Any] = {
            "type": "string",
            "maxLength": 2000,
            "format": "uri",
            "pattern": _callback_pattern(allowed),
            "description": "an http(s) URL on a host of ENGRAM_CALLBACK_HOSTS "
            f"({', '.join(sorted(allowed))}), POSTed the job when it ends (signed, Standard Webhooks)",
        }
    else:
        rule = {"type": "null", "description": "callbacks are disabled on this server (ENGRAM_CALLBACK_HOSTS is empty)"}
    for schema in schemas.values():
        if "callback_url" in schema.get("properties", {}):
            schema["properties"]["callback_url"] = {"anyOf": [rule, {"type": "null"}]} if allowed else rule
    body = doc["paths"].get("/concepts", {}).get("post", {}).get("requestBody", {})
    multipart = body.get("content", {}).get("multipart/form-data")
    if multipart is not None:
        if allowed:
            multipart["schema"]["properties"]["callback_url"] = rule
        else:
            multipart["schema"]["properties"].pop("callback_url", None)


def _callback_pattern(allowed: frozenset[str]) -> str:
    """A regular expression for http(s) URLs whose host (and port) an allowlist entry names.

    Like :func:`service.jobs.callbacks.check_callback_url`: scheme and host in any case; an entry
    without a port allows every port, ``host:80`` / ``host:443`` also the scheme's default.
    """

    def anycase(text: str) -> str:
        return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else ("\\." if c == "." else c) for c in text)

    http, https, either = "[Hh][Tt][Tt][Pp]://", "[Hh][Tt][Tt][Pp][Ss]://", "[Hh][Tt][Tt][Pp][Ss]?://"
    options = []
    for entry in sorted(allowed):
        host, colon, port = entry.rpartition(":")
        if not (colon and port.isdigit()):
            options.append(f"{either}{anycase(entry)}(:[0-9]+)?")
            continue
        options.append(f"{either}{anycase(host)}:{port}")
        if port == "80":
            options.append(f"{http}{anycase(host)}")
        if port == "443":
            options.append(f"{https}{anycase(host)}")
    # No control or whitespace character anywhere: the service refuses them (a parser may drop them).
    return f"^({'|'.join(options)})([/?#][^\\s\\x00-\\x1f\\x7f-\\x9f]*)?$"
