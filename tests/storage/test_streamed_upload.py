"""An S3 object uploaded while its file is written (issue 27: one pass over the bytes on S3 too).

:class:`service.storage.s3.S3StreamedUpload` is told a file's bytes as the writer produces them,
cuts them into parts and sends them at once; the object appears only when :meth:`complete` finishes
the multipart upload, and :meth:`abort` leaves no object and no unfinished upload. Checked against
SeaweedFS (signatures checked): the stored bytes are compared with what was told, byte for byte.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.storage.local import LocalStorage
from service.storage.s3 import S3Storage
from tests.helpers.s3 import PART

KEY = "variants/v1/files/model.safetensors"


def _unfinished_uploads(s3: S3Storage) -> list[str]:
    """Keys of the multipart uploads started under the store's prefix and not completed or aborted."""
    response = s3.client.list_multipart_uploads(Bucket=s3.bucket, Prefix=s3.prefix)
    return [upload["Key"] for upload in response.get("Uploads", [])]


def _tell(upload: object, data: bytes, sizes: list[int]) -> None:
    """Feed ``data`` in buffers of the given sizes, in turn (a cycle), as a writer would."""
    offset, k = 0, 0
    while offset < len(data):
        size = sizes[k % len(sizes)]
        upload.update(memoryview(data)[offset : offset + size])  # type: ignore[attr-defined]
        offset, k = offset + size, k + 1


@pytest.mark.parametrize("total", [0, 1234, PART, 3 * PART + 17])
def test_the_object_is_exactly_the_bytes_told_and_appears_only_when_completed(s3: S3Storage, total: int) -> None:
    data = os.urandom(total)
    upload = s3.streamed_upload(KEY)
    _tell(upload, data, [PART // 3 + 5, 1, 2 * PART + 11, 4096])  # buffers that straddle the parts
    assert not s3.exists(KEY), "nothing is visible before the upload completes"
    upload.complete(total)
    assert s3.get_bytes(KEY) == data
    assert _unfinished_uploads(s3) == []


def test_an_aborted_upload_leaves_no_object_and_no_unfinished_upload(s3: S3Storage) -> None:
    upload = s3.streamed_upload(KEY)
    _tell(upload, os.urandom(3 * PART), [PART // 2])  # parts already sent when the writer fails
    upload.abort()
    upload.abort()  # twice is fine (a failed write, then the publication's cleanup)
    assert not s3.exists(KEY)
    assert _unfinished_uploads(s3) == []


def test_a_size_that_differs_from_what_was_told_is_refused_and_publishes_nothing(s3: S3Storage) -> None:
    upload = s3.streamed_upload(KEY)
    _tell(upload, os.urandom(2 * PART + 3), [PART])
    with pytest.raises(RuntimeError, match="were uploaded, the file holds"):
        upload.complete(2 * PART + 4)
    upload.abort()
    assert not s3.exists(KEY)
    assert _unfinished_uploads(s3) == []


@pytest.mark.fast
def test_file_storage_publishes_by_rename_and_has_no_streamed_upload(tmp_path: Path) -> None:
    assert LocalStorage(tmp_path / "store").streamed_upload(KEY) is None
