"""Engram edits as PEFT LoRA adapters: ``ΔW ≈ B·A`` per layer, loadable with ``PeftModel.from_pretrained``.

A layer's edit ``ΔW = f_l · W · (Σ_k c_k Σ_k) · Σ_universe⁺`` has rank at most the number of
tokens in the edited concepts (each ``Σ_k`` is a sum of that many outer products). So when the
concepts hold fewer tokens than the layer is wide, a LoRA of that rank is the edit itself; past
that, or under a rank cap, the SVD is truncated and the report gives each layer's relative error.

Conventions, checked against peft 0.21 in ``tests/engine/test_lora.py``:

- Keys are ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight``
  ``[out, r]`` (plus ``lora_B.bias`` ``[out]``), for ``Conv1D`` too: peft keeps A and B in Linear
  orientation and only transposes when merging (``fan_in_fan_out``).
- The scaling ``lora_alpha / r`` is 1 in every layer: the global ``r`` and ``lora_alpha`` are both
  the largest rank, and ``rank_pattern`` = ``alpha_pattern`` give each layer its own. A server that
  ignores the patterns and computes ``lora_alpha / r`` once per adapter still scales by 1.
- Bias changes go to ``lora_B.bias`` (peft's ``lora_bias=True``) when every adapted layer has a
  bias, so biased layers are exact too. peft's switch is adapter-wide, and ``merge_and_unload``
  refuses a ``lora_bias`` on a layer without a bias (a ResNet's convs beside its biased head,
  Qwen2's bias-free ``o_proj`` beside its biased ``q_proj``). Such a mixed adapter has no
  ``lora_bias``: its biased layers' edited biases are stored whole as their base layers' bias
  (peft's ``bias="lora_only"``, keys ``<module>.base_layer.bias``), which ``PeftModel`` loads into
  the base model; it merges, and serves, as the checkpoint variant. The report says that
  ``disable_adapter()`` and ``unload()`` then keep the edited biases.
- A tied ``lm_head`` gets its own LoRA: served unmerged it changes the head's output only and the
  embedding keeps its values. Merging would add ``B·A`` into the shared tensor and so change the
  embedding as well; the report says when that applies.

Everything is computed in float64 and cast to the checkpoint's dtype at the end; the report gives
the error before and after that cast, and compares the adapter's size with the dense edit's (past
``r = out·in / (out + in)`` an exact adapter is the larger of the two).

``lora_target="vllm"`` writes what vLLM's LoRA loader takes (checked against its ``PEFTHelper``
and ``LoRAModel.from_local_checkpoint``): vLLM reads the global ``r`` and ``lora_alpha`` only
(scaling ``lora_alpha / r`` for the whole adapter, no rank or alpha patterns), refuses an ``r``
above the server's ``--max-lora-rank`` (one of :data:`~api_schemas.VLLM_LORA_RANKS`), and
knows no ``lora_B.bias`` key. So every layer gets the same rank ``r`` from that set,
``lora_alpha = r``, and no bias: a layer whose edit moves a bias cannot be served and is refused by
name (:func:`~service.engine.lora_rules.vllm_bias_refusal`); a LoRA computes ``B·A·x`` and cannot
add a constant. A layer whose edit has fewer directions than ``r`` (or a matrix narrower than
``r``) is padded with zero directions, which change nothing; one with more is truncated to its top
``r`` singular directions, and the report gives the share of ``‖ΔW‖_F²`` they keep.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from service.engine.compose import COMPUTE_DTYPE, LayerDelta
from service.engine.errors import EditError
from service.engine.layers import ConvKernel
from service.engine.lora_rules import EXACT_RTOL, LoraTarget, rank_cap, vllm_bias_refusal, vllm_rank

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
REPORT_FILE = "lora_report.json"
KEY_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Factorization:
    """``delta ≈ up · down`` with singular values split evenly (``up = U√S``, ``down = √S Vᵀ``).

    Attributes:
        up: ``[out, r]`` float64 (LoRA's B).
        down: ``[r, in]`` float64 (LoRA's A).
        numerical_rank: singular values above ``rtol · σ₁``.
        relative_error: ``‖delta − up·down‖_F / ‖delta‖_F`` (0 for a zero delta).
        kept_energy: ``Σ_{i≤r} σ_i² / Σ_i σ_i²`` (1 for a zero delta).
        norm: ``‖delta‖_F``.
    """

    up: torch.Tensor
    down: torch.Tensor
    numerical_rank: int
    relative_error: float
    kept_energy: float
    norm: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


def factorize(delta: torch.Tensor, max_rank: int | None = None, rtol: float = EXACT_RTOL) -> Factorization:
    """Rank-r factors of a matrix by a float64 SVD: its numerical rank, or fewer under ``max_rank``.

    Args:
        delta: ``[out, in]``, any float dtype (factorized in float64).
        max_rank: the largest rank to keep; ``None`` keeps the numerical rank.
        rtol: relative singular-value cut of the numerical rank.

    Returns:
        The factors. The rank is at least 1 (peft has no rank-0 layer): a zero matrix gives zero factors.

    Raises:
        ValueError: not a finite matrix, ``max_rank < 1`` or ``rtol`` outside ``[0, 1)``.
    """
    if delta.ndim != 2:
        raise ValueError(f"delta must be a matrix, got shape {tuple(delta.shape)}")
    if max_rank is not None and max_rank < 1:
        raise ValueError(f"max_rank must be >= 1, got {max_rank}")
    if not 0.0 <= rtol < 1.0:
        raise ValueError(f"rtol must be in [0, 1), got {rtol}")
    matrix = delta.to(COMPUTE_DTYPE)
    if not torch.isfinite(matrix).all():
        raise ValueError("delta is not finite")
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    top = float(s[0]) if s.numel() else 0.0
    numerical = int((s > rtol * top).sum()) if top > 0 else 0
    rank = max(1, min(numerical, max_rank if max_rank is not None else numerical))
    root = s[:rank].sqrt()
    up, down = u[:, :rank] * root, root[:, None] * vh[:rank]
    energy = float(s.square().sum())
    norm = float(matrix.norm())
    return Factorization(
        up.contiguous(),
        down.contiguous(),
        numerical,
        relative_error(matrix, up @ down, norm),
        float(s[:rank].square().sum()) / energy if energy > 0 else 1.0,
        norm,
    )


def relative_error(exact: torch.Tensor, approx: torch.Tensor, norm: float | None = None) -> float:
    """``‖exact − approx‖_F / ‖exact‖_F`` in float64 (0 when both are zero, inf for a non-zero approx of 0)."""
    diff = float((exact.to(COMPUTE_DTYPE) - approx.to(COMPUTE_DTYPE)).norm())
    denom = float(exact.to(COMPUTE_DTYPE).norm()) if norm is None else norm
    if denom == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / denom


@dataclass(frozen=True)
class LayerLora:
    """One layer's adapter, in the checkpoint's dtype, and how well it reproduces the edit.

    Attributes:
        name: the module path (``model.layers.0.self_attn.q_proj``).
        lora_A: ``[r, in]``.
        lora_B: ``[out, r]``.
        bias: the bias change ``[out]``, ``None`` for a layer without bias.
        scale: the layer's ``f_l``.
        numerical_rank: the edit's rank at the factorization's ``rtol``.
        relative_error: ``‖ΔW − B·A‖_F / ‖ΔW‖_F`` with float64 factors (weights only: the bias is exact).
        stored_relative_error: the same with the factors as stored (cast to the checkpoint's dtype).
        kept_energy: the share of ``‖ΔW‖_F²`` in the kept singular values.
        delta_norm: ``‖ΔW‖_F``.
        transposed: the base layer stores ``[in, out]`` (GPT-2 ``Conv1D``).
        kernel: the base layer's, for a convolution: the factors are kept ``[r, in]`` / ``[out, r]``
            here and written as peft's conv LoRA shapes (:func:`~service.engine.lora_files.adapter_tensors`).
        kept_rank: the singular directions the factors carry; past it, up to ``rank``, zero padding
            (``None``: no padding, ``rank``).
        edited_bias: the layer's new bias as the checkpoint variant stores it (``None`` without a
            bias): what a mixed adapter stores whole (see the module notes).
    """

    name: str
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    bias: torch.Tensor | None
    scale: float
    numerical_rank: int
    relative_error: float
    stored_relative_error: float
    kept_energy: float
    delta_norm: float
    transposed: bool
    kept_rank: int | None = None
    kernel: ConvKernel | None = None
    edited_bias: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[0])

    @property
    def directions(self) -> int:
        """The singular directions kept (the rank without zero padding)."""
        return self.rank if self.kept_rank is None else self.kept_rank

    @property
    def truncated(self) -> bool:
        return self.directions < self.numerical_rank

    def report(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "kept_rank": self.directions,
            "numerical_rank": self.numerical_rank,
            "relative_error": self.relative_error,
            "stored_relative_error": self.stored_relative_error,
            "kept_energy": self.kept_energy,
            "delta_norm": self.delta_norm,
            "scale": self.scale,
            "bias": self.bias is not None,
        }


def layer_lora(
    item: LayerDelta, max_rank: int | None = None, rtol: float = EXACT_RTOL, lora_target: LoraTarget = "peft"
) -> LayerLora:
    """Factorize one layer's edit (its weight columns; the bias column is kept whole).

    Args:
        item: the layer's float64 delta from :func:`service.engine.compose.layer_deltas`.
        max_rank: rank cap (``None``: the numerical rank; for vLLM, at most the largest rank it serves).
        rtol: relative singular-value cut of the numerical rank.
        lora_target: ``"vllm"``: a layer with a bias is refused (vLLM loads no LoRA bias).

    Returns:
        The layer's factors in the checkpoint weight's dtype.

    Raises:
        EditError: the edit is not finite, or a biased layer for vLLM.
        ValueError: a rank vLLM does not serve.
    """
    spec = item.spec
    if spec.kernel is not None and (reason := spec.kernel.adapter_refusal(lora_target)):
        raise EditError(
            f'lora_target "{lora_target}" cannot carry the edit of layer {spec.name}: {reason}; use format '
            '"checkpoint" or "delta"'
        )
    if lora_target == "vllm" and spec.bias:
        raise EditError(vllm_bias_refusal([spec]))
    if not torch.isfinite(item.delta).all():
        raise EditError(f"the edit of layer {spec.name} is not finite; try a larger rcond")
    weight_delta = item.delta[:, : spec.in_features]
    factors = factorize(weight_delta, rank_cap(max_rank, lora_target), rtol)
    # One nn.Linear holds lora_B's weight and bias, so both take the weight's dtype.
    dtype = item.weights.weight.dtype
    lora_a, lora_b = factors.down.to(dtype), factors.up.to(dtype)
    bias = item.delta[:, spec.in_features].to(dtype).contiguous() if spec.bias else None
    return LayerLora(
        name=spec.name,
        lora_A=lora_a,
        lora_B=lora_b,
        bias=bias,
        scale=item.scale,
        numerical_rank=factors.numerical_rank,
        relative_error=factors.relative_error,
        stored_relative_error=relative_error(weight_delta, lora_b.to(COMPUTE_DTYPE) @ lora_a.to(COMPUTE_DTYPE)),
        kept_energy=factors.kept_energy,
        delta_norm=factors.norm,
        transposed=spec.transposed,
        kernel=spec.kernel,
        edited_bias=_edited_bias(item),
    )


def _edited_bias(item: LayerDelta) -> torch.Tensor | None:
    """``b + Δb`` summed in float64 and cast to the bias's dtype, as the checkpoint writer does."""
    old = item.weights.bias
    if not item.spec.bias or old is None:
        return None
    return (old.to(COMPUTE_DTYPE) + item.delta[:, item.spec.in_features]).to(old.dtype).contiguous()


def layer_loras(
    deltas: Iterable[LayerDelta],
    max_rank: int | None = None,
    rtol: float = EXACT_RTOL,
    lora_target: LoraTarget = "peft",
) -> Iterator[LayerLora]:
    """:func:`layer_lora` over a stream of deltas, one layer in memory at a time."""
    rank_cap(max_rank, lora_target)  # a bad rank is refused before the first delta is computed
    for item in deltas:
        yield layer_lora(item, max_rank, rtol, lora_target)


def pad_rank(lora: LayerLora, rank: int) -> LayerLora:
    """The layer's factors widened to ``rank`` with zero directions (``B·A`` unchanged).

    Raises:
        ValueError: the layer already has more than ``rank`` directions.
    """
    if lora.rank > rank:
        raise ValueError(f"layer {lora.name} has rank {lora.rank}, more than {rank}")
    extra = rank - lora.rank
    lora_a = torch.cat([lora.lora_A, lora.lora_A.new_zeros(extra, lora.lora_A.shape[1])])
    lora_b = torch.cat([lora.lora_B, lora.lora_B.new_zeros(lora.lora_B.shape[0], extra)], dim=1)
    return replace(lora, lora_A=lora_a.contiguous(), lora_B=lora_b.contiguous(), kept_rank=lora.directions)


def servable_by_vllm(loras: Sequence[LayerLora], rank: int | None) -> list[LayerLora]:
    """Every layer at one rank vLLM serves (``rank``, or the smallest that holds them all), zero-padded.

    Raises:
        EditError: a layer carries a bias change (vLLM has no LoRA bias).
        ValueError: a rank vLLM does not serve, or a layer with more directions than ``rank``.
    """
    biased = [lora.name for lora in loras if lora.bias is not None]
    if biased:
        raise EditError(f"vLLM loads no LoRA bias, and the edit changes the bias of {', '.join(biased)}")
    rank_cap(rank, "vllm")
    chosen = vllm_rank(lora.rank for lora in loras) if rank is None else rank
    return [pad_rank(lora, chosen) for lora in loras]
