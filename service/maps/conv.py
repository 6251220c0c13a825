"""A convolution's engram drawn inside the layer: per output channel (which filters hold the concept)
and per kernel position (where in the receptive field it lies).

A conv layer's engram ``E`` is ``[C_out, C_in · Π kernel (+1)]`` on the unfolded patch, channel-major
as ``F.unfold`` orders it (:mod:`service.engine.conv`): column ``c · K + k`` is input channel ``c`` at
flat kernel position ``k`` (``K = Π kernel``), the bias column last. Reshaped to
``[C_out, C_in, *kernel]`` it splits two ways, each with the map's measure:

- ``channels[o]``: row ``o`` of ``E`` against row ``o`` of ``[W | b]``: ``‖e_o‖ / ‖w_o‖`` (``weight``:
  weight columns, as W-Norm), or ``sqrt(e_o Σ_U e_oᵀ / w_o Σ_U w_oᵀ)`` (``data``: the share of
  output channel ``o``, on the universe's inputs, that the engram accounts for);
- ``kernel[i][j]``: the columns of position ``(i, j)`` over every input channel, ``E_k`` against
  ``W_k``: ``‖E_k‖_F / ‖W_k‖_F``, or ``sqrt(tr(E_k Σ_kk E_kᵀ) / tr(W_k Σ_kk W_kᵀ))`` with ``Σ_kk`` the
  universe's second moment of that position's inputs alone (the share position ``k`` carries by
  itself; positions interact through ``Σ``'s off-diagonal blocks, which this leaves out, so a
  value can exceed 1).

A Conv1d's kernel is one row (``1 × k``). Any ratio with a zero denominator (a channel or position
the data never reaches) is 0.
"""

from __future__ import annotations

import math

import torch

from service.engine.compose import COMPUTE_DTYPE
from service.engine.layers import LayerSpec
from service.maps.document import ConvBreakdown


def conv_breakdown(spec: LayerSpec, engram: torch.Tensor, weight: torch.Tensor, sigma: torch.Tensor | None) -> ConvBreakdown:
    """One conv layer's engram per output channel and per kernel position.

    Args:
        spec: a conv layer (``spec.kernel`` set).
        engram: ``[C_out, patch (+1)]`` float64, the bias column last when ``spec.bias``.
        weight: ``[W | b]`` in the same layout (:func:`service.engine.compose.augmented_weight`).
        sigma: the universe's ``Σ_U`` over the same columns (``data`` measure), or ``None`` (``weight``).

    Returns:
        ``{"channels": [C_out values], "kernel": [[...]] (kh × kw, or 1 × k)}``.

    Raises:
        ValueError: not a conv layer, or shapes that do not match its patch.
    """
    kernel = spec.kernel
    if kernel is None:
        raise ValueError(f"layer {spec.name} is not a convolution")
    width = kernel.patch_width
    if engram.shape != weight.shape or engram.shape[1] != width + int(spec.bias):
        raise ValueError(f"layer {spec.name}: engram {tuple(engram.shape)} and weight {tuple(weight.shape)} ≠ its patch")
    e, w = engram.to(COMPUTE_DTYPE), weight.to(COMPUTE_DTYPE)
    if sigma is None:
        channels = _ratios(e[:, :width].square().sum(1), w[:, :width].square().sum(1))
    else:
        s = sigma.to(COMPUTE_DTYPE)
        channels = _ratios(((e @ s) * e).sum(1), ((w @ s) * w).sum(1))
    positions = math.prod(kernel.kernel_size)
    columns = torch.arange(width).reshape(width // positions, positions)  # [C_in, K]: channel-major
    per_position = []
    for k in range(positions):
        index = columns[:, k]
        e_k, w_k = e[:, index], w[:, index]
        if sigma is None:
            removed, output = float(e_k.square().sum()), float(w_k.square().sum())
        else:
            s_kk = sigma.to(COMPUTE_DTYPE)[index][:, index]
            removed, output = float(((e_k @ s_kk) * e_k).sum()), float(((w_k @ s_kk) * w_k).sum())
        per_position.append(_ratio(removed, output))
    rows = kernel.kernel_size[0] if kernel.spatial_dims == 2 else 1
    grid = [per_position[r * (positions // rows) : (r + 1) * (positions // rows)] for r in range(rows)]
    return {"channels": channels, "kernel": grid}


def _ratio(removed: float, output: float) -> float:
    return math.sqrt(max(removed, 0.0) / output) if output > 0 else 0.0


def _ratios(removed: torch.Tensor, output: torch.Tensor) -> list[float]:
    return [_ratio(float(r), float(o)) for r, o in zip(removed, output, strict=True)]
