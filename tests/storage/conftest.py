"""Fixtures for the storage tests (the S3 server and ``s3_env``: tests/conftest.py).

House rule: services in tests are real processes (see :mod:`tests.helpers.s3`).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A per-test directory for files to upload and download."""
    path = tmp_path / "scratch"
    path.mkdir()
    return path
