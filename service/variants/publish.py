"""Publishing a variant's files: moved into the store as written, with the digests taken while writing.

The writers (:mod:`service.engine.checkpoint_write`) hash each file as they write it; here each file
of the staging folder (:meth:`service.storage.base.Storage.staging_dir`) is moved under the
variant's key: a rename on ``file://`` storage. On S3 a safetensors file is uploaded *while* it is
written (:class:`UploadedWhileWritten`: its parts go out as the writer produces them) and published
here by completing that upload; the small files beside it are uploaded here. No byte is read back
to hash it (only a file whose writer recorded no digest is hashed: a peft adapter's), and none is
copied locally a second time.

A variant exists only once its manifest is published (last). What was published of its files
before a failure is removed again, so a failed job leaves nothing under the variant's key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from service.context import Context
from service.engine.checkpoint import file_sha256
from service.engine.checkpoint_write import WrittenFiles
from service.engine.safetensors_stream import HashingSink, WrittenFile
from service.storage.base import Storage, StreamedUpload
from service.storage.keys import variant_file_key, variant_files_prefix
from service.variants.manifest import VariantFile

log = logging.getLogger("engram.variants")


class UploadedWhileWritten(WrittenFiles):
    """A variant's written files whose safetensors files are also uploaded to the store as they are
    written, where the store has such uploads (S3; on ``file://`` publishing is a rename anyway)."""

    def __init__(self, storage: Storage, variant_id: str) -> None:
        super().__init__()
        self._storage, self._variant_id = storage, variant_id
        self.uploads: dict[str, StreamedUpload] = {}

    def sink(self, name: str) -> HashingSink:
        upload = self._storage.streamed_upload(variant_file_key(self._variant_id, name))
        if upload is None:
            return HashingSink()
        self.uploads[name] = upload
        return HashingSink(also=upload)

    def abort(self) -> None:
        """Drop every upload not completed (a failed write or publication: nothing may stay)."""
        for upload in self.uploads.values():
            upload.abort()


def publish_variant_files(
    ctx: Context, variant_id: str, out: Path, written: Mapping[str, WrittenFile]
) -> tuple[VariantFile, ...]:
    """Move every file of ``out`` under the variant's key; their paths, sizes and digests.

    Args:
        out: the staging folder the variant was written into (emptied: its files are moved).
        written: relative path -> size and sha256, as recorded while the file was written.

    Raises:
        RuntimeError: a file's size is not the size its writer recorded (it changed after it was written).
        Whatever the store raises; what was already published of the variant's files is then removed.
    """
    files = []
    try:
        for file in sorted(p for p in out.rglob("*") if p.is_file()):
            rel = file.relative_to(out).as_posix()
            recorded = written.get(rel) or WrittenFile(file.stat().st_size, file_sha256(file))
            if recorded.size != file.stat().st_size:
                raise RuntimeError(f"{rel} is {file.stat().st_size} bytes, its writer wrote {recorded.size}")
            upload = written.uploads.get(rel) if isinstance(written, UploadedWhileWritten) else None
            if upload is None:
                ctx.storage.move_file(variant_file_key(variant_id, rel), file)
            else:  # uploaded while written: published by completing the upload
                upload.complete(recorded.size)
                file.unlink()
            files.append(VariantFile(path=rel, size=recorded.size, sha256=recorded.sha256))
    except BaseException:
        if isinstance(written, UploadedWhileWritten):
            written.abort()
        discard_variant_files(ctx, variant_id)
        raise
    return tuple(files)


def discard_variant_files(ctx: Context, variant_id: str) -> None:
    """Remove the variant's published files (a failed publication's); a store that refuses is logged,
    not raised over the failure being handled (no manifest names them: nothing serves them)."""
    try:
        ctx.storage.delete_prefix(variant_files_prefix(variant_id))
    except Exception:
        log.exception("could not remove the files of the failed variant %s", variant_id)
