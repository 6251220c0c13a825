"""The shapes of a dataset reference's URI: ``file://``, ``s3://`` and ``hf://datasets/…``.

Each function parses a URI and refuses one that breaks its scheme's rules with an
:class:`~service.errors.InvalidInput` naming what to change: a ``file://`` path outside the
dataset roots (links resolved) or naming no regular file, an ``s3://`` bucket that is not a bucket
name or not one ``ENGRAM_DATASET_BUCKETS`` lists, an ``hf://`` path with an empty or dot segment.
Nothing here opens or reads a dataset.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from urllib.parse import unquote, urlparse

from service.config import S3_BUCKET_NAME, S3_BUCKET_RULE, Settings
from service.errors import InvalidInput
from service.models.sources import file_uri_path

HF_DATASET = re.compile(r"^hf://datasets/([A-Za-z0-9._-]+/[A-Za-z0-9._-]+)(?:@([A-Za-z0-9._-]+))?/(.+)$")


def file_path(uri: str, roots: list[Path], *, strict: bool = False) -> Path:
    """The path of a ``file://`` reference, checked to lie inside ``roots`` (links resolved)."""
    raw = file_uri_path(uri, "file:// dataset")
    try:
        path = Path(raw).resolve(strict=strict)  # links resolved: one must not lead out of the roots
    except FileNotFoundError:
        raise InvalidInput(f"the dataset {raw} does not exist") from None
    except (OSError, RuntimeError) as exc:
        raise InvalidInput(f"the dataset {raw} cannot be resolved: {type(exc).__name__}") from None
    if not any(path == root or root in path.parents for root in roots):
        names = ", ".join(str(r) for r in roots) or "none configured"
        raise InvalidInput(f"{path} is outside ENGRAM_DATASET_ROOTS and ENGRAM_MODEL_ROOTS ({names})")
    return path


_FILE_TYPES = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
}


def not_regular(path: Path, info: os.stat_result) -> InvalidInput:
    """The refusal of a dataset path that is no regular file, naming what it is."""
    what = _FILE_TYPES.get(stat.S_IFMT(info.st_mode), "not a regular file")
    return InvalidInput(
        f"the dataset {path} is {what}: a dataset is a regular file (reading anything else can block "
        "or never end); give the path of a JSONL or Parquet file"
    )


def check_regular_file(path: Path) -> None:
    """Refuse a dataset path that names something other than a regular file, without opening it
    (opening a FIFO blocks until a writer comes; a device may never end). A path that does not
    exist yet passes: the job says so if it still does not."""
    try:
        info = os.stat(path)
    except OSError:
        return
    if not stat.S_ISREG(info.st_mode):
        raise not_regular(path, info)


def s3_key(uri: str) -> tuple[str, str]:
    """``(bucket, key)`` of an ``s3://`` reference whose bucket is a bucket name (S3's rule: what
    else botocore would refuse with an exception of its own, or send somewhere unexpected)."""
    parsed = urlparse(uri)
    key = unquote(parsed.path.lstrip("/"))
    if not parsed.netloc or not key or any(part in {"", ".", ".."} for part in key.split("/")):
        raise InvalidInput(f"an s3:// dataset is s3://bucket/key with no empty, '.' or '..' segment, got {uri!r}")
    if not S3_BUCKET_NAME.fullmatch(parsed.netloc):
        raise InvalidInput(f"{parsed.netloc!r} in {uri!r} is not an S3 bucket name: a bucket name is {S3_BUCKET_RULE}")
    return parsed.netloc, key


def allowed_s3_key(uri: str, settings: Settings) -> tuple[str, str]:
    """:func:`s3_key`, for a bucket ``ENGRAM_DATASET_BUCKETS`` lists and that is not the store's own.

    The service reads with its own credentials for whoever posts a reference, so only the listed
    buckets are read; the store's bucket never is, even when listed (the settings refuse that at
    start-up; a worker started with other settings refuses it here).
    """
    bucket, key = s3_key(uri)
    if bucket == settings.storage_bucket:
        raise InvalidInput(
            f"s3://{bucket} is this service's own store: datasets are never read from it; "
            "upload the records, or copy them to a bucket of ENGRAM_DATASET_BUCKETS"
        )
    allowed = settings.dataset_bucket_names
    if bucket not in allowed:
        listed = ", ".join(sorted(allowed)) if allowed else "none: s3:// datasets are off on this service"
        raise InvalidInput(
            f"the bucket {bucket!r} is not one s3:// datasets may name (ENGRAM_DATASET_BUCKETS: {listed}); "
            "upload the records, or ask the operator to list the bucket"
        )
    return bucket, key


def hf_parts(uri: str) -> tuple[str, str | None, str]:
    """``(repo, revision or None, path in the repo)`` of an ``hf://datasets/org/name[@revision]/path``."""
    match = HF_DATASET.match(uri)
    if match is None:
        raise InvalidInput(f"an hf:// dataset is hf://datasets/org/name[@revision]/path, got {uri!r}")
    repo, revision, path = match.group(1), match.group(2), match.group(3)
    if any(part in {"", ".", ".."} for part in path.split("/")) or any(p in {".", ".."} for p in repo.split("/")):
        raise InvalidInput(f"an hf:// dataset path has no empty, '.' or '..' segment, got {uri!r}")
    return repo, revision, path
