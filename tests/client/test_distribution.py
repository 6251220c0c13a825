"""The client is a distribution of its own: it installs and runs without torch or any server code.

Two checks:
- in this environment, a subprocess whose import system refuses torch, transformers, celery,
  boto3, redis, fastapi and the server (``service``, ``workers``) imports ``engram_client`` and
  prints the CLI's help for the top level and every command group;
- in a fresh virtualenv (no system site packages), ``pip install ./api_schemas ./engram_client``
  installs the ``engram`` command, whose ``--help`` works, and torch is not installed. It needs the
  package index this machine's pip is configured with; without one it fails, saying so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REFUSED = ("torch", "transformers", "celery", "boto3", "redis", "fastapi", "service", "workers")
GROUPS = ("models", "concepts", "jobs", "variants")
COMMANDS = ("unlearn", "compose", "evaluate", "generate", "map", "calibrate")

_GUARDED_HELP = textwrap.dedent(
    """
    import sys

    REFUSED = {refused!r}

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in REFUSED:
                raise ImportError(f"the client imported {{name}}")
            return None

    sys.meta_path.insert(0, Refuse())
    from engram_client.cli import app

    for args in {argv!r}:
        try:
            app(args, prog_name="engram")
        except SystemExit as exit:
            if exit.code not in (0, None):
                raise
    """
)


def test_the_client_imports_no_server_code_and_no_torch() -> None:
    argv = [["--help"]] + [[group, "--help"] for group in GROUPS] + [[command, "--help"] for command in COMMANDS]
    script = _GUARDED_HELP.format(refused=REFUSED, argv=argv)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in (*GROUPS, *COMMANDS):
        assert name in done.stdout
    assert done.stdout.count("Usage: engram") == 1 + len(GROUPS) + len(COMMANDS)


@pytest.mark.slow
def test_a_fresh_virtualenv_installs_the_client_without_torch(tmp_path: Path) -> None:
    env_dir = tmp_path / "client-venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # Nothing of this environment may leak in: no PYTHONPATH (a test run from a checkout sets one).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    # Copies: pip builds in the source folder, and its build/ would land in the checkout.
    sources = [tmp_path / name for name in ("api_schemas", "engram_client")]
    for source in sources:
        shutil.copytree(REPO / source.name, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *map(str, sources)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, (
        "pip could not install the client into a fresh virtualenv (this test needs the package index "
        f"pip is configured with):\n{install.stdout[-2000:]}\n{install.stderr[-2000:]}"
    )
    helped = subprocess.run(
        [str(env_dir / "bin" / "engram"), "--help"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0 and "Usage: engram" in helped.stdout, helped.stderr[-2000:]
    probe = "import importlib.util as u; print([m for m in ('torch', 'celery', 'boto3', 'service') if u.find_spec(m)])"
    found = subprocess.run([str(python), "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == "[]", found.stdout + found.stderr
