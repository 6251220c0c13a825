"""A variant's files: downloaded whole, each verified against the manifest, published by one rename."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from api_schemas import VariantFile
from engram_client.errors import EngramDownloadError, EngramError, EngramOutputExistsError
from engram_client.resources.variants import VariantsResource
from engram_client.transport import CHUNK_BYTES, _quote

DownloadCallback = Callable[[VariantFile, int], None]


class FilesResource(VariantsResource):
    """``/variants/{id}/files/…``: a download starts from the variant's manifest, hence VariantsResource."""

    def download_variant(
        self,
        variant_id: str,
        out_dir: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        on_progress: DownloadCallback | None = None,
    ) -> Path:
        """Download every file of a ready variant into ``out_dir``, all verified, or nothing at all.

        Files are streamed into a temporary sibling of ``out_dir``, each checked against the manifest's
        size and sha256; only when all of them match is the directory renamed into place, so a failed
        or interrupted download never leaves a half-written checkpoint behind. Redirects to presigned
        storage URLs are followed without the API key.

        Args:
            out_dir: the directory to create. When it exists and already holds exactly these verified
                files, nothing is downloaded; any other non-empty directory is refused unless ``overwrite``.
            on_progress: called with (file, bytes received so far) as each file streams in.

        Returns:
            ``out_dir`` as a :class:`~pathlib.Path`.

        Raises:
            EngramDownloadError: a file's size or sha256 is wrong (``out_dir`` is left untouched).
            EngramOutputExistsError: ``out_dir`` holds something else and ``overwrite`` is off, or is a
                file (never replaced, even with ``overwrite``).
            EngramError: the variant is not ready.
        """
        variant = self.get_variant(variant_id)
        if variant.status != "ready":
            raise EngramError(f"variant {variant_id} is {variant.status}, not ready: nothing to download")
        for entry in variant.files:
            _check_relative(entry.path)
        target = Path(out_dir)
        if (target.exists() or target.is_symlink()) and not target.is_dir():
            # --force replaces a directory of files, never a file that happens to have that name.
            raise EngramOutputExistsError(f"{target} is a file, not a directory: name a directory to download into")
        if _non_empty(target) and not overwrite:
            if _holds_exactly(target, variant.files):
                return target
            raise EngramOutputExistsError(f"{target} exists and holds something else than this variant")
        target.parent.mkdir(parents=True, exist_ok=True)
        # A sibling, so the final rename stays on one file system; mkdir (not mkdtemp) so the umask applies.
        staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.partial"
        staging.mkdir()
        try:
            for entry in variant.files:
                self._download_file(variant_id, entry, staging / entry.path, on_progress)
            _publish(staging, target)
        except BaseException:  # KeyboardInterrupt too: never leave the staging directory behind
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target

    def _download_file(self, variant_id: str, entry: VariantFile, dest: Path, on_progress: DownloadCallback | None) -> None:
        """Stream one file to ``dest`` (retried whole on connection errors), then verify size and sha256."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        path = f"/variants/{_quote(variant_id)}/files/{quote(entry.path, safe='/')}"

        def attempt() -> tuple[int, str]:
            digest, size = hashlib.sha256(), 0
            with self._stream(path) as response, dest.open("wb") as sink:
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    size += len(chunk)
                    if size > entry.size:  # stop early: a file that is too long is wrong whatever follows
                        break
                    sink.write(chunk)
                    digest.update(chunk)
                    if on_progress is not None:
                        on_progress(entry, size)
            return size, digest.hexdigest()

        size, sha256 = self._retrying(attempt, retry=True)
        if size != entry.size:
            raise EngramDownloadError(f"{entry.path}: received {size} bytes or more, the manifest says {entry.size}")
        if sha256 != entry.sha256:
            raise EngramDownloadError(f"{entry.path}: sha256 {sha256} differs from the manifest's {entry.sha256}")


def _check_relative(path: str) -> None:
    """Refuse a manifest path that would land outside the output directory (a hostile or broken server)."""
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or any(p in {"..", "."} for p in parts) or "\\" in path:
        raise EngramDownloadError(f"the variant lists an unsafe file path {path!r}; refusing to download")


def _non_empty(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists()  # a file in the way counts as non-empty


def _holds_exactly(directory: Path, files: Sequence[VariantFile]) -> bool:
    """Whether ``directory`` holds exactly these files with the right sizes and sha256 (an earlier download)."""
    if not directory.is_dir():
        return False
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    if present != {f.path for f in files}:
        return False
    return all((directory / f.path).stat().st_size == f.size and _sha256(directory / f.path) == f.sha256 for f in files)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        for block in iter(lambda: source.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def _publish(staging: Path, target: Path) -> None:
    """Rename the verified ``staging`` directory to ``target``; whatever was at ``target`` goes only afterwards."""
    if not target.exists():
        os.replace(staging, target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent)) / "old"
    os.replace(target, aside)
    try:
        os.replace(staging, target)
    except OSError:
        os.replace(aside, target)  # put the old content back: the caller sees the error and the old directory
        raise
    finally:
        shutil.rmtree(aside.parent, ignore_errors=True)
