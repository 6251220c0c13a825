"""``make install`` prints no setuptools notices (issue 28): its editable installs of the three
distributions (the root, api_schemas/, engram_client/), run as the Makefile's recipe writes them, into a
scratch virtual environment (``--no-deps``: the project's dependencies are not what prints them)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from engram_fixtures.live import REPO_ROOT

pytestmark = pytest.mark.slow


def editable_installs(python: Path, venv: Path) -> list[str]:
    """The recipe's ``pip install -e`` lines for a virtual environment at ``venv`` (``make -n``: printed, not run)."""
    printed = subprocess.run(
        ["make", "-n", "-B", "install", f"PY={python}", f"VENV={venv}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [line for line in printed.splitlines() if " -e " in line and "pip install" in line]


def test_the_editable_installs_print_no_warning(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # The project's own pip (the version `make install` upgrades to, which shows a backend's warnings
    # even with -q), lent to the scratch environment rather than installed into it.
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "pip").symlink_to(Path(sysconfig.get_paths()["purelib"]) / "pip")

    commands = editable_installs(python, venv)
    assert len(commands) == 2 and sum(line.count(" -e ") for line in commands) == 3, commands
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    for command in commands:
        done = subprocess.run(
            f"{command} --no-deps", shell=True, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr
        printed = done.stdout + done.stderr
        assert "warning" not in printed.lower(), f"{shlex.quote(command)} printed:\n{printed}"
    imported = subprocess.run(
        [python, "-c", "import api_schemas, engram_client, service; print('ok')"], capture_output=True, text=True
    )
    # The imports need the dependencies, left out here: what counts is that the finder maps the names.
    assert (
        "No module named 'api_schemas'" not in imported.stderr and "No module named 'engram_client'" not in imported.stderr
    )
    assert "No module named 'service'" not in imported.stderr
