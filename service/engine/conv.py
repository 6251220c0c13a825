"""Convolutions as editable layers: ``nn.Conv2d`` and ``nn.Conv1d`` with ``groups == 1``.

A convolution is one linear map applied at every output position: the position's *patch* (the
``C_in · kh · kw`` input values its kernel covers, with the conv's padding, stride and dilation,
channel-major as ``F.unfold`` orders them) times the flattened weight ``[C_out, C_in · kh · kw]``,
plus the bias. So the engram formula holds unchanged with the patch as the layer's input: the
statistic is ``Σ p pᵀ`` over every output position of every counted input (``[p; 1]`` with a bias,
as for a Linear layer), the token count is the number of output positions, and the edited flat
weight is reshaped back to ``[C_out, C_in, *kernel]``. :mod:`service.engine.editable` does the
reshape; :mod:`service.engine.collect` feeds the patches from here into the same sums as a
Linear layer's rows.

Refused by name (:func:`conv_refusal`), never edited wrongly:

- ``groups > 1``, depthwise included (ConvNeXt, MobileNet, EfficientNet, RegNet). Each group reads
  its own channels, so each needs a covariance of its own (``G`` matrices of ``(C_in/G · k)²``);
  the service's statistics, universes and engram files hold one matrix per input group of a layer.
  Folding the groups into one block-diagonal matrix of the full patch width would fit that format
  but cost ``(C_in · k)²``: 11 GB in float64 for one 7×7 depthwise conv of ConvNeXt-T's last stage
  (768 channels), against 15 MB for the 768 per-group matrices. So grouped convs wait for
  statistics stored per group rather than being made to fit at that price.
- ``padding_mode`` other than ``'zeros'`` (reflect, replicate, circular): the patch would read
  values the zero-padded unfold does not.
- Subclasses that override ``forward`` (a weight-standardised conv transforms its weight first: the
  stored weight is not the linear map) and every other convolution type (``Conv3d``, transposed).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F  # noqa: N812  (torch's own spelling)
from torch import nn

from service.engine.layers import ConvKernel

# Values of one unfolded chunk (records × positions × patch width) before its product is summed:
# 16M float32 values, 64 MB, or one record's unfold when that is larger (ResNet-50 at 224²: 1.8M at
# most; a record is not split, so a megapixel input to a wide 3×3 conv is one large chunk).
PATCH_CHUNK_VALUES = 1 << 24


def is_conv(module: nn.Module) -> bool:
    """Any convolution torch defines (``Conv1d/2d/3d`` and the transposed ones)."""
    return isinstance(module, nn.modules.conv._ConvNd)


def conv_refusal(module: nn.Module) -> str | None:
    """Why the service does not edit this convolution, or ``None`` when it does."""
    kind = type(module).__name__
    if not isinstance(module, nn.Conv1d | nn.Conv2d):
        return f"{kind} is not an edited layer type (Conv1d and Conv2d are)"
    base: type[nn.Conv1d | nn.Conv2d] = nn.Conv2d if isinstance(module, nn.Conv2d) else nn.Conv1d
    if type(module).forward is not base.forward or type(module)._conv_forward is not base._conv_forward:
        return f"{kind} computes its own forward, so its stored weight may not be the map it applies"
    if module.padding_mode != "zeros":
        return f"padding_mode {module.padding_mode!r}: only zero padding is unfolded (the patch would read other values)"
    if module.groups > 1:
        depthwise = " (depthwise)" if module.groups == module.in_channels else ""
        return (
            f"groups={module.groups}{depthwise}: each group needs a covariance of its own, which the "
            "service's statistics do not hold yet (one full-width matrix would cost (C_in·k)² memory)"
        )
    return None


def conv_kernel(module: nn.Conv1d | nn.Conv2d) -> ConvKernel:
    """The :class:`ConvKernel` of a supported convolution (see :func:`conv_refusal`)."""
    kernel = tuple(int(k) for k in module.kernel_size)
    dilation = tuple(int(d) for d in module.dilation)
    return ConvKernel(
        kind="conv2d" if isinstance(module, nn.Conv2d) else "conv1d",
        in_channels=int(module.in_channels),
        kernel_size=kernel,
        stride=tuple(int(s) for s in module.stride),
        padding=_explicit_padding(module.padding, kernel, dilation),
        dilation=dilation,
        groups=int(module.groups),
    )


Pads = tuple[tuple[int, int], ...]


def _explicit_padding(padding: str | tuple[int, ...], kernel: tuple[int, ...], dilation: tuple[int, ...]) -> Pads:
    """``(before, after)`` per dimension; ``'same'`` puts the odd zero after, as torch does."""
    if padding == "valid":
        return tuple((0, 0) for _ in kernel)
    if padding == "same":
        totals = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
        return tuple((total // 2, total - total // 2) for total in totals)
    if isinstance(padding, str):
        raise ValueError(f"unknown convolution padding {padding!r}: torch pads 'valid', 'same' or by sizes")
    return tuple((int(p), int(p)) for p in padding)


def unfold_patches(x: torch.Tensor, kernel: ConvKernel) -> torch.Tensor:
    """Every output position's patch: ``[B, C_in, *spatial]`` -> ``[B, L, C_in · Π k]``.

    Columns are channel-major, then kernel offsets in row-major order: the order of
    ``weight.reshape(C_out, -1)``. A Conv1d is unfolded as a Conv2d one row high.
    """
    if kernel.spatial_dims == 1:
        x = x.unsqueeze(2)
        sizes, strides, dilations = (1, *kernel.kernel_size), (1, *kernel.stride), (1, *kernel.dilation)
        pads = ((0, 0), *kernel.padding)
    else:
        sizes, strides, dilations, pads = kernel.kernel_size, kernel.stride, kernel.dilation, kernel.padding
    # F.pad takes the last dimension first; padding here keeps 'same''s asymmetric pads exact.
    flat_pads = [value for pair in reversed(pads) for value in pair]
    if any(flat_pads):
        x = F.pad(x, flat_pads)
    columns = F.unfold(x, kernel_size=sizes, dilation=dilations, stride=strides)  # [B, D, L]
    return columns.transpose(1, 2)


def patch_chunks(
    x: torch.Tensor, kernel: ConvKernel, dtype: torch.dtype, positions: torch.Tensor | None = None
) -> Iterator[torch.Tensor]:
    """The counted patches of ``x`` as ``[n, D]`` rows, a few records at a time (bounded memory).

    Args:
        x: the conv's input, ``[B, C_in, *spatial]``.
        kernel: how it reads it.
        dtype: the rows' dtype (the input is cast before unfolding).
        positions: ``[B, L]`` booleans, the output positions that count (``None``: all of them).

    Yields:
        Fresh ``[n, C_in · Π k]`` tensors (copies, safe to keep), records in order.
    """
    per_record = max(1, math.prod(kernel.output_length(s, d) for d, s in enumerate(x.shape[2:])) * kernel.patch_width)
    step = max(1, PATCH_CHUNK_VALUES // per_record)
    for first in range(0, x.shape[0], step):
        patches = unfold_patches(x[first : first + step].to(dtype), kernel)
        if positions is None:
            yield patches.reshape(-1, patches.shape[-1])
        else:
            yield patches[positions[first : first + step].to(patches.device)]
