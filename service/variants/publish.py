"""Publishing a variant's files: moved into the store as written, with the digests taken while writing.

The writers (:mod:`service.engine.checkpoint_write`) hash each file as they write it; here each file
of the staging folder (:meth:`service.storage.base.Storage.staging_dir`) is moved under the
variant's key: a rename on ``file://`` storage, an upload of the file as written on S3. No byte is
read back to hash it (only a file whose writer recorded no digest is hashed: a peft adapter's), and
none is copied locally a second time.

A variant exists only once its manifest is published (last). What was published of its files
before a failure is removed again, so a failed job leaves nothing under the variant's key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from service.context import Context
from service.engine.checkpoint import file_sha256
from service.engine.safetensors_stream import WrittenFile
from service.storage.keys import variant_file_key, variant_files_prefix
from service.variants.manifest import VariantFile

log = logging.getLogger("engram.variants")


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
            ctx.storage.move_file(variant_file_key(variant_id, rel), file)
            files.append(VariantFile(path=rel, size=recorded.size, sha256=recorded.sha256))
    except BaseException:
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
