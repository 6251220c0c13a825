"""The rules of the house (../shared/ARCHITECTURE.md), as a test that fails when one is broken.

Every ``import`` in the repository's own packages is read from the source (AST, so imports inside
functions count too) and checked against:

- the engine (``service.engine``) is pure: no web, queue, storage or HTTP code, and nothing of the
  service outside the engine;
- the API (``service.api``) never imports the engine: linear algebra and model loading are jobs;
- the execution package (``service.execution``: kinds, runner, executors, runtime) imports no
  domain package (:data:`DOMAINS`): it runs any job through the kind table, which names each body,
  helper and periodic duty as a string, imported where it runs;
- nothing under ``service`` imports ``workers`` (the Celery app sits on top), except the process
  entry point ``service.cli`` (``engram-service serve | worker | …`` starts the API or a Celery
  worker), which nothing imports;
- the wire contract (``api_schemas``) imports no server code and no torch;
- the product (``service``, ``workers``) never imports the fixtures (``engram_fixtures``: the demo,
  the tiny model builders and the live server that tests, bench and scripts share), entry point
  included, so the images need not ship them;
- the client (``service.client`` today, ``engram_client`` once it is its own distribution)
  imports only ``api_schemas``, itself and its own libraries;
- dependencies point down the layers of :data:`LAYERS` (``api_schemas`` ← ``engine`` ← ``storage``
  ← the jobs' records ← the Context ← the domains, one floor each (statistics ← models ← datasets ←
  concepts ← engrams ← universes ← variants ← evaluation ← maps ← calibration) ← ``execution``
  (kinds, runner, executors, runtime) ← ``api`` / ``workers``): no module imports one of a higher
  layer, and every module has a layer;
- no import cycle between the service's modules;
- no module outside ``service.statistics`` spells a statistics file name or builds a statistics
  prefix by hand (``StatsKey`` spells them once and parses them back);
- no module imports a test module (``test_*.py``): what tests share lives in ``tests/helpers/``
  (or ``tests/helpers/store_world.py``, ``tests/helpers/s3.py``, ``engram_fixtures``), so running, moving or
  deleting one test module never changes another.

``test_the_checker_catches_each_kind_of_violation`` feeds the checker synthetic modules, so a
checker that silently finds nothing fails too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("service", "workers", "api_schemas", "engram_client", "engram_fixtures")
# Where a test module could be imported from: the tests themselves, and what runs beside them.
TEST_IMPORTERS = ("tests", "bench", "scripts", *PACKAGES)

# Third-party roots a pure engine must not reach for.
ENGINE_FORBIDDEN = ("fastapi", "starlette", "uvicorn", "celery", "kombu", "redis", "boto3", "botocore", "httpx")
# What the client may import besides the standard library and its own package (cryptography: engram verify's
# Ed25519 signature check).
CLIENT_ALLOWED_THIRD_PARTY = ("httpx", "pydantic", "typer", "rich", "click", "api_schemas", "cryptography")
CLIENT_PACKAGES = ("service.client", "engram_client")
# The domain packages, bottom up as in LAYERS: what service.execution never imports.
DOMAINS = (
    "service.statistics",
    "service.models",
    "service.datasets",
    "service.concepts",
    "service.engrams",
    "service.universes",
    "service.variants",
    "service.evaluation",
    "service.maps",
    "service.calibration",
)
EXECUTION = "service.execution"
# Process entry points: they start the API or a worker, so they sit above both; nothing imports them.
ENTRY_POINTS = ("service.cli",)
# What tests, bench and scripts share (a dev package): it may import the service, never the reverse.
FIXTURES = "engram_fixtures"
# The house's layers, lowest first (../shared/ARCHITECTURE.md): a module imports modules of its own
# layer and of the layers below, never above. A name covers its package; the longest name that
# covers a module decides its layer, and the bare ``service`` package is itself only.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "the contract and settings",
        ("api_schemas", "service", "service.config", "service.errors", "service.metadata", "service.observability"),
    ),
    ("the engine", ("service.engine",)),
    ("storage", ("service.storage",)),
    # The jobs' records and duties (store, progress, leases, callbacks, reconcile, presence): what
    # every domain uses to start, follow and report a job. They take what they need of a context as
    # a Protocol (service.jobs.ports), so the Context, which carries a job store, sits above them.
    ("the jobs' records", ("service.jobs",)),
    ("the Context", ("service.context",)),
    # The domains, one floor each, in the order of the pipeline: a domain imports only those below it.
    # ARCHITECTURE.md drew engrams above universes; the code's cut is the other way (a universe build
    # writes its members' engrams, and the engram files know nothing of universes), so engrams sit below.
    ("statistics", ("service.statistics",)),  # StatsKey, CollectionSpec, manifests, local copies, cover
    ("models", ("service.models",)),
    ("datasets", ("service.datasets",)),  # a file:// reference is checked like a model folder
    ("concepts", ("service.concepts",)),
    ("engrams", ("service.engrams",)),
    ("universes", ("service.universes",)),
    ("variants", ("service.variants",)),
    ("evaluation", ("service.evaluation",)),
    ("maps", ("service.maps",)),
    ("calibration", ("service.calibration",)),  # reads maps (module strengths) and builds variants
    # The kind -> body table, the state machine, the executors (embedded, Celery) and a process's
    # wiring: they run any job, so they sit above every body.
    ("execution", ("service.execution",)),
    ("the API and the workers", ("service.api", "service.console", "workers")),  # the console serves static files
    ("the entry point", ("service.cli",)),
    ("the fixtures of tests, bench and scripts", (FIXTURES,)),
)


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted name as written (absolute)
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool) -> Iterator[Import]:
    """Every import in ``source`` (top level or inside functions), relative ones made absolute."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import mod`` may name a submodule: record both, the checker resolves it.
            yield Import(module, base, node.lineno)
            for alias in node.names:
                yield Import(module, f"{base}.{alias.name}", node.lineno)


