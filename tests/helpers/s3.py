"""A real S3 server for tests: SeaweedFS, started by :mod:`engram_fixtures.seaweed` (shared with
``bench.e2e --mode distributed``), and the test-sized S3 storage the storage tests use.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from engram_fixtures.seaweed import (
    SeaweedServer,
    aws_env,
    drop_bucket,
    new_bucket,
    restart_seaweed,
    start_seaweed,
    stop_seaweed,
    weed_binary,
)

if TYPE_CHECKING:  # the service is imported where used
    from service.storage.s3 import S3Storage

__all__ = [
    "PAGE",
    "PART",
    "MiB",
    "SeaweedServer",
    "aws_env",
    "drop_bucket",
    "new_bucket",
    "restart_seaweed",
    "s3_storage",
    "start_seaweed",
    "stop_seaweed",
    "weed_binary",
]

MiB = 1024 * 1024
PART = 5 * MiB  # S3's smallest multipart part: the threshold the storage tests use
PAGE = 7  # keys per S3 list page in the storage tests, so 30 keys take 5 pages


def s3_storage(server: SeaweedServer, bucket: str, **options: Any) -> S3Storage:
    """An S3Storage under a fresh prefix of ``bucket``, with test-sized parts and pages."""
    from service.storage.s3 import S3Storage

    options = {"multipart_threshold": PART, "multipart_chunksize": PART, "page_size": PAGE, **options}
    return S3Storage(server.client(), bucket, f"run-{uuid.uuid4().hex[:8]}/", **options)
