"""Stored engrams applied to a layer: the same arithmetic as the float64 edit path, block by block."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from service.engine import arithmetic as arithmetic_module
from service.engine.arithmetic import apply_engrams, combined_norm
from service.engine.compose import LayerWeights, layer_edits
from service.engine.errors import EditError
from service.engine.layers import LayerSpec
from service.engrams.store import StoredEngrams

GEN = torch.Generator().manual_seed(0)


class Fixed:
    """An engram source that returns one fixed float64 delta (the path variants used before)."""

    def __init__(self, delta: torch.Tensor) -> None:
        self.delta = delta

    def engram(self, spec: LayerSpec, weights: LayerWeights) -> torch.Tensor:
        return self.delta


def layer(transposed: bool, bias: bool, dtype: torch.dtype) -> tuple[LayerSpec, LayerWeights]:
    spec = LayerSpec("blocks.0.fc", 24, 37, bias, transposed, 0)
    weight = torch.randn(24, 37, generator=GEN) if transposed else torch.randn(37, 24, generator=GEN)
    return spec, LayerWeights(weight.to(dtype), torch.randn(37, generator=GEN).to(dtype) if bias else None)


@pytest.mark.parametrize(
    ("dtype", "stored"),
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.bfloat16, torch.bfloat16),  # what universes store for bfloat16 checkpoints
        (torch.bfloat16, torch.float32),  # universes built before bfloat16 engrams
        (torch.float16, torch.float32),
    ],
)
@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize(("transposed", "bias"), [(False, False), (True, True), (False, True)])
def test_applying_stored_engrams_equals_the_float64_edit(
    transposed: bool, bias: bool, count: int, dtype: torch.dtype, stored: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float32 and 16-bit checkpoints are edited in float32 from float32 or 16-bit engrams, float64
    ones in float64: each within four of its dtype's ulps of the summands' size from the float64
    formula (on the stored engrams) rounded once."""
    monkeypatch.setattr(arithmetic_module, "APPLY_BLOCK_VALUES", 100)  # many blocks, the last one short
    spec, weights = layer(transposed, bias, dtype)
    engrams = [torch.randn(37, spec.stat_dim, generator=GEN).to(stored) * 0.1 for _ in range(count)]
    coefficients, scale = [-0.8, 0.3, 1.7][:count], 0.6
    delta = sum(c * e.double() for c, e in zip(coefficients, engrams, strict=True))  # layer_edits scales it
    [expected] = layer_edits([spec], Fixed(delta), lambda _s: weights, {spec.name: scale})
    edit = apply_engrams(spec, weights, [(scale * c, e) for c, e in zip(coefficients, engrams, strict=True)], scale)
    assert edit.weight.dtype == weights.weight.dtype and edit.weight.shape == weights.weight.shape

    # The float64 sums differ from the reference's in the last bits (Σ (f·c_k) E_k against
    # f · Σ c_k E_k): a few float64 ulps of the summands' size, which can flip the one rounding to
    # a float32 checkpoint's dtype: one float32 ulp.
    def flat(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        w = w.double().T if transposed else w.double()
        return torch.cat([w, b.double()[:, None]], dim=1) if b is not None else w

    size = flat(weights.weight, weights.bias).abs() + sum(
        abs(scale * c) * e.double().abs() for c, e in zip(coefficients, engrams, strict=True)
    )
    assert (edit.bias is None) == (not bias)
    gap = (flat(edit.weight, edit.bias) - flat(expected.weight, expected.bias)).abs()
    assert bool((gap <= 4 * torch.finfo(dtype).eps * size).all()), float((gap / size).max())
    assert edit.scale == scale


def test_a_non_finite_engram_is_refused_by_layer_name() -> None:
    spec, weights = layer(False, False, torch.float32)
    engram = torch.zeros(37, 24)
    engram[20, 3] = float("nan")
    with pytest.raises(EditError, match="blocks.0.fc"):
        apply_engrams(spec, weights, [(1.0, engram)], 1.0)
    with pytest.raises(EditError, match="blocks.0.fc"):
        apply_engrams(spec, weights, [(1.0, torch.zeros(36, 24))], 1.0)


def test_combined_norm_is_the_norm_of_the_weight_columns_of_the_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arithmetic_module, "APPLY_BLOCK_VALUES", 50)
    spec = LayerSpec("blocks.0.fc", 24, 37, True, False, 0)
    engrams = [torch.randn(37, 25, generator=GEN) for _ in range(2)]
    expected = float((0.5 * engrams[0].double() - 2.0 * engrams[1].double())[:, :24].norm())
    assert combined_norm(spec, [(0.5, engrams[0]), (-2.0, engrams[1])]) == pytest.approx(expected, rel=1e-13)


def test_stored_engrams_merge_a_file_named_twice_and_refuse_other_layers(tmp_path: Path) -> None:
    spec = LayerSpec("blocks.0.fc", 24, 37, False, False, 0)
    file = tmp_path / "member.safetensors"
    engram = torch.randn(37, 24, generator=GEN)
    save_file({spec.name: engram}, str(file))
    stored = StoredEngrams([(-1.0, file), (0.25, file)], [spec.name])
    assert stored.terms == [(-0.75, file)]
    assert torch.allclose(stored.engram(spec, LayerWeights(torch.empty(0), None)), -0.75 * engram.double())
    other = LayerSpec("blocks.1.fc", 24, 37, False, False, 1)
    with pytest.raises(EditError, match="no statistics for layer blocks.1.fc"):
        stored.read(other)