def collect(root: Path, packages: Iterable[str] = PACKAGES) -> tuple[list[Import], set[str]]:
    """The imports of every module under ``root``'s ``packages`` and the set of module names."""
    found: list[Import] = []
    modules: set[str] = set()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")) if (root / package).is_dir() else []:
            if {"build", "__pycache__"} & set(path.relative_to(root).parts):  # pip's build copies
                continue
            name = module_name(path, root)
            modules.add(name)
            found.extend(imports_of(path.read_text(encoding="utf-8"), name, path.name == "__init__.py"))
    return found, modules


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _resolve(name: str, modules: set[str]) -> str | None:
    """The repository module ``name`` refers to (the longest known prefix), else None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def violations(found: Iterable[Import], modules: set[str]) -> list[str]:
    """Each broken rule, as ``importer:line imports name (rule)``."""
    broken = []
    for imp in found:
        where = f"{imp.importer}:{imp.line} imports {imp.imported}"
        root = imp.imported.split(".")[0]
        if _within(imp.importer, "service.engine"):
            if root in ENGINE_FORBIDDEN:
                broken.append(f"{where} (the engine imports no web, queue, storage or HTTP code)")
            if _within(imp.imported, "service") and not _within(imp.imported, "service.engine"):
                broken.append(f"{where} (the engine imports nothing of the service outside the engine)")
        if _within(imp.importer, EXECUTION) and any(_within(imp.imported, domain) for domain in DOMAINS):
            broken.append(f"{where} (execution names no domain: name the body, helper or duty in service.execution.kinds)")
        if _within(imp.importer, "service.api") and _within(imp.imported, "service.engine"):
            broken.append(f"{where} (the API never imports the engine: that work is a job)")
        if _within(imp.importer, "service") and _within(imp.imported, "workers") and imp.importer not in ENTRY_POINTS:
            broken.append(f"{where} (nothing under service imports workers)")
        if imp.importer not in ENTRY_POINTS and _resolve(imp.imported, modules) in ENTRY_POINTS:
            broken.append(f"{where} (nothing imports the entry point)")
        if (_within(imp.importer, "service") or _within(imp.importer, "workers")) and root == FIXTURES:
            broken.append(f"{where} (the product never imports the fixtures: they are for tests, bench and scripts)")
        if _within(imp.importer, "api_schemas") and (
            root in ("service", "workers", "torch", "engram_client", FIXTURES) or root in ENGINE_FORBIDDEN
        ):
            broken.append(f"{where} (the wire contract imports pydantic and the standard library only)")
        client = next((p for p in CLIENT_PACKAGES if _within(imp.importer, p)), None)
        if client is not None and not _within(imp.imported, client):
            local = _resolve(imp.imported, modules)
            if (local is not None and not _within(local, "api_schemas")) or (
                local is None and root not in CLIENT_ALLOWED_THIRD_PARTY and not _is_stdlib(root)
            ):
                allowed = ", ".join(CLIENT_ALLOWED_THIRD_PARTY)
                broken.append(f"{where} (the client imports api_schemas, itself and {allowed})")
    return sorted(set(broken))


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of the longest name covering ``module``; None when none does."""
    best: tuple[int, int] | None = None  # (length of the name, layer)
    for layer, (_, names) in enumerate(LAYERS):
        for name in names:
            covers = module == name or (name != "service" and module.startswith(name + "."))
            if covers and (best is None or len(name) > best[0]):
                best = (len(name), layer)
    return None if best is None else best[1]


