"""Fixtures for backend tests: a real SeaweedFS S3 server for the session, a fresh bucket per module.

House rule: services in tests are real processes (see :mod:`tests.s3`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.s3 import SeaweedServer


@pytest.fixture
def s3_env(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> SeaweedServer:
    """The server's ``AWS_*`` credentials in ``os.environ`` for one test (what the service reads)."""
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    return seaweed


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A per-test directory for files to upload and download."""
    path = tmp_path / "scratch"
    path.mkdir()
    return path
