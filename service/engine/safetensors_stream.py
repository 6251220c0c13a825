"""Write a safetensors file tensor by tensor, so a checkpoint never has to fit in memory twice.

``safetensors.torch.save_file`` takes every tensor of a file at once; an edited shard of a 7B model
would then sit in memory next to its source. The format allows streaming: an 8-byte little-endian
header length, a JSON header giving every tensor's dtype, shape and byte range, then the bytes. When
the dtypes and shapes are known up front (an edit never changes them), the header is written first
and each tensor's bytes follow as they are produced, or are copied from the source file unread.

A writer that must also know the file's digest (a variant: its manifest lists each file's sha256)
passes a :class:`HashingSink`: every byte is hashed as it is written, so the file is never read
back. The unchanged tensors then pass through this process (read, hashed, written) instead of being
copied by the kernel: one read of the source and one write, where a kernel copy and a re-read for
the hash would move them twice.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
import torch

_ALIGN = 8  # the header is padded so the data starts 8-byte aligned, as safetensors itself does
_COPY_CHUNK = 16 << 20
_KERNEL_CHUNK = 1 << 30
_HASH_BACKLOG = 4  # buffers (up to a copy chunk or a tensor each) written but not hashed yet
_MAP_MIN = 1 << 20  # a copied tensor at least this large is hashed from a mapping of its file


@dataclass(frozen=True)
class WrittenFile:
    """A file as it was written: its size and the sha256 of its bytes (hex)."""

    size: int
    sha256: str


class ByteStream(Protocol):
    """Something told a file's bytes in order as they are written (an upload fed as it goes)."""

    def update(self, data: memoryview) -> None: ...


