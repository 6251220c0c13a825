"""docs/API.md, the committed API reference, against the OpenAPI document the code builds now.

The reference is generated (``make api-docs``, scripts/gen_api_docs.py); this test keeps it from
drifting: every operation of the document has its section and every section is a real operation,
each lists exactly the document's parameters and answer statuses, and every schema is there with
exactly its fields. Wording may change without a regeneration; a route, a parameter, an answer or a
field may not.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE = REPO_ROOT / "docs" / "API.md"
STALE = "docs/API.md is stale: run `make api-docs` and commit docs/API.md"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api_docs", REPO_ROOT / "scripts" / "gen_api_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return _generator()


@pytest.fixture(scope="module")
def document(generator: ModuleType) -> dict[str, Any]:
    return generator.build_document()


@pytest.fixture(scope="module")
def reference() -> str:
    return REFERENCE.read_text()


def _sections(text: str, heading: str) -> dict[str, str]:
    """``{title: body}`` of each ``### title`` section under the ``## heading`` part of the reference."""
    start = text.index(f"\n## {heading}\n") if heading == "Schemas" else text.index("\n## Routes\n")
    end = text.index("\n## Schemas\n") if heading != "Schemas" else len(text)
    parts = re.split(r"^### (.+)$", text[start:end], flags=re.MULTILINE)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def _table_first_column(body: str, header: str) -> list[str]:
    """The first cells of the table whose header row starts with ``| header |``."""
    lines = body.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    cells = []
    for line in lines[index + 2 :]:
        if not line.startswith("|"):
            break
        cells.append(line.split("|")[1].strip().strip("`"))
    return cells


def test_every_operation_has_its_section_and_no_other(document: dict[str, Any], reference: str, generator: Any) -> None:
    documented = {title.strip("`") for title in _sections(reference, "Routes")}
    live = {f"{method} {path}" for method, path, _ in generator.operations(document)}
    assert live - documented == set(), f"operations missing from docs/API.md: {sorted(live - documented)}; {STALE}"
    assert documented - live == set(), f"docs/API.md documents operations that no longer exist: {sorted(documented - live)}"


def test_every_operation_lists_exactly_its_answers(document: dict[str, Any], reference: str, generator: Any) -> None:
    sections = _sections(reference, "Routes")
    for method, path, operation in generator.operations(document):
        listed = _table_first_column(sections[f"`{method} {path}`"], "status")
        assert sorted(listed) == sorted(operation["responses"]), f"{method} {path}: answers differ; {STALE}"


def test_every_operation_lists_exactly_its_parameters(document: dict[str, Any], reference: str, generator: Any) -> None:
    sections = _sections(reference, "Routes")
    for method, path, operation in generator.operations(document):
        section = sections[f"`{method} {path}`"]
        listed = _table_first_column(section, "name") if "| name |" in section else []
        expected = [parameter["name"] for parameter in operation.get("parameters") or []]
        assert listed == expected, f"{method} {path}: parameters differ; {STALE}"


def test_every_schema_is_documented_with_its_fields(document: dict[str, Any], reference: str) -> None:
    sections = _sections(reference, "Schemas")
    schemas = document["components"]["schemas"]
    assert set(schemas) == set(sections), f"schemas differ: {sorted(set(schemas) ^ set(sections))}; {STALE}"
    for name, schema in schemas.items():
        fields = list(schema.get("properties") or {})
        documented = _table_first_column(sections[name], "field") if fields else []
        assert documented == fields, f"schema {name}: fields differ; {STALE}"


def test_the_routes_index_links_every_section(reference: str, generator: Any, document: dict[str, Any]) -> None:
    for method, path, _ in generator.operations(document):
        target = generator.anchor(method, path)
        assert f'<a id="{target}"></a>' in reference, (method, path)
        assert f"(#{target})" in reference, f"the routes table does not link {method} {path}"


def test_the_readme_points_to_the_reference() -> None:
    assert "docs/API.md" in (REPO_ROOT / "README.md").read_text()
