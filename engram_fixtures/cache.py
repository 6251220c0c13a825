"""A content-keyed folder cache for built fixtures (trained demo models, the mini-CIFAR), shared by
every process that builds one: each distinct build is trained once per cache.

An entry is a folder ``<cache>/<name>-<key>``: the key hashes what was asked (the parameters), the
source of the code that builds it and the torch/transformers versions (:func:`cache_key`), so a
change of recipe or library is a new entry, never a stale one. :func:`cached_build`:

- finds a complete entry and returns it (nothing trained); complete means its ``.complete`` manifest
  is there and every file it lists has the listed size and SHA-256, so a partial or corrupt entry
  (a crash during a copy, a file edited in place) is removed and rebuilt;
- otherwise takes the entry's lock (``fcntl.flock`` on ``<cache>/.<name>-<key>.lock``): a second
  process asking for the same entry waits for the first one's build instead of training it again,
  then finds it complete;
- builds into a temporary folder beside the entry and renames it into place: a reader never sees
  half an entry.

Entries are read-only to their users: a test that must write beside a model copies the entry
(:func:`copy_entry`) instead of writing into the cache.

The cache is ``$ENGRAM_FIXTURE_CACHE``, or ``~/.cache/engram-fixtures``. CI (``.ci/run``) points it
at a folder of its own run, so a fresh clone's run starts empty.

``python -m engram_fixtures.cache warm MODULE:FUNCTION ...`` calls each named builder in turn (each
returns its entry): the test session starts it in the background (``tests/conftest.py``) so that the
models its fixtures train are being trained while the tests before them run.

This module imports neither torch nor transformers (it reads their versions from the installed
distributions): asking whether an entry exists costs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["MANIFEST", "cache_key", "cached_build", "copy_entry", "default_cache_dir", "entry_is_complete"]

MANIFEST = ".complete"  # written last, inside the staging folder: its presence means the build finished
_LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors")


def default_cache_dir() -> Path:
    """``$ENGRAM_FIXTURE_CACHE`` or ``~/.cache/engram-fixtures``."""
    configured = os.environ.get("ENGRAM_FIXTURE_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "engram-fixtures"


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def cache_key(parameters: Mapping[str, Any], code: Sequence[ModuleType | Path]) -> str:
    """The hash (16 hex digits) of ``parameters`` (JSON), the source of ``code`` (modules or files)
    and the installed torch, transformers, tokenizers and safetensors versions.

    Args:
        parameters: Everything the build depends on besides its code (JSON-serialisable).
        code: The modules (or source files) whose code builds the entry: a changed line is a new key.
    """
    digest = hashlib.sha256()
    versions = {name: _version(name) for name in _LIBRARIES}
    digest.update(json.dumps([dict(parameters), versions], sort_keys=True).encode())
    for item in code:
        path = Path(item) if isinstance(item, Path) else Path(str(item.__file__))
        digest.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _write_manifest(root: Path, parameters: Mapping[str, Any]) -> None:
    files = {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _files(root)}
    manifest = {"parameters": dict(parameters), "files": files}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def entry_is_complete(root: Path) -> bool:
    """Whether ``root`` holds a finished build whose files are all there, with their sizes and hashes."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    for name, expected in files.items():
        path = root / name
        try:
            if path.stat().st_size != expected["size"] or _sha256(path) != expected["sha256"]:
                return False
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock_path`` (released when the block ends or the process dies)."""
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_build(
    name: str,
    parameters: Mapping[str, Any],
    code: Sequence[ModuleType | Path],
    build: Callable[[Path], None],
    cache_dir: Path | None = None,
) -> Path:
    """The entry of ``build`` for ``parameters``: found in the cache, or built there once.

    Args:
        name: The entry's kind, the start of its folder name (``mini-tofu``, ``mini-cifar``...).
        parameters: What the build depends on (JSON-serialisable); with ``code``, the key.
        code: The modules or files whose source builds the entry.
        build: Writes the entry into the (empty, existing) folder it is given.
        cache_dir: The cache (:func:`default_cache_dir` when None).

    Returns:
        The complete entry's folder; treat it as read-only.
    """
    cache = cache_dir or default_cache_dir()
    root = cache / f"{name}-{cache_key(parameters, code)}"
    if entry_is_complete(root):
        return root
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f".{root.name}.lock"):
        if entry_is_complete(root):  # built by the process that held the lock before us
            return root
        if root.exists():  # partial or corrupt (an interrupted copy, a file changed in place): rebuilt
            shutil.rmtree(root)
        staging = Path(tempfile.mkdtemp(prefix=f".building-{root.name}-", dir=cache))
        try:
            build(staging)
            _write_manifest(staging, parameters)
            staging.chmod(0o755)  # mkdtemp made it private: a server running as another user reads the entry
            staging.rename(root)  # published whole: a reader sees no entry or a complete one
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    return root


def copy_entry(entry: Path, target: Path) -> Path:
    """A private copy of a cache entry (without its manifest), for a user that writes beside it; files
    are made readable by all (a server running as another user reads them)."""
    shutil.copytree(entry, target, ignore=shutil.ignore_patterns(MANIFEST))
    for path in target.rglob("*"):
        if path.is_file():
            path.chmod(0o644)
    return target


def warm(builders: Sequence[str]) -> None:
    """Call each ``module:function`` builder (no arguments) in turn, saying on stdout what each took."""
    for spec in builders:
        module, _, function = spec.partition(":")
        started = time.perf_counter()
        entry = getattr(importlib.import_module(module), function)()
        sys.stdout.write(f"{spec}: {entry} ({time.perf_counter() - started:.1f} s)\n")
        sys.stdout.flush()


def _stop(signum: int, frame: object) -> None:
    # SIGTERM (the test session ended first): unwind, so the build in progress removes its staging folder.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engram_fixtures.cache", description="Build fixture cache entries.")
    commands = parser.add_subparsers(dest="command", required=True)
    warm_parser = commands.add_parser("warm", help="call each MODULE:FUNCTION builder in turn")
    warm_parser.add_argument("builders", nargs="+", metavar="MODULE:FUNCTION")
    arguments = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    warm(arguments.builders)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
