"""The streaming safetensors writer: files that safetensors itself reads back bit for bit."""

from __future__ import annotations

import errno
import io
import os
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from service.engine import safetensors_stream as stream_module
from service.engine.safetensors_stream import Planned, read_header, write_streaming


@pytest.fixture
def source(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "source.safetensors"
    tensors = {
        "a.weight": torch.randn(5, 3),
        "b.weight": torch.randn(4, 4).to(torch.bfloat16),
        "c.bias": torch.randn(7).to(torch.float16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    save_file(tensors, str(path), metadata={"format": "pt", "note": "kept"})
    return path


def test_copied_and_produced_tensors_read_back_exactly(source: Path, tmp_path: Path) -> None:
    entries, metadata = read_header(source)
    original = load_file(str(source))
    replaced = {"b.weight": torch.full((4, 4), 2.0, dtype=torch.bfloat16), "scalar": torch.tensor(-1.0, dtype=torch.float64)}
    planned = [
        Planned(key, entries[key], source, partial(replaced.__getitem__, key) if key in replaced else None)
        for key in entries
    ]
    planned.append(Planned("b.weight.copy_of_a", entries["a.weight"], source, lambda: original["a.weight"] * 2))
    target = tmp_path / "out.safetensors"
    write_streaming(target, planned, metadata)
    back = load_file(str(target))
    assert set(back) == set(original) | {"b.weight.copy_of_a"}
    for key, value in back.items():
        expected = replaced.get(key, original.get(key))
        if key == "b.weight.copy_of_a":
            expected = original["a.weight"] * 2
        assert expected is not None, key
        assert value.dtype == expected.dtype and torch.equal(value, expected), key
    with safe_open(str(target), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "note": "kept"}
    assert read_header(target)[0]["a.weight"].start % 8 == 0  # data 8-byte aligned, as safetensors does


def test_a_produced_tensor_of_another_shape_is_refused(source: Path, tmp_path: Path) -> None:
    entries, _ = read_header(source)
    planned = [Planned("a.weight", entries["a.weight"], source, lambda: torch.zeros(3, 5))]  # transposed by mistake
    planned_wrong_size = [Planned("a.weight", entries["a.weight"], source, lambda: torch.zeros(6, 3))]
    with pytest.raises(ValueError, match="planned"):
        write_streaming(tmp_path / "x.safetensors", planned, {})
    with pytest.raises(ValueError, match="planned"):
        write_streaming(tmp_path / "y.safetensors", planned_wrong_size, {})


def _kernel_copy_as(kernel: str, monkeypatch: pytest.MonkeyPatch, first_bytes: int) -> list[int]:
    """Make ``os.copy_file_range`` work (``copy_file_range``), refuse (EXDEV, as across some file
    systems: ``refused``) or copy ``first_bytes`` then nothing (``short``); the calls' counts."""
    real = os.copy_file_range
    calls: list[int] = []

    def refused(*_args: object) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    def short(src: int, dst: int, count: int, offset_src: int | None = None) -> int:
        calls.append(count)
        return real(src, dst, min(count, first_bytes), offset_src) if len(calls) == 1 else 0

    if kernel != "copy_file_range":
        monkeypatch.setattr(os, "copy_file_range", refused if kernel == "refused" else short)
    return calls


@pytest.mark.parametrize("kernel", ["copy_file_range", "refused", "short"])
def test_unchanged_tensors_are_copied_exactly_by_the_kernel_or_by_hand(
    source: Path, tmp_path: Path, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unchanged tensors go through ``os.copy_file_range``; where the kernel refuses (EXDEV on some
    file systems) or copies only part, the rest is read and written: the same bytes either way."""
    calls = _kernel_copy_as(kernel, monkeypatch, first_bytes=3)
    entries, metadata = read_header(source)
    target = tmp_path / "copy.safetensors"
    write_streaming(target, [Planned(key, entries[key], source) for key in entries], metadata)
    original, back = load_file(str(source)), load_file(str(target))
    assert list(back) == list(original)
    for key, value in original.items():
        assert torch.equal(back[key], value), key
    assert kernel != "short" or calls


def test_every_byte_is_written_when_the_file_takes_fewer_per_call() -> None:
    class Stingy(io.RawIOBase):
        """A raw file that takes at most 5 bytes per write, as a file descriptor may."""

        def __init__(self) -> None:
            self.data = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            taken = bytes(memoryview(b)[:5])
            self.data += taken
            return len(taken)

    out = Stingy()
    payload = torch.arange(100, dtype=torch.float32).view(torch.uint8).numpy()
    stream_module._write_all(out, memoryview(payload))  # type: ignore[arg-type]
    assert bytes(out.data) == payload.tobytes()


@pytest.mark.parametrize("kernel", ["copy_file_range", "refused", "short"])
def test_a_large_copied_tensor_is_hashed_from_its_file_exactly_once(
    tmp_path: Path, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copied tensor past the mapping threshold is hashed from a mapping of the source (at an
    offset that is not page aligned) while the kernel, or the fallback, copies it: the digest is
    the written file's, computed here by hashlib over the bytes read back."""
    import hashlib

    from service.engine.safetensors_stream import HashingSink, WrittenFile

    calls = _kernel_copy_as(kernel, monkeypatch, first_bytes=4099)
    path = tmp_path / "large.safetensors"
    torch.manual_seed(1)
    tensors = {"big": torch.randn(700, 1000), "small": torch.randn(3), "big2": torch.randn(600, 513).to(torch.bfloat16)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    entries, metadata = read_header(path)
    assert entries["big"].nbytes >= stream_module._MAP_MIN and entries["big"].start % 4096 != 0
    target, sink = tmp_path / "copy.safetensors", HashingSink()
    produced = torch.randn(3)
    planned = [Planned("small", entries["small"], path, lambda: produced)]
    planned += [Planned(key, entries[key], path) for key in ("big", "big2")]
    write_streaming(target, planned, metadata, sink)
    data = target.read_bytes()
    assert sink.written() == WrittenFile(len(data), hashlib.sha256(data).hexdigest())
    back = load_file(str(target))
    assert torch.equal(back["big"], tensors["big"]) and torch.equal(back["big2"], tensors["big2"])
    assert torch.equal(back["small"], produced)
    assert kernel != "short" or calls


def test_a_source_shorter_than_its_header_says_is_refused_with_a_sink(tmp_path: Path) -> None:
    from service.engine.safetensors_stream import HashingSink

    path = tmp_path / "cut.safetensors"
    save_file({"big": torch.randn(700, 1000)}, str(path))
    entries, metadata = read_header(path)
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(ValueError, match="ended 100 bytes early"):
        write_streaming(tmp_path / "out.safetensors", [Planned("big", entries["big"], path)], metadata, HashingSink())


def test_a_file_that_cannot_be_mapped_is_read_and_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib
    import mmap

    from service.engine.safetensors_stream import HashingSink

    def unmappable(*_args: object, **_kwargs: object) -> mmap.mmap:
        raise OSError(errno.ENODEV, "no mmap here")

    monkeypatch.setattr(mmap, "mmap", unmappable)
    path = tmp_path / "large.safetensors"
    save_file({"big": torch.randn(700, 1000)}, str(path))
    entries, metadata = read_header(path)
    target, sink = tmp_path / "out.safetensors", HashingSink()
    write_streaming(target, [Planned("big", entries["big"], path)], metadata, sink)
    data = target.read_bytes()
    assert sink.written().sha256 == hashlib.sha256(data).hexdigest()
    assert torch.equal(load_file(str(target))["big"], load_file(str(path))["big"])
