"""Fixtures for the storage tests (the S3 server and ``s3_env``: tests/conftest.py).

House rule: services in tests are real processes (see :mod:`tests.helpers.s3`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.storage.base import Storage
from service.storage.local import LocalStorage
from service.storage.s3 import S3Storage
from tests.helpers.s3 import SeaweedServer, s3_storage


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A per-test directory for files to upload and download."""
    path = tmp_path / "scratch"
    path.mkdir()
    return path


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """Each backend in turn, empty."""
    if request.param == "local":
        return LocalStorage(tmp_path / "store")
    server: SeaweedServer = request.getfixturevalue("seaweed")
    return s3_storage(server, request.getfixturevalue("s3_bucket"))


@pytest.fixture
def s3(seaweed: SeaweedServer, s3_bucket: str) -> S3Storage:
    """The S3 backend alone, empty."""
    return s3_storage(seaweed, s3_bucket)
