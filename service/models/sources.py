"""Where model checkpoints come from: ``file://`` (inside ENGRAM_MODEL_ROOTS), ``s3://`` and ``hf://``.

Every source ends as a local folder that must pass :mod:`service.engine.model_files`' rules: no
top-level link leading out of it (for a hub snapshot, out of its cache repo's ``blobs/``), plain
shard names. A downloaded folder is checked here, as soon as it is fetched or reused; every folder
is checked again when it is inspected and whenever a job reads it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlparse

from service.config import Settings
from service.engine.model_files import ModelSourceError, allowed_dirs, check_links
from service.errors import InvalidInput
from service.storage.base import ObjectNotFound, Storage, StorageUnavailable

HF_PATTERN = re.compile(r"^hf://([A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)?)(?:@([A-Za-z0-9._/-]+))?$")
# hf://org/name/<path>.gguf[@revision]: one GGUF file of a repo (GGUF repos hold one file per quantization)
HF_FILE_PATTERN = re.compile(
    r"^hf://([A-Za-z0-9._-]+/[A-Za-z0-9._-]+)/((?:[A-Za-z0-9._-]+/)*[A-Za-z0-9._-]+\.gguf)(?:@([A-Za-z0-9._/-]+))?$"
)
GGUF_SUFFIX = ".gguf"
# Only what a variant needs: weights, configs, tokenizer. Pickle files are never fetched.
HF_ALLOW = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]
# Refused even where an allowed pattern matches (``tokenizer.bin``): loading them would run pickle.
PICKLE_DENY = ["*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt"]


def local_model_dir(source: str, model_roots: list[Path], cache_dir: Path, s3_endpoint_url: str | None = None) -> Path:
    """The local directory holding the checkpoint named by ``source`` (a remote GGUF model: the
    folder holding its ``.gguf``, or for ``hf://org/name/<file>.gguf`` the file itself; which file
    is read by :func:`service.models.gguf_source.gguf_file_in`).

    Args:
        source: ``file:///abs/dir``, ``s3://bucket/prefix/`` (or ``…/<file>.gguf``),
            ``hf://org/name[@revision]`` or ``hf://org/name/<file>.gguf[@revision]``.
        model_roots: the directories ``file://`` sources must lie in.
        cache_dir: where downloaded checkpoints are kept (``s3/`` and ``hf/`` below it).
        s3_endpoint_url: the S3-compatible endpoint for ``s3://`` sources (``None``: AWS).

    Raises:
        InvalidInput: unknown scheme, a path outside the allowed roots, an unreachable hub, an
            ``s3://`` prefix without model files or that cannot be read.
        StorageUnavailable: the S3 endpoint cannot be reached right now (a 503: retry later).
    """
    scheme = urlparse(source).scheme
    if scheme == "file":
        return _file_source(source, model_roots)
    if scheme == "hf":
        return _hf_source(source, cache_dir)
    if scheme == "s3":
        return _s3_source(source, cache_dir, s3_endpoint_url)
    raise InvalidInput(f"source must be file:///abs/dir, s3://bucket/prefix/ or hf://org/name, got {source!r}")


def is_remote(source: str) -> bool:
    """Whether registering ``source`` downloads it (``s3://``, ``hf://``): a job's work, not a request's."""
    return urlparse(source).scheme in {"s3", "hf"}


def check_remote_source(source: str) -> None:
    """Refuse (422) an ``s3://`` or ``hf://`` source that is not well formed, without reaching it."""
    scheme = urlparse(source).scheme
    if scheme == "hf":
        _hf_repo(source)
    elif scheme == "s3":
        _s3_location(source)


def check_model_bucket(source: str, settings: Settings) -> None:
    """Refuse (422) an ``s3://`` model whose bucket ``ENGRAM_MODEL_BUCKETS`` does not list, or that is
    the store's own bucket, before anything is listed or downloaded; other schemes pass.

    The service reads with its own credentials for whoever registers a model, and every key may
    then download the weights in a variant, so only the listed buckets are read. The store's bucket
    never is, even when listed (the settings refuse that at start-up; a worker started with other
    settings refuses it here): its statistics and variants must not become a model anyone reads back.
    """
    if urlparse(source).scheme != "s3":
        return
    bucket, _ = _s3_location(source)
    if bucket == settings.storage_bucket:
        raise InvalidInput(
            f"{source!r} lies in s3://{bucket}, the bucket of the service's own store ({settings.storage_url}, "
            "ENGRAM_STORAGE_URL), which is never a model source: upload the checkpoint to a bucket of "
            "ENGRAM_MODEL_BUCKETS"
        )
    allowed = settings.model_bucket_names
    if bucket not in allowed:
        listed = ", ".join(sorted(allowed)) if allowed else "none: s3:// models are off on this service"
        raise InvalidInput(
            f"the bucket {bucket!r} is not one s3:// models may be registered from (ENGRAM_MODEL_BUCKETS: "
            f"{listed}); copy the checkpoint to a listed bucket, register it from file:// or hf://, or ask "
            "the operator to add the bucket to ENGRAM_MODEL_BUCKETS"
        )


def _hf_repo(source: str) -> tuple[str, str | None, str | None]:
    """``hf://org/name[/<file>.gguf][@revision]`` -> (repo, file or None, revision); a 422 for anything else."""
    file_match = HF_FILE_PATTERN.match(source)
    if file_match is not None:
        return file_match.group(1), file_match.group(2), file_match.group(3)
    match = HF_PATTERN.match(source)
    if match is None:
        raise InvalidInput(
            f"hf:// source must be hf://org/name[@revision] or hf://org/name/<file>.gguf[@revision], got {source!r}"
        )
    return match.group(1), None, match.group(2)


def _s3_location(source: str) -> tuple[str, str]:
    """``s3://bucket/prefix/`` -> (bucket, prefix); a 422 for anything else."""
    from service.storage.s3 import parse_s3_url

    try:
        return parse_s3_url(source)
    except ValueError:
        raise InvalidInput(f"s3:// source must be s3://bucket/prefix/, got {source!r}") from None


def file_uri_path(uri: str, what: str) -> str:
    """The local path a ``file://`` URI names, before any link is resolved: absolute, no ``..``,
    no NUL, no host. ``what`` names the URI in the 422 (``"file:// source"``)."""
    parsed = urlparse(uri)
    if parsed.netloc not in {"", "localhost"}:
        raise InvalidInput(f"{what}s must be local paths, got host {parsed.netloc!r}")
    raw = unquote(parsed.path)
    if "\x00" in raw:
        raise InvalidInput(f"{what} contains a NUL byte")
    if not raw.startswith("/") or ".." in PurePosixPath(raw).parts:
        raise InvalidInput(f"{what} must be an absolute path without '..', got {raw!r}")
    return raw


def _file_source(source: str, model_roots: list[Path]) -> Path:
    raw = file_uri_path(source, "file:// source")
    path = Path(raw).resolve()  # symlinks resolved: a link must not lead out of the roots
    if not _within(path, model_roots):
        raise InvalidInput(outside_roots_message(path, model_roots))
    if not path.is_dir():
        raise InvalidInput(f"{path} is not a directory")
    # A hub cache snapshot's files may link into its repo's blobs/ (model_files' policy): only
    # when that directory is inside the roots too.
    if not all(_within(d, model_roots) for d in allowed_dirs(path)):
        raise InvalidInput(outside_roots_message(path, model_roots, what="is a hub cache snapshot whose blobs/ is"))
    return path


def outside_roots_message(path: Path, model_roots: list[Path], what: str = "is") -> str:
    """Why a ``file://`` model is refused, and the two ways to fix it: ``ENGRAM_MODEL_ROOTS`` is the
    server's setting (the operator's), not a field of the request, so a user needs to be told so."""
    roots = ", ".join(str(r) for r in model_roots) or "none (the setting is empty)"
    return (
        f"{path} {what} outside the folders this server may read models from: its ENGRAM_MODEL_ROOTS "
        f"setting (a server setting, not a request field), now {roots}. Put the model under one of "
        "those folders, or ask the server's operator to add its folder to ENGRAM_MODEL_ROOTS (a "
        "colon-separated list) and restart the server; or register it from s3:// or hf:// instead"
    )


def _within(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _checked_download(path: Path, cache: Path, source: str) -> Path:
    """``path`` after checking it lies in ``cache`` and has no link leading out of it (a hub
    snapshot: out of its repo's ``blobs/``)."""
    if not _within(path.resolve(), [cache.resolve()]):
        raise InvalidInput(f"the download of {source} is outside the cache directory")
    try:
        check_links(path)
    except ModelSourceError as exc:
        raise InvalidInput(f"{source}: {exc}") from None
    return path


def _hf_source(source: str, cache_dir: Path) -> Path:
    repo_id, filename, revision = _hf_repo(source)
    hub = str(cache_dir / "hf")
    try:
        from huggingface_hub import hf_hub_download, snapshot_download

        if filename is not None:  # one GGUF file of the repo, linked from its snapshot into blobs/
            path = Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=hub))
            if not _within(path.resolve(), [(cache_dir / "hf").resolve()]):
                raise InvalidInput(f"the download of {source} is outside the cache directory")
            return path
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HF_ALLOW, cache_dir=hub))
        if not (path / "config.json").exists():  # no checkpoint: a repo of one GGUF file?
            _hf_fetch_gguf(repo_id, revision, hub)
    except InvalidInput:
        raise
    except Exception as exc:  # the hub client raises many types (offline, 404, gated)
        raise InvalidInput(f"cannot fetch {repo_id} from the Hugging Face hub: {exc}") from None
    if not path.is_dir():  # nothing the allow-list takes, and no single GGUF either
        raise InvalidInput(f"{source} holds no model files (config, safetensors weights, tokenizer, or one GGUF)")
    return _checked_download(path, cache_dir / "hf", source)


