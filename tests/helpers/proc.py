"""A process's children and command line, read from ``/proc`` (Linux)."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (every thread's children)."""
    found: list[int] = []
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(p) for p in listing.read_text().split()]
        except OSError:
            continue
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