class HashingSink:
    """The sha256 and the byte count of the bytes of one file, told to it in order as they are written.

    The hash runs on a thread of its own (``hashlib`` releases the GIL on large buffers), so it
    overlaps the writes instead of following them: a file's sha256 is sequential and, on a CPU,
    slower than a copy, so the file's write costs about the larger of the two, not their sum. At
    most :data:`_HASH_BACKLOG` buffers wait to be hashed; each is kept alive, unchanged, until it is.

    Args:
        also: told the same bytes, in order, right after the hash is (an S3 upload of the file
            while it is written: :meth:`service.storage.base.Storage.streamed_upload`).
    """

    def __init__(self, also: ByteStream | None = None) -> None:
        self._digest = hashlib.sha256()
        self.size = 0
        self._also = also
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-hash")  # one: in order
        self._pending: deque[Future[None]] = deque()

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        self._pending.append(self._pool.submit(self._digest.update, view))
        if self._also is not None:
            self._also.update(view)
        while len(self._pending) > _HASH_BACKLOG:
            self._pending.popleft().result()

    def written(self) -> WrittenFile:
        """The file's size and sha256, once every byte told is hashed."""
        while self._pending:
            self._pending.popleft().result()
        self._pool.shutdown()
        return WrittenFile(self.size, self._digest.hexdigest())


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: dtype (``F32``, ``BF16``…), shape and byte range."""

    dtype: str
    shape: list[int]
    start: int  # absolute offset of the first byte in the file
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors of a safetensors file (absolute byte ranges) and its ``__metadata__``."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    data_start = 8 + length
    metadata = header.pop("__metadata__", None) or {}
    entries = {
        key: TensorEntry(
            value["dtype"],
            list(value["shape"]),
            data_start + value["data_offsets"][0],
            value["data_offsets"][1] - value["data_offsets"][0],
        )
        for key, value in header.items()
    }
    return entries, metadata


@dataclass(frozen=True)
class Planned:
    """A tensor to write: its key, dtype/shape/size (those of ``like``), and where its bytes come from.

    ``produce`` returns the tensor when called (an edit, computed only now); ``None`` means copy the
    bytes of ``like`` from ``source`` unchanged.
    """

    key: str
    like: TensorEntry
    source: Path
    produce: Callable[[], torch.Tensor] | None = None


def write_streaming(
    target: Path, planned: Sequence[Planned], metadata: dict[str, str], sink: HashingSink | None = None
) -> None:
    """Write ``planned`` to ``target`` in order: header first, then each tensor's bytes.

    Args:
        sink: given, told every byte written, in order (the file's digest without reading it back).

    Raises:
        ValueError: a produced tensor's size differs from the planned entry's.
    """
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for item in planned:
        span = [offset, offset + item.like.nbytes]
        header[item.key] = {"dtype": item.like.dtype, "shape": item.like.shape, "data_offsets": span}
        offset += item.like.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    # Unbuffered: the unchanged tensors are copied by the kernel (os.copy_file_range) at the file
    # descriptor's own position, which a buffered writer would not see move.
    with target.open("wb", buffering=0) as out:
        _write_all(out, struct.pack("<Q", len(raw)), sink)
        _write_all(out, raw, sink)
        for item in planned:
            if item.produce is None:
                _copy_range(item.source, item.like, out, sink)
            else:
                _write_tensor(item, item.produce(), out, sink)


def _write_tensor(item: Planned, tensor: torch.Tensor, out: BinaryIO, sink: HashingSink | None) -> None:
    """The bytes of ``tensor``, the one ``item`` produced, checked against the planned entry."""
    data: np.ndarray[Any, np.dtype[np.uint8]] = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    # numpy's stubs do not declare the buffer protocol (PEP 688) that ndarray implements
    view = memoryview(data)  # type: ignore[arg-type]
    if data.nbytes != item.like.nbytes or list(tensor.shape) != item.like.shape:
        raise ValueError(f"{item.key}: produced {list(tensor.shape)} ({data.nbytes} bytes), planned {item.like}")
    _write_all(out, view, sink)


def _write_all(out: BinaryIO, data: bytes | memoryview, sink: HashingSink | None = None) -> None:
    """Write every byte: an unbuffered file's ``write`` may take fewer (Linux moves at most ~2 GiB
    per call), so a large tensor is written in as many calls as it takes."""
    view = memoryview(data).cast("B")
    if sink is not None:
        sink.update(view)
    while view.nbytes:
        written = out.write(view)
        if not written:
            raise OSError("the target file took no bytes")
        view = view[written:]


def _copy_range(source: Path, entry: TensorEntry, out: BinaryIO, sink: HashingSink | None = None) -> None:
    """Append ``entry``'s bytes of ``source`` to ``out``: in the kernel where it can (no pass
    through this process's memory), else read and written in chunks.

    A sink hashes them from a read-only mapping of ``source`` while the kernel copies them: the
    bytes are never copied into this process (a read into a buffer, then a write from it, was two
    memory copies on the write step's own thread; on a 1B-shaped variant the 525 MB embedding).
    """
    with source.open("rb") as handle:
        hashed = sink is not None and _hash_mapped(handle, entry, sink)
        if sink is None or hashed:
            remaining = _kernel_copy(handle.fileno(), out, entry.start, entry.nbytes)
        else:
            remaining = entry.nbytes
        handle.seek(entry.start + entry.nbytes - remaining)
        for chunk in _chunks(handle, remaining):
            _write_all(out, chunk, None if hashed else sink)  # hashed already, from the mapping
            remaining -= len(chunk)
    if remaining:
        raise ValueError(f"{source} ended {remaining} bytes early")


def _hash_mapped(handle: BinaryIO, entry: TensorEntry, sink: HashingSink) -> bool:
    """Tell ``sink`` ``entry``'s bytes as a view of a read-only mapping of ``handle``'s file; False
    (nothing told) for a range too small to be worth a mapping, or one the file does not hold.

    The view keeps the mapping alive until the sink's thread has hashed it; the caller then writes
    the same bytes of the same file (a model file rewritten meanwhile fails the build afterwards:
    :meth:`~service.engine.model_file_descriptors.ModelFiles.check_unchanged`)."""
    end = entry.start + entry.nbytes
    if entry.nbytes < _MAP_MIN or os.fstat(handle.fileno()).st_size < end:
        return False
    first = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(handle.fileno(), end - first, access=mmap.ACCESS_READ, offset=first)
    except (OSError, ValueError):  # a file system that cannot map (ENODEV...): read and hash instead
        return False
    sink.update(memoryview(mapped)[entry.start - first :])  # one buffer: a mapping holds no memory
    return True


def _kernel_copy(source_fd: int, out: BinaryIO, start: int, length: int) -> int:
    """Copy with ``os.copy_file_range`` from ``start``; returns the bytes left for the caller to
    copy (all of them where the kernel or the file systems refuse, or the source ends early)."""
    if not hasattr(os, "copy_file_range") or not hasattr(out, "fileno"):
        return length
    try:
        out_fd = out.fileno()
    except (OSError, ValueError):  # not a real file (an in-memory buffer)
        return length
    offset = start
    while length > 0:
        try:
            copied = os.copy_file_range(source_fd, out_fd, min(length, _KERNEL_CHUNK), offset)
        except OSError:  # EXDEV, ENOSYS, EINVAL...: fall back to read and write
            return length
        if copied == 0:  # end of the source: the caller's read finds it too and says so
            return length
        offset += copied
        length -= copied
    return 0


def _chunks(handle: BinaryIO, length: int) -> Iterator[bytes]:
    while length > 0:
        chunk = handle.read(min(_COPY_CHUNK, length))
        if not chunk:
            return
        length -= len(chunk)
        yield chunk