def _hf_fetch_gguf(repo_id: str, revision: str | None, hub: str) -> None:
    """Download the one ``.gguf`` of a hub repo into its snapshot; several are a 422 naming them (a
    GGUF repo holds one file per quantization: a source names the one it means). Offline, the
    snapshot is what the cache holds: the listing is skipped."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.constants import HF_HUB_OFFLINE

    if HF_HUB_OFFLINE:
        return
    files = [name for name in HfApi().list_repo_files(repo_id, revision=revision) if name.endswith(GGUF_SUFFIX)]
    if len(files) > 1:
        raise InvalidInput(
            f"hf://{repo_id} holds several GGUF files ({', '.join(sorted(files))}) and no config.json: "
            f"register one of them as hf://{repo_id}/<file>.gguf"
        )
    if files:
        hf_hub_download(repo_id, files[0], revision=revision, cache_dir=hub)


def _wanted(relative: str) -> bool:
    """Whether a file of a model directory is fetched: weights, configs, tokenizer; never pickle."""
    name = relative.rsplit("/", 1)[-1]
    if any(fnmatch(name, pattern) for pattern in PICKLE_DENY):
        return False
    return any(fnmatch(relative, pattern) for pattern in HF_ALLOW)


def _safe_relative(relative: str) -> bool:
    """A key below the prefix that maps to a path inside the download directory."""
    return (
        bool(relative) and not relative.startswith("/") and all(part not in {"", ".", ".."} for part in relative.split("/"))
    )


def _s3_source(source: str, cache_dir: Path, endpoint_url: str | None) -> Path:
    """Download the model files under an ``s3://bucket/prefix/`` once; later calls reuse the copy.

    The copy is keyed by the SHA-256 of the (normalised) URL and built in a temporary directory that
    is renamed into place, so a crash or a concurrent registration never leaves a half-copied model
    where the next call would take it for a whole one.
    """
    from service.storage.s3 import BucketNotFound, S3Storage, make_s3_client

    bucket, prefix = _s3_location(source)
    gguf_key = prefix.rstrip("/") if prefix.rstrip("/").endswith(GGUF_SUFFIX) else None
    if gguf_key is not None:  # one GGUF file: downloaded alone, into a folder of its own
        prefix = gguf_key.rpartition("/")[0] + "/" if "/" in gguf_key else ""
    normalised = f"s3://{bucket}/{gguf_key}" if gguf_key is not None else f"s3://{bucket}/{prefix}"
    root = cache_dir / "s3"
    target = root / hashlib.sha256(normalised.encode()).hexdigest()
    if target.is_dir():
        return _checked_download(target, root, normalised)
    store = S3Storage(make_s3_client(endpoint_url), bucket, prefix)
    try:
        keys = [gguf_key.rpartition("/")[2]] if gguf_key is not None else _s3_model_keys(store.list(""), normalised)
        if not keys:
            raise InvalidInput(f"{normalised} holds no model files (config, safetensors weights, tokenizer, or one GGUF)")
        root.mkdir(parents=True, exist_ok=True)
        return _checked_download(_publish_download(store, keys, root, target), root, normalised)
    except (BucketNotFound, ObjectNotFound) as exc:  # a typo in the source, not an outage
        raise InvalidInput(f"cannot read {normalised}: {exc!s}") from None
    except StorageUnavailable:
        raise  # the endpoint is down or failing: a 503, worth a retry
    except RuntimeError as exc:  # access denied and the other 4xx answers
        raise InvalidInput(f"cannot read {normalised}: {exc}") from None


def _s3_model_keys(listed: list[str], normalised: str) -> list[str]:
    """The keys of a prefix to download: the checkpoint's files; where there is no ``config.json``,
    the one ``.gguf`` beside them (several: a 422 naming them, as a local folder of several is)."""
    keys = [k for k in listed if _safe_relative(k) and _wanted(k)]
    if "config.json" in keys:
        return keys
    ggufs = sorted(k for k in listed if "/" not in k and _safe_relative(k) and k.endswith(GGUF_SUFFIX))
    if len(ggufs) > 1:
        raise InvalidInput(
            f"{normalised} holds several GGUF files ({', '.join(ggufs)}) and no config.json: register one of "
            f"them as {normalised}<file>.gguf"
        )
    return keys + ggufs


def _publish_download(store: Storage, keys: list[str], root: Path, target: Path) -> Path:
    """Download ``keys`` into a fresh directory beside ``target`` and rename it to ``target``."""
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    try:
        for key in keys:
            path = partial / key
            if not _within(path.resolve(), [partial.resolve()]):  # _safe_relative checked it; again, as a writer
                raise InvalidInput(f"the key {key!r} would be downloaded outside its directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            store.download(key, path)
        try:
            os.rename(partial, target)
        except OSError:
            if not target.is_dir():  # not a concurrent download that finished first
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target
