"""The bfloat16 -> float32 widening of :func:`service.engine.arithmetic.apply_engrams` (a shift of
the bits, see ``_widen_into``) against torch's own conversion, on every bfloat16 bit pattern, and a
bfloat16 variant layer against the plain torch ops the arithmetic stood for before, bit for bit."""

from __future__ import annotations

import pytest
import torch

from service.engine.arithmetic import _widen_into, apply_engrams
from service.engine.compose import LayerWeights
from service.engine.layers import LayerSpec

pytestmark = pytest.mark.fast
GEN = torch.Generator().manual_seed(27)


def test_every_bfloat16_pattern_widens_to_torchs_float32() -> None:
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    acc = torch.full((patterns.numel(),), 7.0)
    _widen_into(acc, patterns)
    assert torch.equal(acc.view(torch.int32), patterns.to(torch.float32).view(torch.int32))  # NaN bits too


def test_a_strided_slice_widens_in_place_and_other_dtypes_are_copied() -> None:
    matrix = torch.randn(64, 40, generator=GEN).to(torch.bfloat16)
    acc = torch.empty(64, 33)
    _widen_into(acc, matrix[:, :33])  # a column slice (a stored engram's bias column left out)
    assert torch.equal(acc, matrix[:, :33].to(torch.float32))
    half = torch.randn(8, 8, generator=GEN).to(torch.float16)
    acc16 = torch.empty(8, 8)
    _widen_into(acc16, half)
    assert torch.equal(acc16, half.to(torch.float32))


@pytest.mark.parametrize("terms", [1, 3])
def test_a_bfloat16_layer_matches_the_plain_torch_sum_bit_for_bit(terms: int) -> None:
    spec = LayerSpec("blocks.0.fc", 300, 700, True, False, 0)
    weight = (torch.randn(700, 300, generator=GEN) * 0.02).to(torch.bfloat16)
    bias = (torch.randn(700, generator=GEN) * 0.02).to(torch.bfloat16)
    engrams = [(c, (torch.randn(700, 301, generator=GEN) * 1e-3).to(torch.bfloat16)) for c in (-0.7, 1.3, 0.25)[:terms]]
    edit = apply_engrams(spec, LayerWeights(weight, bias), engrams, 1.0)
    # The reference: torch's own conversions, in the order apply_engrams documents (one term: W + c·E;
    # several: Δ = Σ c_k E_k first, then W + Δ), each block a float32 sum rounded once to bfloat16.
    if terms == 1:
        expected = weight.to(torch.float32).add_(engrams[0][1][:, :300], alpha=engrams[0][0])
    else:
        delta = engrams[0][1][:, :300].to(torch.float32).mul_(engrams[0][0])
        for coefficient, engram in engrams[1:]:
            delta.add_(engram[:, :300], alpha=coefficient)
        expected = delta.add_(weight)
    assert torch.equal(edit.weight.view(torch.int16), expected.to(torch.bfloat16).view(torch.int16))
