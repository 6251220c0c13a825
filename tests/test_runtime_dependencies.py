"""``make install-runtime`` serves (issue 40: there was no runtime-only install): every package the
service, the workers, the wire schemas and the client import at run time is a declared runtime
dependency of its distribution, never a dev extra that only ``make install`` brings."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import tomllib

from engram_fixtures.live import REPO_ROOT

# Distribution -> the folders whose run-time imports its [project.dependencies] must cover.
DISTRIBUTIONS = {
    REPO_ROOT / "pyproject.toml": ("service", "workers"),
    REPO_ROOT / "api_schemas" / "pyproject.toml": ("api_schemas",),
    REPO_ROOT / "engram_client" / "pyproject.toml": ("engram_client",),
}
OURS = {"service", "workers", "api_schemas", "engram_client"}


def declared(pyproject: Path) -> set[str]:
    """The normalised names of a distribution's runtime dependencies."""
    requirements = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {normalise(re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]) for requirement in requirements}


def optional(pyproject: Path) -> set[str]:
    """The normalised names of a distribution's optional extras but ``dev`` (``[mlflow]``): what a
    feature that is off by default needs, imported only inside the function that uses it."""
    extras = tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {})
    return {
        normalise(re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0])
        for extra, requirements in extras.items()
        if extra != "dev"
        for requirement in requirements
    }


def imported_at_module_level(folder: Path) -> set[str]:
    """Top-level modules a module of ``folder`` imports when it is itself imported (not inside a function)."""
    found: set[str] = set()
    for path in sorted(folder.rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_top_levels(folder: Path) -> dict[str, str]:
    """Top-level module -> the first file importing it, for imports that run when the module runs
    (inside ``if TYPE_CHECKING:`` blocks they do not)."""
    found: dict[str, str] = {}
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for child in block.body
            for node in ast.walk(child)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(REPO_ROOT)))
    return found


def test_every_run_time_import_is_a_declared_runtime_dependency() -> None:
    owners = packages_distributions()
    missing: list[str] = []
    for pyproject, folders in DISTRIBUTIONS.items():
        allowed = installed_with(declared(pyproject))
        extras = optional(pyproject)
        for folder in folders:
            eager = imported_at_module_level(REPO_ROOT / folder)
            for module, where in imported_top_levels(REPO_ROOT / folder).items():
                if module in OURS or module in sys.stdlib_module_names or module == "__future__":
                    continue
                distributions = {normalise(d) for d in owners.get(module, [])}
                if not distributions:
                    missing.append(f"{where}: imports {module!r}, which no installed distribution provides")
                elif distributions & extras and module in eager:
                    missing.append(
                        f"{where}: imports {module!r} of an optional extra when it is imported: import it where used"
                    )
                elif not distributions & (allowed | extras):
                    listed = ", ".join(sorted(distributions))
                    missing.append(
                        f"{where}: imports {module!r} ({listed}), which {pyproject.relative_to(REPO_ROOT)} does not bring"
                    )
    assert not missing, "\n".join(missing)


def installed_with(declared_names: set[str]) -> set[str]:
    """Every distribution a runtime install brings: the declared ones and, transitively, what they require
    (extras aside). ``urllib3`` comes with ``boto3`` through ``botocore``: a runtime install has it."""
    from importlib.metadata import PackageNotFoundError, requires

    seen: set[str] = set()
    todo = list(declared_names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            needs = requires(name) or []
        except PackageNotFoundError:  # engram-api-schemas is installed under its own name: read above
            continue
        todo += [normalise(re.split(r"[\s<>=!~;\[(]", need, maxsplit=1)[0]) for need in needs if "extra ==" not in need]
    return seen


def test_install_runtime_installs_no_dev_extra() -> None:
    printed = subprocess.run(
        ["make", "-n", "-B", "install-runtime"], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    installs = [line for line in printed.splitlines() if "pip install" in line]
    assert any('"torch==' in line for line in installs), installs
    assert any("-e ./api_schemas -e ." in line for line in installs) and any(
        "-e ./engram_client" in line for line in installs
    )
    assert not any("[dev]" in line for line in installs), installs
