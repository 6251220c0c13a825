"""The walk-through modules' fixtures: a folder laid out as a clone after ``make demo``
(tests/helpers/walkthrough.py) and a live server of the module's own whose model root is that
clone's ``demo/``, as ``make run`` serves it.

A module whose page builds its own model there overrides ``clone`` (tests/docs/test_readme_images.py:
an empty ``demo/``); the server follows whichever ``clone`` the module has.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engram_fixtures.live import LiveServer, running_server
from tests.helpers.walkthrough import clone_like, model_root


@pytest.fixture(scope="module")
def clone(mini_tofu_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clone after ``make demo``: ``demo/`` is the session's mini-TOFU demo, ``.venv`` this checkout's."""
    return clone_like(tmp_path_factory.mktemp("clone"), mini_tofu_demo)


@pytest.fixture(scope="module")
def server(clone: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The real server (embedded, file storage of its own) serving ``clone``'s ``demo/``."""
    with running_server(tmp_path_factory.mktemp("server"), model_root(clone)) as live:
        yield live