def upward_imports(found: Iterable[Import], modules: set[str]) -> list[str]:
    """Each import of a module of a higher layer, and each module of no layer (client code aside)."""
    broken = set()
    for module in modules:
        client = any(_within(module, p) for p in CLIENT_PACKAGES)
        if not client and layer_of(module) is None:
            broken.add(f"{module} has no layer (place it in LAYERS, where ARCHITECTURE.md puts it)")
    for imp in found:
        target = _resolve(imp.imported, modules)
        low, high = layer_of(imp.importer), layer_of(target) if target is not None else None
        if low is not None and high is not None and high > low:
            broken.add(
                f"{imp.importer}:{imp.line} imports {imp.imported} "
                f"({LAYERS[low][0]} -> {LAYERS[high][0]}, a layer above: dependencies point down)"
            )
    return sorted(broken)


def is_test_module(module: str) -> bool:
    return module.rsplit(".", 1)[-1].startswith("test_")


def imports_of_test_modules(found: Iterable[Import], modules: set[str]) -> list[str]:
    """Each import of a test module (``test_*.py``) by any other module, a conftest included."""
    broken = set()
    for imp in found:
        target = _resolve(imp.imported, modules)
        if target is not None and target != imp.importer and is_test_module(target):
            broken.add(
                f"{imp.importer}:{imp.line} imports {target} "
                "(no module imports a test module: move what they share to tests/helpers/)"
            )
    return sorted(broken)


def _is_stdlib(root: str) -> bool:
    import sys

    return root in sys.stdlib_module_names or root == "__future__"


