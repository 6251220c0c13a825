"""One member's engrams ``E_k,l = W_l · Σ_k · Σ_U⁺`` for every layer of a universe, written to one file.

The products are :class:`~service.engine.compose.EngramAlgebra`'s (float64, the cheapest order per
input group, ``Σ_k·Σ_U⁺`` once per group then ``W·that`` per layer, or ``(W·Σ_k)·Σ_U⁺`` for a wide
input read by a narrow layer), fed the universe's stored pseudo-inverse factors instead of
decomposing anything. The file is written layer by layer (header first), so only one layer's engram
is ever in memory.

Precision: an engram is stored in its weight's dtype where that costs no accuracy the variant
keeps: float64 for float64 weights, bfloat16 for bfloat16 weights, float32 for float32 and float16
weights (float16's range, 65504, could overflow an engram). A float32 engram differs from the
float64 product by at most half a float32 ulp per value (relative 6e-8); a bfloat16 engram by half a
bfloat16 ulp (2⁻⁹ relative, plus 2⁻²⁴ from torch's float64 → float32 → bfloat16 cast), which is
the rounding the variant's bfloat16 weights get anyway: a variant's value is within one bfloat16
ulp of the summands' size of the float64 formula rounded once (tests/engrams), and reading half the
bytes is what keeps a bfloat16 model's variant near its copy floor (README, Performance).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from service.engine.compose import COMPUTE_DTYPE, EngramAlgebra, GroupedStatistics, LayerWeights
from service.engine.layers import LayerSpec
from service.engine.linalg import PinvFactors
from service.engine.safetensors_stream import Planned, TensorEntry, write_streaming
from service.engrams.format import ENGRAMS_FORMAT, engram_dtype

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16}


@dataclass
class MemberEngrams:
    """What a member's engram file holds besides the tensors (its ``.json`` sidecar).

    Attributes:
        norms: layer -> ``‖E_l[:, :in]‖_F`` of the stored engram (W-Norm's numerator for this member alone).
        weight_norms: layer -> ``‖W_l‖_F`` (W-Norm's denominator).
        dtypes: layer -> stored dtype.
        nbytes: the file's size.
    """

    norms: dict[str, float] = field(default_factory=dict)
    weight_norms: dict[str, float] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "format": ENGRAMS_FORMAT,
            "norms": self.norms,
            "weight_norms": self.weight_norms,
            "dtypes": self.dtypes,
            "bytes": self.nbytes,
        }


def write_member_engrams(
    target: Path,
    stats: GroupedStatistics,
    layers: Sequence[LayerSpec],
    factors_of: Callable[[str], PinvFactors],
    load: Callable[[LayerSpec], LayerWeights],
    weight_dtype: Callable[[LayerSpec], str],
    on_layer: Callable[[], None] | None = None,
    device: str = "cpu",
) -> MemberEngrams:
    """Compute and write one member's engram of every layer in ``layers`` (keys: layer names).

    Args:
        target: the safetensors file to write.
        stats: the member's statistics (its ``Σ_k`` per input group).
        layers: the universe's layers, in layout order (layers of one input group adjacent).
        factors_of: layer name -> the universe's stored pseudo-inverse factors of its input group.
        load: reads a layer's weights from the checkpoint.
        weight_dtype: a layer's stored weight dtype (``F32``, ``BF16``, ``F64``…), from the header.
        on_layer: called after each layer.
        device: where the float64 products run (``"cuda"`` when a GPU is there; see
            :class:`~service.engine.compose.EngramAlgebra`).

    Returns:
        The norms and sizes of what was written.
    """
    algebra = EngramAlgebra([(1.0, stats)], [], factor_source=factors_of, device=device)
    info = MemberEngrams()
    planned = []
    for spec in layers:
        dtype = engram_dtype(weight_dtype(spec))
        info.dtypes[spec.name] = dtype
        shape = [spec.out_features, spec.stat_dim]
        entry = TensorEntry(dtype, shape, 0, spec.out_features * spec.stat_dim * _DTYPES[dtype].itemsize)
        planned.append(Planned(spec.name, entry, target, partial(_one_layer, spec, algebra, load, info, on_layer)))
    write_streaming(target, planned, {"format": ENGRAMS_FORMAT})
    info.nbytes = target.stat().st_size
    return info


def _one_layer(
    spec: LayerSpec,
    algebra: EngramAlgebra,
    load: Callable[[LayerSpec], LayerWeights],
    info: MemberEngrams,
    on_layer: Callable[[], None] | None,
) -> torch.Tensor:
    weights = load(spec)
    engram = algebra.engram(spec, weights).to(_DTYPES[info.dtypes[spec.name]])
    info.norms[spec.name] = float(engram[:, : spec.in_features].to(COMPUTE_DTYPE).norm())
    info.weight_norms[spec.name] = float(weights.weight.to(COMPUTE_DTYPE).norm())
    if on_layer is not None:
        on_layer()
    return engram
