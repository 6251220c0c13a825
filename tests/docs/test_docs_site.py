"""``make docs`` builds the documentation site offline with ``--strict``, and a broken link fails it.

mkdocs (mkdocs.yml) reads docs/ as GitHub shows it; ``--strict`` turns its warnings into a failed
build: a link to a missing page or anchor, a page left out of the nav. scripts/mkdocs_hooks.py
checks the links that leave docs/ (README.md, CHANGELOG.md). Each build takes a few seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.helpers.doc_examples import REPO


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    mkdocs = REPO / ".venv" / "bin" / "mkdocs"
    assert mkdocs.exists(), "mkdocs is missing: `make install` installs the dev extras (mkdocs-material)"
    return subprocess.run(
        [str(mkdocs), "build", "--strict", "--config-file", str(root / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=root,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_site_builds_strict_and_offline(tmp_path: Path) -> None:
    done = build(REPO, tmp_path / "site")
    assert done.returncode == 0, done.stderr[-4000:]
    for page in ("index.html", "tutorial/index.html", "how-to/outputs/index.html", "API/index.html", "settings/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_a_broken_link_or_a_page_outside_the_nav_fails_the_build(tmp_path: Path) -> None:
    """The same build on a copy of the checkout's docs with one link broken."""
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    shutil.copytree(REPO / "docs", copy / "docs")
    for name in ("mkdocs.yml", "README.md", "CHANGELOG.md", "scripts/mkdocs_hooks.py"):
        shutil.copy2(REPO / name, copy / name)
    tutorial = copy / "docs" / "tutorial.md"
    tutorial.write_text(tutorial.read_text() + "\nSee [the missing page](how-to/nowhere.md).\n")
    done = build(copy, tmp_path / "site")
    assert done.returncode != 0 and "nowhere.md" in done.stderr, done.stderr[-4000:]

    shutil.copy2(REPO / "docs" / "tutorial.md", tutorial)
    (copy / "docs" / "orphan.md").write_text("# A page no nav lists\n")
    done = build(copy, tmp_path / "site")
    assert done.returncode != 0 and "orphan.md" in done.stderr, done.stderr[-4000:]
