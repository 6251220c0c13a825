"""The storage backend named by ``ENGRAM_STORAGE_URL``: ``file://`` here, ``s3://`` from :mod:`service.storage_s3`.

Apart from :mod:`service.storage` (the interface and the local backend), which the S3 backend
builds on: choosing between them there made the two modules import each other.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from service.storage import LocalStorage, Storage


def open_storage(storage_url: str, s3_endpoint_url: str | None = None) -> Storage:
    """The backend named by ``ENGRAM_STORAGE_URL``."""
    parsed = urlparse(storage_url)
    if parsed.scheme == "file":
        return LocalStorage(Path(parsed.path))
    if parsed.scheme == "s3":
        from service.storage_s3 import S3Storage  # boto3 is imported only by deployments that use S3

        return S3Storage.from_url(storage_url, s3_endpoint_url)
    raise ValueError(f"storage backend {parsed.scheme!r} is not available in this build")