def module_graph(found: Iterable[Import], modules: set[str]) -> dict[str, set[str]]:
    """Module -> the repository modules it imports (a package's ``__init__`` counts as itself)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in found:
        target = _resolve(imp.imported, modules)
        if target is not None and target != imp.importer and not _within(imp.importer, target):
            graph[imp.importer].add(target)
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_house_rules_hold() -> None:
    found, modules = collect(REPO)
    assert len(modules) > 50 and any(_within(m, "service.engine") for m in modules), "the checker read the packages"
    broken = violations(found, modules)
    assert not broken, "\n".join(broken)


def test_dependencies_point_down_the_layers() -> None:
    found, modules = collect(REPO)
    broken = upward_imports(found, modules)
    assert not broken, "\n".join(broken)


def test_no_import_cycles_between_service_modules() -> None:
    found, modules = collect(REPO)
    circles = cycles(module_graph(found, modules))
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_bench_scripts_and_fixtures_import_nothing_of_tests() -> None:
    """``bench/``, ``scripts/`` and ``engram_fixtures`` run without the suite (and the fixtures are
    installed): what they share with the tests lives in ``engram_fixtures``, never in ``tests/``."""
    found, modules = collect(REPO, ("bench", "scripts", "engram_fixtures"))
    assert any(_within(m, "bench") for m in modules) and any(_within(m, "scripts") for m in modules)
    broken = [f"{imp.importer}:{imp.line} imports {imp.imported}" for imp in found if _within(imp.imported, "tests")]
    assert not broken, "\n".join(broken)


def test_no_module_imports_a_test_module() -> None:
    found, modules = collect(REPO, TEST_IMPORTERS)
    assert sum(map(is_test_module, modules)) > 100, "the checker read the tests"
    broken = imports_of_test_modules(found, modules)
    assert not broken, "\n".join(broken)


def test_the_checker_catches_a_test_module_imported(tmp_path: Path) -> None:
    files = {
        "tests/__init__.py": "",
        "tests/helpers/__init__.py": "",
        "tests/helpers/api.py": "def assert_problem(): ...\n",
        "tests/api/__init__.py": "",
        "tests/api/conftest.py": "from tests.api.test_api import world\n",
        "tests/api/test_api.py": "from tests.helpers.api import assert_problem\nimport tests.api\n",
        "tests/api/test_callbacks.py": "from tests.api.test_api import assert_problem\n",
        "tests/api/test_pages.py": "def f():\n    from . import test_api\n",
        "tests/api/test_more.py": "import tests.api.test_api as api\nfrom .test_api import x\n",
        "bench/__init__.py": "",
        "bench/polling.py": "from tests.api.test_api import assert_problem\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found, modules = collect(tmp_path, ("tests", "bench"))
    broken = "\n".join(imports_of_test_modules(found, modules))
    for expected in (
        "tests.api.conftest:1 imports tests.api.test_api (no module imports a test module",
        "tests.api.test_callbacks:1 imports tests.api.test_api (",
        "tests.api.test_pages:2 imports tests.api.test_api (",
        "tests.api.test_more:1 imports tests.api.test_api (",
        "tests.api.test_more:2 imports tests.api.test_api (",
        "bench.polling:1 imports tests.api.test_api (",
    ):
        assert expected in broken, f"missing: {expected}\n{broken}"
    assert "tests.api.test_api:" not in broken, "a test module may import the helpers and packages"


def test_the_checker_catches_each_kind_of_violation(tmp_path: Path) -> None:
    files = {
        "service/__init__.py": "",
        "service/engine/__init__.py": "",
        "service/engine/pure.py": "import torch\nfrom service.engine import other\n",
        "service/engine/other.py": "def f():\n    import redis\n    from service.storage import x\n",
        "service/storage/__init__.py": "",
        "service/storage/base.py": "from ..jobs.store import y\n",
        "service/jobs/__init__.py": "",
        "service/jobs/store.py": "def g():\n    from service.storage.base import x\n",
        "service/execution/__init__.py": "",
        "service/execution/runner.py": "from service.concepts.collection import run_collection\n",
        "service/execution/kinds.py": "def body():\n    from service.universes import build\n",
        "service/execution/queues.py": "from service.jobs.store import y\nfrom service.context import Context\n",
        "service/jobs/submit.py": "from service.context import Context\n",
        "service/context.py": "from service.jobs.store import y\n",
        "service/concepts/__init__.py": "",
        "service/concepts/collection.py": "from service.storage.base import x\n",
        "service/concepts/service.py": "def submit():\n    from service.execution.runner import run_job\n",
        "service/concepts/views.py": "from service.variants.service import submit_variant\n",
        "service/variants/__init__.py": "",
        "service/variants/service.py": "from service.concepts.service import submit\n",
        "service/lonely.py": "",
        "service/api/__init__.py": "",
        "service/api/routes.py": "from service.engine.pure import z\nimport workers.celery_app\n",
        "api_schemas/__init__.py": "import torch\n",
        "service/client/__init__.py": "",
        "service/client/cli.py": "import typer\nimport api_schemas\nfrom service.jobs import g\nimport boto3\n",
        "workers/__init__.py": "",
        "workers/celery_app.py": "import service.cli\ndef h():\n    from engram_fixtures.demo import build_demo\n",
        "service/cli.py": "from workers.celery_app import app\nfrom engram_fixtures import demo\n",
        "engram_fixtures/__init__.py": "",
        "engram_fixtures/demo.py": "from service.engine.pure import z\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found, modules = collect(tmp_path)
    broken = "\n".join(violations(found, modules))
    for expected in (
        "service.engine.other:2 imports redis (the engine imports no web",
        "service.execution.runner:1 imports service.concepts.collection (execution names no domain",
        "service.execution.kinds:2 imports service.universes (execution names no domain",
        "service.engine.other:3 imports service.storage (the engine imports nothing of the service",
        "service.api.routes:1 imports service.engine.pure (the API never imports the engine",
        "service.api.routes:2 imports workers.celery_app (nothing under service imports workers)",
        "api_schemas:1 imports torch (the wire contract",
        "service.client.cli:3 imports service.jobs (the client imports api_schemas",
        "service.client.cli:4 imports boto3 (the client imports api_schemas",
        "workers.celery_app:1 imports service.cli (nothing imports the entry point)",
        "workers.celery_app:3 imports engram_fixtures.demo (the product never imports the fixtures",
        "service.cli:2 imports engram_fixtures (the product never imports the fixtures",
    ):
        assert expected in broken, f"missing: {expected}\n{broken}"
    assert "pure:1 imports torch" not in broken and "cli:1 imports typer" not in broken
    assert "cli:2 imports api_schemas" not in broken and "service.cli:1" not in broken
    assert "engram_fixtures.demo:1" not in broken, "the fixtures may import the service"
    assert "service.execution.queues" not in broken, "execution may import the jobs and the Context"
    upward = "\n".join(upward_imports(found, modules))
    for expected in (
        "service.storage.base:1 imports service.jobs.store (storage -> the jobs' records, a layer above",
        "service.concepts.service:2 imports service.execution.runner (concepts -> execution, a layer above",
        "service.concepts.views:1 imports service.variants.service (concepts -> variants, a layer above",
        "service.engine.other:3 imports service.storage (the engine -> storage, a layer above",
        "workers.celery_app:1 imports service.cli (the API and the workers -> the entry point",
        "service.lonely has no layer",
        "service.jobs.submit:1 imports service.context (the jobs' records -> the Context, a layer above",
        "service.cli:2 imports engram_fixtures (the entry point -> the fixtures of tests, bench and scripts",
    ):
        assert expected in upward, f"missing: {expected}\n{upward}"
    downward = ("service.execution.runner:", "service.concepts.collection:", "engram_fixtures.demo:", "service.variants.")
    assert not [line for line in upward.splitlines() if line.startswith(downward)], "imports that point down"
    assert "service.client" not in upward, "the client is checked by its own rule"
    # storage -> jobs at the top, jobs -> storage inside a function: a cycle all the same.
    assert sorted(cycles(module_graph(found, modules))) == [
        ["service.cli", "workers.celery_app"],
        ["service.jobs.store", "service.storage.base"],
    ]


def test_the_api_process_imports_no_job_body_and_no_transformers() -> None:
    """The API routes jobs and checks requests: the bodies (and transformers, behind them) load only
    where jobs run (issue 13: the API pod stays small). A fresh interpreter imports the app and the
    ``engram-service`` entry point and lists what came with them."""
    import subprocess
    import sys

    probe = (
        "import sys, service.cli, service.api.app\n"
        "bodies = ('service.execution.runner', 'service.concepts.collection', 'service.variants.build',"
        " 'service.universes.build', 'service.evaluation.run', 'service.calibration.build', 'service.maps.build',"
        " 'service.models.inspection', 'service.calibration.job', 'service.universes.helper_job')\n"
        "print(sorted(m for m in sys.modules if m in bodies or m == 'transformers' or m.startswith('transformers.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the API process imported: {done.stdout}"


def test_the_api_process_imports_no_torch(tmp_path: Path) -> None:
    """The API checks requests against registered layouts (layer names, LoRA and expert rules, a
    universe's projected bytes) and routes jobs: torch (160 MB of a 267 MB process, and a second of
    start-up), ``safetensors.torch`` and transformers load only where jobs run. A fresh interpreter
    imports every module of ``service.api`` (the app and each router) and the entry point, builds the
    app in both modes (embedded, and with a broker: what ``engram-service serve`` runs beside
    workers), and lists what came with them."""
    import subprocess
    import sys

    probe = f"""
