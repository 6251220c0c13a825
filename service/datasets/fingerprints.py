"""The cheap fingerprint of the content a dataset reference names now: a ``stat``, an S3 ``HEAD``
or the hub commit a revision resolves to, never the bytes.

A concept stores its reference's fingerprint when it is posted; the collection job opens the
source pinned to it (:mod:`service.datasets.sources`) and refuses content that changed since with
a 409 (:func:`changed_content`) naming what differs.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path
from typing import Any, TypedDict
from urllib.parse import urlparse

from service.config import Settings
from service.datasets.hf_cache import HF_CACHE
from service.datasets.uris import allowed_s3_key, file_path, hf_parts
from service.errors import Conflict
from service.storage.base import ObjectNotFound, StorageUnavailable

log = logging.getLogger(__name__)

COMMIT = re.compile(r"^[0-9a-f]{40}$")
HUB_TIMEOUT_S = 10.0  # resolving a revision at submission: a slow hub must not hold the request long
FINGERPRINT = "fingerprint"  # the key of a stored reference that holds its content's fingerprint


class Fingerprint(TypedDict, total=False):
    """What identifies a reference's content, taken without reading it: compared whole (any key
    that differs is other content) and shown key by key. Stored in the reference as this JSON.

    Which keys a fingerprint has says what it is of: a ``file://`` file's ``size``, ``mtime_ns`` and
    ``inode``; an S3 object's ``etag`` and ``size`` (and ``version_id`` in a versioned bucket); a hub
    file's ``commit``; an ImageFolder's ``files`` and ``listing`` (:func:`service.datasets.images.folder_fingerprint`).
    """

    size: int
    mtime_ns: int
    inode: int
    etag: str
    version_id: str
    commit: str
    files: int
    listing: str


def fingerprint_reference(reference: dict[str, Any], settings: Settings) -> Fingerprint | None:
    """What identifies the referenced content now, read without opening it.

    Returns:
        ``file://``: ``{"size", "mtime_ns", "inode"}``; ``s3://``: ``{"etag", "size"}`` plus
        ``"version_id"`` in a versioned bucket; ``hf://``: ``{"commit"}``, the commit the revision
        resolves to. ``None`` when the source cannot be looked at now (no such file or object, no
        access, a revision neither the hub nor the local cache resolves): the job reports what it
        finds, and a later post that gets a fingerprint counts as other content.

    Raises:
        StorageUnavailable: the S3 endpoint is unreachable (a 503: no one can tell what the content is).
    """
    uri = reference["uri"]
    scheme = urlparse(uri).scheme.lower()
    if scheme == "file":
        try:
            info = os.stat(file_path(uri, settings.dataset_root_paths))
        except OSError:
            return None
        return stat_fingerprint(info) if stat.S_ISREG(info.st_mode) else None
    if scheme == "s3":
        return _s3_fingerprint(uri, settings)
    repo, revision, _ = hf_parts(uri)
    commit = hub_commit(repo, revision, settings.cache_dir / HF_CACHE)
    return {"commit": commit} if commit is not None else None


def stat_fingerprint(info: os.stat_result) -> Fingerprint:
    """A local file's fingerprint from its ``stat``."""
    # Size and mtime change with any ordinary write; the inode changes when a file is replaced by a
    # rename (an editor's save, an atomic publish) even within one mtime tick.
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "inode": info.st_ino}


def _s3_fingerprint(uri: str, settings: Settings) -> Fingerprint | None:
    from service.storage.s3 import BucketNotFound, S3CredentialsMissing, make_s3_client

    bucket, key = allowed_s3_key(uri, settings)
    try:
        return head_fingerprint(head_object(make_s3_client(settings.s3_endpoint_url), bucket, key))
    except (ObjectNotFound, BucketNotFound, S3CredentialsMissing):  # the job reads it, or says why not
        return None
    except StorageUnavailable:
        raise
    except RuntimeError:  # access denied and the other 4xx answers: the job says which
        return None


def head_object(client: Any, bucket: str, key: str, **pin: str) -> dict[str, Any]:
    """An S3 ``HEAD``, its errors translated as storage translates them (404: ObjectNotFound, …)."""
    from service.storage.s3 import _errors_translated

    with _errors_translated(key):
        return dict(client.head_object(Bucket=bucket, Key=key, **pin))


def head_fingerprint(head: dict[str, Any]) -> Fingerprint:
    """An S3 object's fingerprint from its ``HEAD`` answer."""
    found: Fingerprint = {"etag": head["ETag"], "size": int(head["ContentLength"])}
    # "null" names the version an unversioned write overwrites in place: not a version to pin.
    if head.get("VersionId") and head["VersionId"] != "null":
        found["version_id"] = head["VersionId"]
    return found


def hub_commit(repo: str, revision: str | None, cache: Path) -> str | None:
    """The commit a hub dataset's revision resolves to (``None``: the default branch).

    A 40-hex revision is a commit already (no call). Otherwise the hub's answer, and when the hub
    cannot answer (offline, unreachable, an unknown repository or revision) the commit the local
    hub cache last resolved it to, which is what an offline download reads; ``None`` when neither tells.
    """
    if revision is not None and COMMIT.fullmatch(revision):
        return revision
    try:
        from huggingface_hub import HfApi

        sha = HfApi().dataset_info(repo, revision=revision, timeout=HUB_TIMEOUT_S).sha
        if sha is not None and COMMIT.fullmatch(sha):
            return sha
    except Exception as exc:  # the hub client raises many types (offline mode, HTTP errors, timeouts)
        log.info("cannot resolve %s@%s on the hub (%s): trying the local cache", repo, revision, type(exc).__name__)
    ref = cache / f"datasets--{repo.replace('/', '--')}" / "refs" / (revision or "main")
    try:
        cached = ref.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return cached if COMMIT.fullmatch(cached) else None


def changed_content(uri: str, when: str, then: Fingerprint, now: Fingerprint | None = None) -> Conflict:
    """The 409 of content that is not the content fingerprinted, showing both fingerprints."""

    def shown(fingerprint: Fingerprint) -> str:
        return ", ".join(f"{k} {v}" for k, v in fingerprint.items())

    seen = f"{shown(then)} then" + (f"; {shown(now)} now" if now is not None else "")
    return Conflict(f"the dataset {uri} changed {when} ({seen}): post the concept again to collect its new content")
