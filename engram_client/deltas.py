"""Apply a ``delta`` variant to its base checkpoint folder: the full checkpoint, written without torch.

A delta (``"format": "delta"``, ``delta.safetensors``) holds the **new values** of the tensors an
edit changed, under the base checkpoint's own keys; applying it is replacing those tensors, not
adding to them. Its metadata says ``untied: true`` when the edit had to untie the head from the
embedding: the delta then holds the head under a key the base lacks (its tied weight lived under the
embedding's key), and the result's ``config.json`` says ``tie_word_embeddings: false``.

:func:`apply_delta` works on the safetensors bytes themselves (an 8-byte header length, a JSON
header, the tensors' raw bytes), so it needs neither torch nor numpy, reads every dtype (bfloat16
and float8 too) and holds one chunk in memory at a time. Every tensor of the delta is checked
against the base (present, same dtype, same shape) before anything is written; the result is built
in a hidden folder beside ``out_dir`` and renamed into place at the end, so a failure leaves no
``out_dir`` at all.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["DeltaError", "DeltaReport", "apply_delta"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_CHUNK = 8 << 20
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header's size
# Bytes per element of each safetensors dtype (its spec's names); sub-byte and unknown ones are refused.
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


class DeltaError(ValueError):
    """The delta does not fit the base folder (a tensor the base lacks, another shape or dtype), or a
    file is not what its name says; nothing was written."""


@dataclass(frozen=True)
class _Tensor:
    """One tensor of a safetensors file: where its bytes are (absolute offsets in the file)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class _Header:
    path: Path
    tensors: dict[str, _Tensor]  # in the order of their bytes in the file
    metadata: dict[str, str]


@dataclass(frozen=True)
class DeltaReport:
    """What :func:`apply_delta` wrote.

    Attributes:
        replaced: each replaced tensor's key and the shard it was written to.
        added: the keys the base lacked (an untied head), and their shard.
        shards_rewritten: the weight files written anew (every other file was copied).
        untied: the delta untied the head from the embedding (``tie_word_embeddings`` set to false).
    """

    replaced: dict[str, str]
    added: dict[str, str]
    shards_rewritten: list[str]
    untied: bool


