"""The client's own layout, as a test (tests/test_architecture.py checks what the whole client may import).

- The library half (everything but ``engram_client.cli``) imports no CLI code and no CLI library
  (typer, click, rich): ``EngramClient`` is usable with httpx and pydantic alone.
- A resource builds only on the transport, the errors, the bodies and the resources it names in
  :data:`RESOURCE_BASES` (jobs, for what starts or waits for a job; variants, for downloads).
- No module of the client is over ~400 lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "engram_client"
CLI_LIBRARIES = ("typer", "click", "rich")
CORE = ("engram_client.transport", "engram_client.errors", "engram_client.bodies")
RESOURCE_BASES = {
    "models": {"jobs"},
    "variants": {"jobs"},
    "files": {"variants"},
    "evaluation": {"jobs"},
    "maps": {"jobs"},
}
MAX_LINES = 400


def _imports(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _library_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "cli" not in p.relative_to(PACKAGE).parts and "build" not in p.parts)


def test_the_library_half_imports_no_cli_code() -> None:
    broken = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in _library_modules()
        for name in _imports(path)
        if name.split(".")[0] in CLI_LIBRARIES or name.split(".")[:2] == ["engram_client", "cli"]
    ]
    assert _library_modules() and not broken, broken


@pytest.mark.parametrize("path", sorted((PACKAGE / "resources").glob("[!_]*.py")), ids=lambda p: p.stem)
def test_a_resource_builds_only_on_the_transport_and_its_named_bases(path: Path) -> None:
    allowed = {*CORE, *(f"engram_client.resources.{base}" for base in RESOURCE_BASES.get(path.stem, ()))}
    own = {name for name in _imports(path) if name.startswith("engram_client")}
    assert own <= allowed, f"{path.stem} imports {sorted(own - allowed)}"


def test_no_client_module_is_over_400_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these: {long}"