import importlib, pkgutil, sys
import service.api, service.cli
from service.api.app import create_app
from service.config import Settings
for module in pkgutil.walk_packages(service.api.__path__, "service.api."):
    importlib.import_module(module.name)
for mode, broker in (("embedded", None), ("distributed", "redis://127.0.0.1:1/0")):
    root = {str(tmp_path)!r} + "/" + mode
    create_app(Settings(storage_url="file://" + root + "/storage", cache_dir=root + "/cache", broker_url=broker))
print(sorted(name for name in ("torch", "safetensors.torch", "transformers") if name in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the API process imported: {done.stdout}"


# ---------------------------------------------------------------- statistics keys spelled once
# Where statistics keys may be spelled: the package that owns them. What the service, the workers,
# the bench, the scripts and the fixtures need of a key they get from service.statistics.key.
STATS_KEY_OWNER = "service.statistics"
STATS_KEY_READERS = ("service", "workers", "bench", "scripts", "engram_fixtures")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of ``tree`` (prose may name the files; code may not)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def hand_spelled_stats_keys(source: str, module: str) -> Iterator[str]:
    """Each string in code (not a docstring) that spells ``statistics.safetensors`` or starts a
    ``stats/`` prefix, and each ``….split("/")[-2]`` (a prefix parsed back by hand)."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    prose |= {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if "statistics.safetensors" in node.value or node.value.startswith("stats/"):
                yield f"{module}:{node.lineno} spells {node.value!r}"
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and isinstance(head.value, str) and head.value.startswith("stats/"):
                yield f"{module}:{node.lineno} builds a statistics prefix with an f-string"
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call):
            call, index = node.value, node.slice
            splits_on_slash = (
                isinstance(call.func, ast.Attribute)
                and call.func.attr == "split"
                and len(call.args) == 1
                and isinstance(call.args[0], ast.Constant)
                and call.args[0].value == "/"
            )
            if splits_on_slash and ast.unparse(index) == "-2":
                yield f"{module}:{node.lineno} parses a key back with split('/')[-2]"


def stats_key_spellings(root: Path, packages: Iterable[str] = STATS_KEY_READERS) -> list[str]:
    """Every hand-spelled statistics key outside :data:`STATS_KEY_OWNER`."""
    broken: list[str] = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")) if (root / package).is_dir() else ():
            module = module_name(path, root)
            if not _within(module, STATS_KEY_OWNER):
                broken.extend(hand_spelled_stats_keys(path.read_text(), module))
    return [f"{b} (use service.statistics.key: StatsKey, statistics_key, manifest_key)" for b in broken]


def test_statistics_keys_are_spelled_only_in_service_statistics() -> None:
    assert (REPO / "service" / "statistics" / "key.py").is_file(), "the checker knows where the keys live"
    broken = stats_key_spellings(REPO)
    assert not broken, "\n".join(broken)


def test_the_checker_catches_a_hand_spelled_statistics_key(tmp_path: Path) -> None:
    files = {
        "service/statistics/key.py": 'STATISTICS_FILE = "statistics.safetensors"\nSTATS = "stats/"\n',
        "service/universes/a.py": 'def f(p):\n    return p + "statistics.safetensors"\n',
        "service/universes/b.py": 'def f(m, d, s):\n    return f"stats/{m}/{d}/{s}/"\n',
        "service/universes/c.py": 'def f(p):\n    return p.rstrip("/").split("/")[-2]\n',
        "bench/d.py": 'KEY = "stats/m/d/s/manifest.json"\n',
        "service/universes/fine.py": '"""Reads ``statistics.safetensors`` under ``stats/…/``."""\n\n'
        'def f(p):\n    """The ``stats/`` prefix\'s ``statistics.safetensors``."""\n    return p.split("/")[1]\n',
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    broken = "\n".join(stats_key_spellings(tmp_path))
    for expected in (
        "service.universes.a:2 spells 'statistics.safetensors'",
        "service.universes.b:2 builds a statistics prefix with an f-string",
        "service.universes.c:2 parses a key back with split('/')[-2]",
        "bench.d:1 spells 'stats/m/d/s/manifest.json'",
    ):
        assert expected in broken, f"missing: {expected}\n{broken}"
    lines = broken.splitlines()
    assert len(lines) == 4, "one finding each, an f-string's parts not again"
    assert not [line for line in lines if line.startswith(("service.statistics", "service.universes.fine"))], (
        "the owner may spell them, and prose may name them"
    )


# ARCHITECTURE.md: "a file over ~400 lines is usually two files, and none is over 500".
MAX_MODULE_LINES = 500


def long_modules(root: Path, package: str = "service", limit: int = MAX_MODULE_LINES) -> list[str]:
    """``<path>: <n> lines`` for every module of ``package`` under ``root`` longer than ``limit`` lines."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(root).as_posix()}: {lines} lines")
    return found


def test_no_service_module_is_over_500_lines(tmp_path: Path) -> None:
    assert long_modules(REPO) == [], "split these modules into cohesive ones"
    # the checker sees a module one line over the limit, and only that one
    (tmp_path / "service" / "sub").mkdir(parents=True)
    (tmp_path / "service" / "sub" / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "service" / "fits.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert long_modules(tmp_path) == [f"service/sub/big.py: {MAX_MODULE_LINES + 1} lines"]


# ARCHITECTURE.md: "none over 60 without a comment saying why" (a ``# long:`` comment in the
# function, or on the line above it).
MAX_FUNCTION_LINES = 60
LONG_MARK = "# long:"


def long_functions(root: Path, package: str = "service", limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``<path>:<line> <name> (<n> lines)`` for every function of ``package`` longer than ``limit``
    lines (its ``def`` through its last line) with no ``# long:`` comment saying why."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.end_lineno is None:
                continue
            length = node.end_lineno - node.lineno + 1
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            said = any(LONG_MARK in line for line in lines[max(0, first - 2) : node.end_lineno])
            if length > limit and not said:
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_service_function_is_over_60_lines_without_saying_why(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    source = (
        f"def fits():\n{body}\n\ndef over():\n{body}    return 0\n\n"
        f"# long: one table, read top to bottom\ndef said():\n{body}    return 0\n"
    )
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "m.py").write_text(source)
    over = source.splitlines().index("def over():") + 1
    # only the function one line over the limit that says nothing is found
    assert long_functions(tmp_path) == [f"service/m.py:{over} over ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions(REPO) == [], "shorten these functions, or say why with a '# long:' comment"