def read_header(path: Path) -> _Header:
    """The header of a safetensors file, checked enough to copy its tensors safely.

    Raises:
        DeltaError: not a safetensors file (short, a header that is not JSON, offsets outside the file).
    """
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise DeltaError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise DeltaError(f"{path} is not a safetensors file (a header of {length} bytes)")
        try:
            raw = json.loads(handle.read(length))
        except ValueError as exc:
            raise DeltaError(f"{path} is not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(raw, dict):
        raise DeltaError(f"{path} is not a safetensors file (its header is not a JSON object)")
    base = 8 + length
    metadata = raw.pop("__metadata__", None) or {}
    tensors = {}
    for key, info in raw.items():
        try:
            begin, end = (int(v) for v in info["data_offsets"])
            tensor = _Tensor(key, str(info["dtype"]), tuple(int(d) for d in info["shape"]), base + begin, base + end)
        except (KeyError, TypeError, ValueError):
            raise DeltaError(f"{path}: tensor {key} has no dtype, shape or data_offsets") from None
        if not base <= tensor.start <= tensor.end <= size:
            raise DeltaError(f"{path}: tensor {key}'s bytes lie outside the file")
        width = _DTYPE_BYTES.get(tensor.dtype)
        if width is not None and tensor.nbytes != math.prod(tensor.shape) * width:
            raise DeltaError(f"{path}: tensor {key} holds {tensor.nbytes} bytes, not {tensor.shape} of {tensor.dtype}")
        tensors[key] = tensor
    ordered = dict(sorted(tensors.items(), key=lambda item: item[1].start))
    return _Header(path, ordered, {str(k): str(v) for k, v in metadata.items()})


def _shards(base_dir: Path) -> tuple[dict[str, str], dict[str, Any] | None]:
    """key -> shard file name of the base checkpoint, and its index (None: one ``model.safetensors``)."""
    index_path = base_dir / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = {str(k): str(v) for k, v in index["weight_map"].items()}
        except (ValueError, KeyError, AttributeError, TypeError):
            raise DeltaError(f"{index_path} is not a safetensors index (no weight_map)") from None
        for shard in set(weight_map.values()):
            if Path(shard).name != shard or not (base_dir / shard).is_file():
                raise DeltaError(f"{index_path} names shard {shard!r}, which is not a file of {base_dir}")
        return weight_map, index
    single = base_dir / SINGLE_FILE
    if not single.is_file():
        raise DeltaError(f"{base_dir} has no {SINGLE_FILE} and no {INDEX_FILE}: not a safetensors checkpoint folder")
    return dict.fromkeys(read_header(single).tensors, SINGLE_FILE), None


def _check(delta: _Header, bases: Mapping[str, _Header], weight_map: Mapping[str, str], untied: bool) -> dict[str, str]:
    """Each delta key's shard in the result; refuses, by name, a key the base lacks (unless the delta
    untied the head: then it joins the shard of the base tensor it was tied to) or another dtype or shape."""
    lacking, mismatched, placed = [], [], {}
    for key, tensor in delta.tensors.items():
        shard = weight_map.get(key)
        if shard is None:
            lacking.append(key)
            continue
        base = bases[shard].tensors.get(key)
        if base is None:
            raise DeltaError(f"the index of the base names {key} in {shard}, which does not hold it")
        if (base.dtype, base.shape) != (tensor.dtype, tensor.shape):
            mismatched.append(
                f"{key} is {tensor.dtype}{list(tensor.shape)} in the delta, {base.dtype}{list(base.shape)} in the base"
            )
        placed[key] = shard
    if mismatched:
        raise DeltaError(f"the delta does not fit this base checkpoint: {'; '.join(mismatched)}")
    if lacking and not untied:
        raise DeltaError(
            f"the base checkpoint has no tensor {', '.join(lacking)}: this delta was made from another model "
            "(apply it to the folder of the model the variant was built from)"
        )
    for key in lacking:  # an untied head: beside the tensor of the same dtype and shape it was tied to
        tensor = delta.tensors[key]
        twins = [
            s
            for k, s in weight_map.items()
            if (bases[s].tensors[k].dtype, bases[s].tensors[k].shape) == (tensor.dtype, tensor.shape)
        ]
        if not twins:
            raise DeltaError(f"the base checkpoint has no tensor {key}, nor one of its dtype and shape it was tied to")
        placed[key] = twins[0]
    return placed


def _copy_range(src: BinaryIO, start: int, length: int, dst: BinaryIO) -> None:
    src.seek(start)
    while length > 0:
        chunk = src.read(min(_CHUNK, length))
        if not chunk:
            raise DeltaError(f"{getattr(src, 'name', 'a file')} ended early")
        dst.write(chunk)
        length -= len(chunk)


def _write_shard(base: _Header, replaced: Mapping[str, _Tensor], added: list[_Tensor], delta_path: Path, out: Path) -> None:
    """``base`` with the tensors of ``replaced`` taking their bytes from the delta, and ``added``
    appended; the header keeps the base's metadata and tensor order (safetensors wants them packed)."""
    order = [*base.tensors.values(), *added]
    header: dict[str, Any] = {"__metadata__": base.metadata} if base.metadata else {}
    offset = 0
    for tensor in order:
        size = replaced[tensor.key].nbytes if tensor.key in replaced else tensor.nbytes
        header[tensor.key] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    added_keys = {t.key for t in added}
    with base.path.open("rb") as src, delta_path.open("rb") as delta, out.open("xb") as dst:
        dst.write(struct.pack("<Q", len(encoded)) + encoded)
        for tensor in order:
            if tensor.key in replaced or tensor.key in added_keys:
                new = replaced.get(tensor.key, tensor)
                _copy_range(delta, new.start, new.nbytes, dst)
            else:
                _copy_range(src, tensor.start, tensor.nbytes, dst)


def _index_with(index: Mapping[str, Any], added: Mapping[str, str], delta: _Header) -> dict[str, Any]:
    """The base's index with the added keys in its weight map (and their bytes in its total size)."""
    new_index = {**index, "weight_map": {**index["weight_map"], **added}}
    metadata = index.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("total_size"), int):
        grown = metadata["total_size"] + sum(delta.tensors[key].nbytes for key in added)
        new_index["metadata"] = {**metadata, "total_size": grown}
    return new_index


