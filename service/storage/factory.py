"""The storage backend named by ``ENGRAM_STORAGE_URL``: ``file://`` (:mod:`service.storage.local`)
or ``s3://`` (:mod:`service.storage.s3`, imported only by deployments that use S3).

Apart from :mod:`service.storage.base`, which both backends build on: choosing between them there
made the interface and the S3 backend import each other.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from service.storage.base import Storage
from service.storage.local import LocalStorage


def open_storage(storage_url: str, s3_endpoint_url: str | None = None) -> Storage:
    """The backend named by ``ENGRAM_STORAGE_URL``."""
    parsed = urlparse(storage_url)
    if parsed.scheme == "file":
        return LocalStorage(Path(parsed.path))
    if parsed.scheme == "s3":
        from service.storage.s3 import S3Storage  # boto3 is imported only by deployments that use S3

        return S3Storage.from_url(storage_url, s3_endpoint_url)
    raise ValueError(f"storage backend {parsed.scheme!r} is not available in this build")
