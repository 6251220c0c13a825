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


def _is_image_probe(record: Any) -> bool:
    """``{"image": <base64>, "label": <class>}`` (the service decodes the image and checks the label)."""
    return isinstance(record, dict) and isinstance(record.get("image"), str) and "label" in record


TEXT_PROBE = '{"prompt": ..., "completion": ...} or {"messages": [...]}'
IMAGE_PROBE = '{"image": <base64>, "label": <class>}'


def read_probes(path: Path, images: bool = False) -> list[dict[str, Any]]:
    """The probe records of a JSONL file: text probes (``{"prompt", "completion"}`` or
    ``{"messages"}``), or with ``images`` labelled image probes; a bad line is named."""
    accepts, shape = (_is_image_probe, IMAGE_PROBE) if images else (_is_probe, TEXT_PROBE)
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
                if not accepts(record):
                    fail("Error", f"{path} line {number} is not a {shape} JSON record")
                probes.append(record)
    except UnicodeDecodeError as exc:
        fail("Error", f"{path} is not UTF-8 text ({exc})")
    return probes


def read_any_probes(path: Path) -> list[dict[str, Any]]:
    """A JSONL file of text probes (:func:`read_probes`) or of image probes (``{"image", "label"}``,
    told by its first record); a bad line of an image file is named."""
    with path.open(encoding="utf-8", errors="replace") as lines:
        first = next((line for line in lines if line.strip()), "")
    try:
        head = json.loads(first) if first else None
    except ValueError:
        head = None
    return read_probes(path, images=isinstance(head, dict) and "image" in head)


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
