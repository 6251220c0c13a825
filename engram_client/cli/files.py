"""Local files the commands read and write: probe sets (JSONL) in, PNG images out.

Probes are checked here, line by line, so that a bad file is named with its line number before
anything is sent; images are written atomically, so a reader never sees half a PNG.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path
from typing import Any

from engram_client.cli.output import fail


def _is_probe(record: Any) -> bool:
    """``{"prompt", "completion"}`` strings, or ``{"messages": [...]}`` (the service checks the turns)."""
    if not isinstance(record, dict):
        return False
    if "messages" in record:
        return isinstance(record["messages"], list)
    return all(isinstance(record.get(k), str) for k in ("prompt", "completion"))


def read_probes(path: Path) -> list[dict[str, Any]]:
    """The ``{"prompt", "completion"}`` or ``{"messages"}`` records of a JSONL file; a bad line is named."""
    probes = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if not _is_probe(record):
                    fail(
                        "Error",
                        f'{path} line {number} is not a {{"prompt": ..., "completion": ...}} or {{"messages": [...]}} '
                        "JSON record",
                    )
                probes.append(record)
    except UnicodeDecodeError as exc:
        fail("Error", f"{path} is not UTF-8 text ({exc})")
    return probes


def write_atomically(path: Path, data: bytes) -> None:
    """Write a hidden sibling, then rename it over ``path``: nobody ever sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")
    try:
        with partial.open("xb") as sink:  # a new file, so the umask applies as to any other
            sink.write(data)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def png_size(image: bytes) -> tuple[int, int]:
    """Width and height of a PNG, from the IHDR chunk right after the signature (the service drew it)."""
    width, height = struct.unpack(">II", image[16:24])
    return width, height