@contextmanager
def _staging(out_dir: Path) -> Iterator[Path]:
    """A hidden folder beside ``out_dir``, renamed to it when the block succeeds, removed otherwise."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        yield staging
        os.rename(staging, out_dir)  # an existing out_dir (even empty) fails here: never merged into
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def apply_delta(base_dir: Path, delta_file: Path, out_dir: Path) -> DeltaReport:
    """Write ``out_dir``: ``base_dir``'s files with the delta's tensors in place of the base's.

    Args:
        base_dir: the base checkpoint folder (``model.safetensors``, or shards and
            ``model.safetensors.index.json``; config, tokenizer and any other file are copied).
        delta_file: a delta variant's ``delta.safetensors``.
        out_dir: a new folder (refused when it exists); the result loads with ``from_pretrained`` as
            the checkpoint variant of the same request does.

    Raises:
        DeltaError: a delta tensor the base lacks, another dtype or shape, a file that is not
            safetensors; nothing is written.
        FileExistsError: ``out_dir`` exists.
    """
    base_dir, delta_file, out_dir = Path(base_dir), Path(delta_file), Path(out_dir)
    if not base_dir.is_dir():
        raise DeltaError(f"{base_dir} is not a folder (the base checkpoint)")
    if not delta_file.is_file():
        raise DeltaError(f"{delta_file} is not a file (the delta's delta.safetensors)")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; choose a new folder for the result")
    if out_dir.resolve().is_relative_to(base_dir.resolve()):  # it would copy itself into itself
        raise DeltaError(f"{out_dir} is inside the base folder {base_dir}; choose a folder outside it")
    delta = read_header(delta_file)
    untied = delta.metadata.get("untied", "false") == "true"
    weight_map, index = _shards(base_dir)
    bases = {shard: read_header(base_dir / shard) for shard in dict.fromkeys(weight_map.values())}
    placed = _check(delta, bases, weight_map, untied)

    rewritten = sorted(set(placed.values()))
    added = {key: shard for key, shard in placed.items() if key not in weight_map}
    with _staging(out_dir) as staging:
        for path in sorted(base_dir.rglob("*")):
            relative = path.relative_to(base_dir)
            target = staging / relative
            if path.is_dir():
                target.mkdir(exist_ok=True)
            elif relative.as_posix() in rewritten:
                replaced = {k: delta.tensors[k] for k, s in placed.items() if s == relative.as_posix() and k not in added}
                extra = [delta.tensors[k] for k, s in added.items() if s == relative.as_posix()]
                _write_shard(bases[relative.as_posix()], replaced, extra, delta_file, target)
            elif relative.as_posix() == "config.json" and untied:
                config = json.loads(path.read_text(encoding="utf-8"))
                config["tie_word_embeddings"] = False
                target.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            elif relative.as_posix() == INDEX_FILE and index is not None and added:
                target.write_text(json.dumps(_index_with(index, added, delta), indent=2) + "\n", encoding="utf-8")
            else:
                shutil.copy2(path, target)
    return DeltaReport(
        replaced={k: s for k, s in placed.items() if k not in added},
        added=added,
        shards_rewritten=rewritten,
        untied=untied,
    )
