"""Real images for image-record tests: scikit-learn's ``load_digits`` (1,797 labelled 8×8 grey scans,
shipped with the package, nothing downloaded) encoded by Pillow, and hand-made hostile files."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from functools import cache

import numpy as np
from PIL import Image

# Pillow's save options per format: lossless WebP, so a decoded digit equals the source exactly.
_SAVE = {"PNG": {}, "JPEG": {"quality": 95}, "WEBP": {"lossless": True}}


@cache
def digits() -> tuple[np.ndarray, np.ndarray]:
    """The digits as uint8 8×8 images (0..16 scaled to 0..255) and their labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = np.round(data.images * (255 / 16)).astype(np.uint8)
    return images, data.target.astype(np.int64)


def digit_image(index: int, *, rgb: bool = False) -> Image.Image:
    """Digit ``index`` as a Pillow image (grey, or the grey copied to three channels)."""
    image = Image.fromarray(digits()[0][index], mode="L")
    return image.convert("RGB") if rgb else image


def encode(image: Image.Image, fmt: str) -> bytes:
    """``image`` saved as ``fmt`` (``"PNG"``, ``"JPEG"``, ``"WEBP"``, or any other Pillow format)."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **_SAVE.get(fmt, {}))
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def digit_indices(digit: int | None, start: int, count: int, exclude: int | None = None) -> list[int]:
    """``count`` digit indices from ``start`` on: of ``digit`` (any digit when None, but ``exclude``)."""
    labels = digits()[1]
    chosen = [i for i in range(start, len(labels)) if (digit is None or labels[i] == digit) and labels[i] != exclude]
    return chosen[:count]


def digit_record(index: int, fmt: str = "PNG", *, label: int | str | None = None) -> dict[str, object]:
    """An image record of digit ``index`` (its label when ``label`` is None)."""
    chosen = int(digits()[1][index]) if label is None else label
    return {"image": b64(encode(digit_image(index, rgb=True), fmt)), "label": chosen}


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def png_bomb(width: int, height: int) -> bytes:
    """A valid grey PNG of ``width × height`` black pixels: a few kilobytes that inflate to
    ``width·height`` bytes (a decompression bomb), built row by row without holding the pixels."""
    compressor = zlib.compressobj(9)
    row = b"\x00" + bytes(width)  # filter type 0, then the row
    body = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")
