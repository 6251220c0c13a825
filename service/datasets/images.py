"""Image records: ``{"image": "<base64 of a PNG, JPEG or WebP file>", "label"?: <class id or name>}``.

An image concept's records carry the encoded file, not pixels: what is stored and hashed is the
record as sent (:meth:`ImageRecord.to_json`), and the collection job decodes it. Every record is
checked when it arrives (:func:`check_image_file`), so that what the job cannot read is a 4xx at
submission naming the record, never an error inside the job; and checked without its pixels ever
being decoded, so that what an image costs the API is its file's bytes, whatever it declares:

- the format is told by the file's first bytes, and only PNG, JPEG and WebP are opened (Pillow has
  plugins for dozens of formats; a record does not get to choose which parser runs);
- the pixel count is read from the header and bounded (``ENGRAM_MAX_IMAGE_PIXELS``) before anything
  is decoded: a decompression bomb (a few kilobytes that inflate to gigabytes) is a 413;
- an aspect ratio past :data:`MAX_IMAGE_ASPECT` is a 422 from the header too: a 1 × 39,000,000 strip
  is within the pixel bound in ~100 KB, but a classifier's resize makes gigabytes of it, and
  squeezed to the model's square it is no picture of anything;
- a truncated or corrupt file is a 422: a PNG's chunks are read and their CRCs checked (nothing
  inflated), a JPEG's markers are read (its last scan must end in its end-of-image marker), a
  WebP's container is parsed when it is opened; what only a full decode finds (a deflate stream
  broken under a valid CRC, a corrupt JPEG or WebP bitstream) fails the collection job, naming
  the record;
- an animated file (APNG, animated WebP) is refused: which frame is "the image" is the sender's to say.

Jobs decode (:func:`decode_image`) under the same header checks and, given the model's image
processor (:class:`~service.engine.image_resize.ResizePath`), refuse before decoding an image
whose resize would hold more pixels than ``ENGRAM_MAX_IMAGE_PIXELS`` (:func:`check_resize_cost`).

Labels are ignored by statistics and read by evaluation. A label is an integer class id or a name
in the model's ``id2label``; :func:`resolve_label` turns it into the id, and refuses an unknown name
by listing some known ones.

Besides JSON records, images come from datasets by reference: a Parquet column as the ``datasets``
library stores an ``Image`` feature (a struct ``{"bytes", "path"}``) or base64 strings
(:func:`image_column_value`; a ``path``-only value is refused: a dataset's content never makes the
service read a file it names), and an ImageFolder, one subfolder per class (:func:`image_folder`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import stat
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from service.config import Settings
from service.datasets.fingerprints import Fingerprint
from service.engine.image_resize import ResizePath
from service.errors import InvalidInput, PayloadTooLarge

IMAGE_FIELD, LABEL_FIELD = "image", "label"
# The formats a record may hold, told by their first bytes (WebP: "RIFF", 4 size bytes, "WEBP").
_READ = (("PNG", b"\x89PNG\r\n\x1a\n", 0), ("JPEG", b"\xff\xd8\xff", 0), ("WEBP", b"WEBP", 8))
# Formats named when refused, so that a user reads "a GIF", not "cannot identify image file".
_REFUSED = (
    (b"GIF8", "a GIF"),
    (b"BM", "a BMP"),
    (b"II*\x00", "a TIFF"),
    (b"MM\x00*", "a TIFF"),
    (b"\x00\x00\x01\x00", "an ICO"),
    (b"8BPS", "a PSD"),
)
SUPPORTED = "PNG, JPEG or WebP"
FOLDER_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
_DATA_URI = "data:image/"
_KNOWN_SHOWN = 8  # labels listed when a name is unknown
# ENGRAM_MAX_IMAGE_PIXELS's default, for callers not given settings.
DEFAULT_MAX_IMAGE_PIXELS: int = Settings.model_fields["max_image_pixels"].default
# The most an image's longer side may be times its shorter. A classifier reads a square-ish crop
# (224 × 224, 384 × 384): past 100:1 what reaches it is a smear, and the resize that makes it costs
# more than the image (a shortest-edge resize keeps the ratio: 100:1 at 256 px is 6.5 Mpx, 20 MB of
# RGB; 1,000:1 took 666 MB, 2026-11-29). Banners (728 × 90, 8:1), panoramas (up to ~12:1) and
# receipts (~1:10) are far inside it.
MAX_IMAGE_ASPECT = 100


def record_name(where: int | str) -> str:
    """How a message names a record: ``"record 3"`` for ``records[3]`` of a body, else as given."""
    return f"record {where}" if isinstance(where, int) else where


def is_image_record(raw: Any) -> bool:
    """Whether a decoded JSON value is meant as an image record (it has an ``image`` field)."""
    return isinstance(raw, dict) and IMAGE_FIELD in raw


@dataclass(frozen=True)
class ImageRecord:
    """One image record: the encoded file and its optional label (a class id or a class name)."""

    data: bytes
    label: int | str | None = None

    kind = "image"

    def to_json(self) -> dict[str, Any]:
        """The record as stored and hashed: the file in base64 and the label when there is one."""
        stored: dict[str, Any] = {IMAGE_FIELD: base64.b64encode(self.data).decode("ascii")}
        if self.label is not None:
            stored[LABEL_FIELD] = self.label
        return stored

    @classmethod
    def from_mapping(cls, raw: Any, where: int | str, max_pixels: int) -> ImageRecord:
        """Validate one JSON object as an image record, its file checked without a decode
        (:func:`check_image_file`).

        Args:
            raw: the decoded JSON value.
            where: the record's index in ``records`` (an int) or where the user finds it (``"dataset line 7"``).
            max_pixels: the most pixels the image may have (``ENGRAM_MAX_IMAGE_PIXELS``).

        Raises:
            InvalidInput: not an object, unknown fields, an ``image`` that is no base64 of a PNG,
                JPEG or WebP file, a corrupt or truncated file, one too far from square, a label
                that is no id or name.
            PayloadTooLarge: more pixels than ``max_pixels``.
        """
        name = record_name(where)
        if not isinstance(raw, dict):
            raise InvalidInput(f"{name} is not a JSON object")
        unknown = sorted(set(raw) - {IMAGE_FIELD, LABEL_FIELD})
        if unknown:
            raise InvalidInput(f"{name}: an image record has only 'image' and 'label', got {', '.join(map(repr, unknown))}")
        record = read_image_record(raw, name)  # the cheap checks first
        check_image_file(record.data, name, max_pixels)
        return record


def read_image_record(raw: Mapping[str, Any], where: str, classes: Mapping[int, str] | None = None) -> ImageRecord:
    """One image record's file and label (``{"image": base64, "label"?}``, its fields checked): the one
    reader of the format, for posted and stored records and evaluation's image probes alike.

    Args:
        classes: the model's classes: the label is resolved to its class id before the image is
            decoded (the cheap check first); ``None``: the label's type is checked only.

    Raises:
        InvalidInput: a label the model does not have, an ``image`` that is no base64 (naming ``where``).
    """
    label = raw.get(LABEL_FIELD)
    checked = check_label(label, where) if classes is None else resolve_label(label, classes, where)
    return ImageRecord(decode_base64(raw.get(IMAGE_FIELD), where), checked)


def decode_base64(value: Any, where: str) -> bytes:
    """The bytes of a record's ``image``: strict base64 (a ``data:image/…;base64,`` prefix allowed).

    Raises:
        InvalidInput: not a string, empty, or not base64 (naming ``where``).
    """
    if not isinstance(value, str) or not value:
        got = "null" if value is None else "an empty string" if value == "" else type(value).__name__
        raise InvalidInput(f"{where}: 'image' must be the base64 of a {SUPPORTED} file, got {got}")
    if value.startswith(_DATA_URI):
        value = value.partition(",")[2]
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{where}: 'image' is not valid base64 (standard alphabet, padded)") from None


def check_label(label: Any, where: str) -> int | str | None:
    """A label as sent, checked for its type: a non-negative class id, a non-empty name, or none."""
    if label is None:
        return None
    if isinstance(label, bool) or not isinstance(label, int | str):
        raise InvalidInput(f"{where}: 'label' must be a class id (an integer) or a class name, got {type(label).__name__}")
    if isinstance(label, int) and label < 0:
        raise InvalidInput(f"{where}: 'label' {label} is negative (class ids count from 0)")
    if isinstance(label, str) and not label.strip():
        raise InvalidInput(f"{where}: 'label' is an empty name")
    return label


def format_of(data: bytes) -> str | None:
    """``"PNG"``, ``"JPEG"`` or ``"WEBP"`` as the first bytes tell, else ``None``."""
    for name, magic, offset in _READ:
        if data[offset : offset + len(magic)] == magic and (name != "WEBP" or data[:4] == b"RIFF"):
            return name
    return None


def _foreign(data: bytes) -> str:
    """What a file that is no PNG, JPEG or WebP looks like, for the message."""
    return next((what for magic, what in _REFUSED if data.startswith(magic)), "not an image file Pillow may open here")


def open_image(data: bytes, where: str, max_pixels: int) -> Image.Image:
    """Open one PNG, JPEG or WebP file from its header alone (nothing decoded) and check what the
    header says: its pixels, its aspect ratio, a single frame.

    Args:
        data: the file's bytes.
        where: the record, for messages (``"record 3"``, ``"dataset row 12"``).
        max_pixels: the most pixels allowed (``ENGRAM_MAX_IMAGE_PIXELS``).

    Returns:
        The opened image: its size and mode known, its pixels not read.

    Raises:
        InvalidInput: another format, a corrupt header, an aspect past :data:`MAX_IMAGE_ASPECT`, an
            animated file.
        PayloadTooLarge: more pixels than ``max_pixels`` (a decompression bomb).
    """
    kind = format_of(data)
    if kind is None:
        raise InvalidInput(f"{where}: the image is {_foreign(data)}; send a {SUPPORTED} file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # refused below, by our bound
            image = Image.open(io.BytesIO(data), formats=[kind])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise _too_many_pixels(where, None, max_pixels) from None
    except UnidentifiedImageError:  # its message names a BytesIO object, nothing the user sent
        raise InvalidInput(f"{where}: the {kind} image cannot be read: its header is corrupt") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise InvalidInput(f"{where}: the {kind} image cannot be read: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise _too_many_pixels(where, (width, height), max_pixels)
    if max(width, height) > MAX_IMAGE_ASPECT * max(min(width, height), 1):
        raise InvalidInput(
            f"{where}: the image is {width}×{height}, its longer side over {MAX_IMAGE_ASPECT} times its shorter "
            f"(the bound on an image's aspect ratio, {MAX_IMAGE_ASPECT}:1: a classifier's square input would be a "
            "smear of it, and resizing it costs more than the image); crop it, or cut it into pieces closer to square"
        )
    frames = int(getattr(image, "n_frames", 1))
    if frames > 1:
        raise InvalidInput(f"{where}: the {kind} image is animated ({frames} frames); send one still image")
    return image


def check_image_file(data: bytes, where: str, max_pixels: int) -> None:
    """Check a file as :func:`open_image` does, then that it is whole, never decoding its pixels:
    a PNG's chunks and their CRCs are read (nothing inflated), a JPEG's markers, a WebP's container
    (parsed by the open).

    Raises:
        InvalidInput, PayloadTooLarge: as :func:`open_image`; a truncated or corrupt file.
    """
    image = open_image(data, where, max_pixels)
    try:
        if image.format == "PNG":
            image.verify()
        elif image.format == "JPEG" and not _jpeg_ends(data):
            raise OSError("its last scan has no end-of-image marker after it (a file cut short)")
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidInput(f"{where}: the {image.format} image is truncated or corrupt: {exc}") from None


def _jpeg_ends(data: bytes) -> bool:
    """Whether a JPEG's end-of-image marker follows its last start-of-scan: scan data never holds
    a marker (an 0xFF byte in it is stuffed as FF 00), so a file cut inside a scan has none after it
    (an EXIF thumbnail's own end marker comes before the main image's scans)."""
    return data.rfind(b"\xff\xd9") > data.rfind(b"\xff\xda") >= 0


def decode_image(data: bytes, where: str, max_pixels: int, resize: ResizePath | None = None) -> Image.Image:
    """Decode one PNG, JPEG or WebP file, its header checked (:func:`open_image`) and, given the
    model's resize, what the resize will cost (:func:`check_resize_cost`), before its pixels are.

    Args:
        data: the file's bytes.
        where: the record, for messages (``"record 3"``, ``"dataset row 12"``).
        max_pixels: the most pixels allowed (``ENGRAM_MAX_IMAGE_PIXELS``), in the image and on its
            way through ``resize``.
        resize: how the model's image processor resizes (``None``: not checked).

    Returns:
        The decoded image (loaded: its pixels are in memory, the bytes no longer needed).

    Raises:
        InvalidInput: as :func:`open_image`; a resize past the bound; a truncated or corrupt file.
        PayloadTooLarge: more pixels than ``max_pixels`` (a decompression bomb).
    """
    image = open_image(data, where, max_pixels)
    if resize is not None:
        check_resize_cost(image.size, where, max_pixels, resize)
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidInput(f"{where}: the {image.format} image is truncated or corrupt: {exc}") from None
    return image


def check_resize_cost(size: tuple[int, int], where: str, max_pixels: int, resize: ResizePath) -> None:
    """Refuse an image whose resize by the model's processor would hold more than ``max_pixels``
    pixels at once (:meth:`~service.engine.image_resize.ResizePath.path_pixels`).

    Raises:
        InvalidInput: naming the record, its size, what the processor resizes it to and the setting.
    """
    width, height = size
    cost = resize.path_pixels(width, height)
    if cost > max_pixels:
        out_width, out_height = resize.output(width, height)
        raise InvalidInput(
            f"{where}: the image is {width}×{height}; the model's image processor resizes it to "
            f"{out_width}×{out_height}, holding {cost} pixels on the way, more than {max_pixels} (the limit, "
            "ENGRAM_MAX_IMAGE_PIXELS); crop it closer to square first"
        )


def _too_many_pixels(where: str, size: tuple[int, int] | None, max_pixels: int) -> PayloadTooLarge:
    shown = f"{size[0]}×{size[1]} = {size[0] * size[1]} pixels" if size else "more pixels than Pillow opens"
    return PayloadTooLarge(
        f"{where}: the image is {shown}, more than {max_pixels} (the limit, ENGRAM_MAX_IMAGE_PIXELS); "
        "a classifier reads a few hundred pixels a side: resize it first"
    )


def resolve_label(label: int | str | None, id2label: Mapping[int, str], where: str) -> int | None:
    """A record's label as a class id of the model.

    Args:
        label: as :func:`check_label` left it.
        id2label: the model's classes (``config.id2label``, keys as ints).
        where: the record, for messages.

    Raises:
        InvalidInput: an id the model has no class for, a name that is none of its classes (some
            known names listed).
    """
    if label is None:
        return None
    if isinstance(label, int):
        if label not in id2label:
            raise InvalidInput(f"{where}: 'label' {label} is no class of the model (ids 0 to {len(id2label) - 1})")
        return label
    ids = {name: index for index, name in id2label.items()}
    if label not in ids:
        known = [id2label[i] for i in sorted(id2label)[:_KNOWN_SHOWN]]
        more = f", … ({len(id2label)} in all)" if len(id2label) > _KNOWN_SHOWN else ""
        raise InvalidInput(
            f"{where}: 'label' {label!r} is no class name of the model "
            f"(its id2label has {', '.join(map(repr, known))}{more})"
        )
    return ids[label]


def image_column_value(value: Any, where: str) -> str:
    """A Parquet image cell as a record's ``image`` (base64).

    The ``datasets`` library stores an ``Image`` feature as a struct ``{"bytes", "path"}``; a plain
    binary column or a base64 string column is read too.

    Raises:
        InvalidInput: a null, a struct with no ``bytes`` (a ``path`` alone names a file elsewhere:
            what a dataset holds never makes the service open a file), any other type.
    """
    if isinstance(value, dict):
        data = value.get("bytes")
        if data is None:
            path = value.get("path")
            named = f" (its path {path!r} is not read: a dataset's content never opens other files)" if path else ""
            raise InvalidInput(f"{where}: the image has no bytes{named}; store the images in the dataset itself")
        value = data
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, str):
        return value
    got = "null" if value is None else type(value).__name__
    raise InvalidInput(f"{where}: the image column holds {got}, not image bytes, a {{bytes, path}} struct or base64")


# ---------------------------------------------------------------- ImageFolder: one subfolder per class


@dataclass(frozen=True)
class FolderImage:
    """One file of an ImageFolder: where it is (relative to the folder), its class and its size."""

    relative: str
    label: str
    path: Path
    size: int


def list_image_folder(root: Path, max_files: int, max_bytes: int) -> list[FolderImage]:
    """The images of an ImageFolder, classes and files in sorted order (by name, bytewise).

    Args:
        root: the folder (resolved; its subfolders are the classes, their names the labels).
        max_files: the most images (``ENGRAM_MAX_RECORDS``); the listing stops one past it.
        max_bytes: the most bytes of all images together (``ENGRAM_MAX_DATASET_BYTES``).

    Raises:
        InvalidInput: no class subfolders, a file beside them or a folder inside one, a file that
            is no ``.png``/``.jpg``/``.jpeg``/``.webp``, a link that leads out of ``root``, anything
            that is no regular file (hidden entries, ``.``-names, are left out: editors' and
            file browsers' own files).
        PayloadTooLarge: over ``max_files`` or ``max_bytes``.
    """
    root = root.resolve()
    top = _entries(root, root)
    classes = [entry for entry in top if entry[1] == "dir"]
    strays = [name for name, kind, _ in top if kind != "dir"]
    if strays:
        raise InvalidInput(f"{root} holds {strays[0]!r} beside its class folders: an ImageFolder holds only class folders")
    if not classes:
        raise InvalidInput(f"{root} has no class folders (an ImageFolder holds one folder of images per class)")
    images: list[FolderImage] = []
    total = 0
    for label, _, folder in classes:
        for name, kind, path in _entries(folder, root):
            relative = f"{label}/{name}"
            if kind != "file":
                raise InvalidInput(f"{root}: {relative} is a folder; class folders hold image files only")
            if not name.lower().endswith(FOLDER_SUFFIXES):
                raise InvalidInput(f"{root}: {relative} is not a .png, .jpg, .jpeg or .webp file")
            size = path.stat().st_size
            total += size
            if len(images) >= max_files:
                raise PayloadTooLarge(f"{root} has more than {max_files} images (the limit, ENGRAM_MAX_RECORDS)")
            if total > max_bytes:
                raise PayloadTooLarge(
                    f"{root} holds more than {max_bytes} bytes of images (the limit, ENGRAM_MAX_DATASET_BYTES)"
                )
            images.append(FolderImage(relative, label, path, size))
    return images


def _entries(folder: Path, root: Path) -> list[tuple[str, str, Path]]:
    """A folder's visible entries as ``(name, "dir" or "file", path)``, sorted; links followed
    only when they stay inside ``root``."""
    found = []
    with os.scandir(folder) as scan:
        for entry in scan:
            if entry.name.startswith("."):
                continue
            path = Path(entry.path)
            if entry.is_symlink():
                path = path.resolve()
                if not path.is_relative_to(root):
                    raise InvalidInput(f"{root}: {entry.name!r} in {folder.name} is a link that leads out of the folder")
            mode = os.stat(path).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise InvalidInput(f"{root}: {entry.name!r} in {folder.name} is neither a folder nor a regular file")
            found.append((entry.name, "dir" if stat.S_ISDIR(mode) else "file", path))
    return sorted(found, key=lambda item: item[0].encode("utf-8", "surrogateescape"))


def folder_fingerprint(images: list[FolderImage]) -> Fingerprint:
    """What identifies an ImageFolder's content without reading it: the digest of every file's
    relative path, size, mtime and inode (any write, rename or replacement changes it)."""
    digest = hashlib.sha256()
    for image in images:
        info = image.path.stat()
        digest.update(f"{image.relative}\x00{info.st_size}\x00{info.st_mtime_ns}\x00{info.st_ino}\n".encode())
    return {"files": len(images), "listing": digest.hexdigest()}


def image_folder(root: Path, max_files: int, max_bytes: int) -> Iterator[tuple[str, dict[str, str]]]:
    """An ImageFolder's records, in the order of :func:`list_image_folder`: ``(where, record)``
    with ``record = {"image": <base64>, "label": <its folder's name>}``, read one file at a time."""
    for image in list_image_folder(root, max_files, max_bytes):
        data = image.path.read_bytes()
        record = {IMAGE_FIELD: base64.b64encode(data).decode("ascii"), LABEL_FIELD: image.label}
        yield f"dataset file {image.relative}", record


# ---------------------------------------------------------------- records against the model that reads them


def check_record_kinds(first: Mapping[str, str], model_id: str, model_kind: str) -> None:
    """Refuse a dataset holding records the model cannot read, naming the first such record.

    Args:
        first: each record kind the dataset holds -> its first record, in the order they came
            (:attr:`service.datasets.spool.SpooledDataset.first`).
        model_id: the model, for the message.
        model_kind: ``"image"`` or ``"text"`` (:func:`service.engine.image_models.model_kind`).

    Raises:
        InvalidInput: a text record (text, prompt/completion, messages) for an image model, or an
            image record for a text model.
    """
    if model_kind == "image":
        text = next((where for kind, where in first.items() if kind != "image"), None)
        if text is not None:
            raise InvalidInput(
                f"{text} is a text record, but model {model_id} is an image model: it reads image records "
                '({"image": "<base64 of a PNG, JPEG or WebP file>", "label"?})'
            )
    elif "image" in first:
        raise InvalidInput(
            f"{first['image']} is an image record, but model {model_id} is a {model_kind} model: it reads text "
            "records (text, prompt/completion or messages); image records are for image classifiers"
        )
