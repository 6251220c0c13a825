"""The streaming safetensors writer: files that safetensors itself reads back bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

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
        Planned(key, entries[key], source, (lambda k=key: replaced[k]) if key in replaced else None) for key in entries
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
