"""A Hugging Face hub cache laid out as the hub client writes it, for ``hf://`` sources without a hub."""

from __future__ import annotations

import hashlib
from pathlib import Path

REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_snapshot(cache: Path, source: Path, repo: str = "models--org--tiny") -> Path:
    """A Hugging Face hub cache repo holding ``source`` the way the hub lays it out (links into blobs/).

    Args:
        cache: the hub cache (what ``cache_dir`` names: ``ENGRAM_CACHE_DIR/hf`` for the service).
        source: a folder whose files the snapshot holds (a single file: the snapshot holds it alone).
        repo: the cache repo's folder name (``models--org--name``).

    Returns:
        The snapshot folder of revision :data:`REVISION`, which ``refs/main`` names.
    """
    root = cache / repo
    snapshot = root / "snapshots" / REVISION
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(REVISION)
    for file in [source] if source.is_file() else source.iterdir():
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot
