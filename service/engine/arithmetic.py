"""Variants from stored engrams: ``[W | b] + Σ_k c_k · E_k`` one layer at a time, in row blocks.

A universe stores each member's engram ``E_k`` per layer (:mod:`service.engrams`); a variant of it is
this arithmetic on the checkpoint's weights and those engrams, with no decomposition and no
``O·D²`` product (:mod:`service.engine.compose` has the algebra that builds the engrams). Float32
and 16-bit checkpoints are summed in float32, float64 ones in float64 (see :func:`apply_engrams`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from service.engine.compose import COMPUTE_DTYPE, LayerEdit, LayerWeights
from service.engine.editable import stored_weight, weight_matrix
from service.engine.errors import EditError
from service.engine.layers import LayerSpec

# Values per block of :func:`apply_engrams`: 1 MB of float32, in a core's cache, and big enough for
# torch to share an elementwise op among its threads. Measured on the 2-core machine, quiet, for a
# bf16 8192 x 2048 layer and one term: 23 ms with 32K-value blocks (one thread per op, the
# per-op cost dominating), 15 ms with 256K on one thread, 10 ms on two; a 1B-shaped variant's
# arithmetic went from 1.2 s to about 0.3 s. (On a machine whose cores are all taken a two-thread
# op can stall for a time slice; a worker normally has its cores.)
APPLY_BLOCK_VALUES = 1 << 18

# Checkpoint and engram dtypes whose edits are summed in float32 (see :func:`apply_engrams`);
# anything else (a float64 checkpoint, a float64 engram) sums in float64.
_FLOAT32_SUM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def apply_engrams(
    spec: LayerSpec, weights: LayerWeights, terms: Sequence[tuple[float, torch.Tensor]], scale: float
) -> LayerEdit:
    """``[W | b] + Σ_k c_k · E_k`` for one layer, cast back to the checkpoint's dtype.

    For engrams already computed (a universe's stored ``E_k``, ``[out, in(+1)]``), done a block of
    rows at a time, so a layer costs one read of ``W`` and of each engram, and is refused when the
    result is not finite.

    Precision: a float32 or 16-bit checkpoint with float32 or 16-bit engrams (universes store
    float32 engrams for float32 and float16 checkpoints, bfloat16 ones for bfloat16 checkpoints)
    is edited in float32: the terms are summed first (``Δ = Σ c_k E_k``: its rounding is relative
    to the *edit's* size, about ``k`` float32 ulps of ``Σ|c_k E_k|``), then added to ``W`` with one
    rounding, which is the rounding the checkpoint's own dtype makes anyway. One term is a single
    fused ``W + c·E`` (one rounding). This is a third of the memory traffic of summing in float64
    and measured within the exactness bars of tests/engrams and tests/variants. A float64 checkpoint
    or a float64 engram is summed in float64, as :func:`~service.engine.compose.layer_edits` does.

    Args:
        spec: the layer.
        weights: its base parameters, in checkpoint layout and dtype.
        terms: ``(c_k · f_l, E_k)`` per engram.
        scale: the layer's ``f_l``, recorded on the edit.

    Raises:
        EditError: a term's shape does not fit the layer, or the result is not finite.
    """
    for _, engram in terms:
        if tuple(engram.shape) != (spec.out_features, spec.stat_dim):
            raise EditError(
                f"the engram of layer {spec.name} is {tuple(engram.shape)}, not {(spec.out_features, spec.stat_dim)}"
            )
    if spec.bias and weights.bias is None:
        raise EditError(f"layer {spec.name} has statistics with a bias column but no bias tensor")
    if not terms:
        raise EditError(f"the edit of layer {spec.name} has no engram")
    new_w = torch.empty((spec.out_features, spec.in_features), dtype=weights.weight.dtype)
    bias = (
        (weights.bias, torch.empty(spec.out_features, dtype=weights.bias.dtype))
        if spec.bias and weights.bias is not None
        else None
    )
    if _sums_in_float32(weights, terms):
        _add_in_float32(spec, weights, terms, new_w, bias)
    else:
        _add_in_float64(spec, weights, terms, new_w, bias)
    new_b = bias[1] if bias is not None else None
    weight = stored_weight(new_w, spec)
    return LayerEdit(spec, weight, new_b, scale)


def _sums_in_float32(weights: LayerWeights, terms: Sequence[tuple[float, torch.Tensor]]) -> bool:
    dtypes = [weights.weight.dtype] + ([weights.bias.dtype] if weights.bias is not None else [])
    return all(d in _FLOAT32_SUM_DTYPES for d in dtypes) and all(e.dtype in _FLOAT32_SUM_DTYPES for _, e in terms)


# A layer's bias pair: (the stored bias, the new bias the sum is written into); None for no bias.
_BiasPair = tuple[torch.Tensor, torch.Tensor]


def _add_in_float64(
    spec: LayerSpec,
    weights: LayerWeights,
    terms: Sequence[tuple[float, torch.Tensor]],
    new_w: torch.Tensor,
    bias: _BiasPair | None,
) -> None:
    """``new_w | new_b = [W | b] + Σ c_k E_k``, summed in float64, one cast at the end."""
    w = weight_matrix(weights.weight, spec)
    for first, acc in _row_blocks(spec.out_features, spec.stat_dim, COMPUTE_DTYPE):
        last = first + acc.shape[0]
        acc[:, : spec.in_features].copy_(w[first:last])
        if bias is not None:
            acc[:, spec.in_features].copy_(bias[0][first:last])
        for coefficient, engram in terms:
            acc.add_(engram[first:last], alpha=coefficient)  # a float32 engram is promoted value by value
        # A NaN or an infinity anywhere makes the block's sum non-finite (a sum of finite weights
        # cannot overflow float64): one reduction, where isfinite().all() costs two passes.
        if not math.isfinite(float(acc.sum())):
            raise EditError(f"the edit of layer {spec.name} is not finite; try a larger rcond")
        new_w[first:last].copy_(acc[:, : spec.in_features])
        if bias is not None:
            bias[1][first:last].copy_(acc[:, spec.in_features])


def _add_in_float32(
    spec: LayerSpec,
    weights: LayerWeights,
    terms: Sequence[tuple[float, torch.Tensor]],
    new_w: torch.Tensor,
    bias: _BiasPair | None,
) -> None:
    """``new_w | new_b = [W | b] + Σ c_k E_k`` in float32 (see :func:`apply_engrams`); the bias
    column (one value per output) is summed in float64.

    A float32 checkpoint is written by one fused op per block (``W + c·E``, or ``W + Δ``). A 16-bit
    one is summed in a float32 block and cast once on the copy out: torch's mixed-dtype ops round
    ``c·E`` to 16 bits when both operands are 16-bit, and its mixed-dtype add into a 16-bit output
    runs at half the speed of a float32 add and a cast.
    """
    w = weight_matrix(weights.weight, spec)
    cols = spec.in_features
    block_rows = max(1, APPLY_BLOCK_VALUES // spec.stat_dim)
    to_float32 = new_w.dtype == torch.float32
    buffer = None if to_float32 and len(terms) == 1 else torch.empty((block_rows, cols), dtype=torch.float32)
    for first in range(0, spec.out_features, block_rows):
        last = min(first + block_rows, spec.out_features)
        target = new_w[first:last]
        rows = [(c, e[first:last, :cols]) for c, e in terms]
        if buffer is None:  # float32, one term: a single, fused, singly rounded W + c·E
            torch.add(w[first:last], rows[0][1], alpha=rows[0][0], out=target)
        else:
            acc = buffer[: last - first]
            if len(rows) == 1:  # W + c·E in float32, rounded once to 16 bits below
                _widen_into(acc, w[first:last])
                acc.add_(rows[0][1], alpha=rows[0][0])
            else:  # Δ = Σ c_k E_k first: its rounding is relative to the edit's size
                _widen_into(acc, rows[0][1])
                acc.mul_(rows[0][0])
                for coefficient, engram in rows[1:]:
                    acc.add_(engram, alpha=coefficient)
                if to_float32:
                    torch.add(w[first:last], acc, out=target)
                else:
                    acc.add_(w[first:last])
            if not to_float32:
                target.copy_(acc)
        _require_finite(spec, target)
    if bias is not None:
        stored_b, new_b = bias
        summed = stored_b.to(COMPUTE_DTYPE)
        for coefficient, engram in terms:
            summed.add_(engram[:, cols], alpha=coefficient)
        _require_finite(spec, summed)
        new_b.copy_(summed)


def _widen_into(acc: torch.Tensor, values: torch.Tensor) -> None:
    """``acc.copy_(values)`` into a float32 ``acc``; a bfloat16 ``values`` by moving its bits.

    A bfloat16 is the upper half of the float32 of the same value, so the exact conversion is a
    16-bit shift of the integers: copying int16 into int32 (sign-extended) and shifting left by 16
    leaves exactly those bits. torch's own bfloat16 -> float32 ``copy_`` (torch 2.13, CPU) runs at
    about 1.2 ns a value on one core, the shift about 0.15: on a 1B-shaped variant's ~380M values
    that is ~0.4 s of a ~0.7 s arithmetic. Every bfloat16 bit pattern (NaN, infinities,
    subnormals included) gives the bits ``copy_`` gives (tests/engine/test_arithmetic_widen.py).
    """
    if values.dtype != torch.bfloat16 or acc.dtype != torch.float32:
        acc.copy_(values)
        return
    bits = acc.view(torch.int32)
    bits.copy_(values.view(torch.int16))
    bits.bitwise_left_shift_(16)


def _require_finite(spec: LayerSpec, block: torch.Tensor) -> None:
    """Refuse a block with a NaN or an infinity: one float32 sum, and the exact test only when that
    sum is not finite (large finite values can overflow a float32 sum)."""
    if not math.isfinite(float(block.sum())) and not bool(torch.isfinite(block).all()):
        raise EditError(f"the edit of layer {spec.name} is not finite; try a larger rcond")


def combined_norm(spec: LayerSpec, terms: Sequence[tuple[float, torch.Tensor]]) -> float:
    """``‖Σ_k c_k · E_k[:, :in]‖_F`` (W-Norm's numerator) in float64, a block of rows at a time."""
    total = 0.0
    for first, acc in _row_blocks(spec.out_features, spec.in_features, COMPUTE_DTYPE):
        last = first + acc.shape[0]
        acc.zero_()
        for coefficient, engram in terms:
            acc.add_(engram[first:last, : spec.in_features], alpha=coefficient)
        total += float(acc.square_().sum())
    return math.sqrt(total)


def _row_blocks(rows: int, width: int, dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, a [block rows, width] buffer)`` for every block of ``rows`` (one buffer, reused);
    a block holds about :data:`APPLY_BLOCK_VALUES` values."""
    buffer = torch.empty((max(1, APPLY_BLOCK_VALUES // width), width), dtype=dtype)
    for first in range(0, rows, buffer.shape[0]):
        yield first, buffer[: min(buffer.shape[0], rows - first)]
