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
- Bias changes go to ``lora_B.bias`` (peft's ``lora_bias=True``), so biased layers are exact too.
  peft's switch is adapter-wide: bias-free layers of such an adapter carry a zero bias, which is
  exact when serving but which ``merge_and_unload`` refuses to merge.
- A tied ``lm_head`` gets its own LoRA: served unmerged it changes the head's output only and the
  embedding keeps its values. Merging would add ``B·A`` into the shared tensor and so change the
  embedding as well; the report says when that applies.

Everything is computed in float64 and cast to the checkpoint's dtype at the end; the report gives
the error before and after that cast, and compares the adapter's size with the dense edit's (past
``r = out·in / (out + in)`` an exact adapter is the larger of the two).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from service.engine.compose import COMPUTE_DTYPE, EditError, LayerDelta

# Singular values at or below EXACT_RTOL · σ₁ are taken as zero. The collector's per-batch float32
# products leave a rounding floor near 1e-7 · σ₁ under a concept's directions; on mini-TOFU this cut
# lands exactly on the forget set's 98 completion tokens (62 distinct at layer 0's attention input)
# and drops under 1e-6 of ‖ΔW‖ (a float32 checkpoint's own rounding is ~3e-8 of it).
EXACT_RTOL = 1e-6
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

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[0])

    def report(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "numerical_rank": self.numerical_rank,
            "relative_error": self.relative_error,
            "stored_relative_error": self.stored_relative_error,
            "kept_energy": self.kept_energy,
            "delta_norm": self.delta_norm,
            "scale": self.scale,
            "bias": self.bias is not None,
        }


def layer_lora(item: LayerDelta, max_rank: int | None = None, rtol: float = EXACT_RTOL) -> LayerLora:
    """Factorize one layer's edit (its weight columns; the bias column is kept whole).

    Args:
        item: the layer's float64 delta from :func:`service.engine.compose.layer_deltas`.
        max_rank: rank cap (``None``: the numerical rank).
        rtol: relative singular-value cut of the numerical rank.

    Returns:
        The layer's factors in the checkpoint weight's dtype.

    Raises:
        EditError: the edit is not finite.
    """
    spec = item.spec
    if not torch.isfinite(item.delta).all():
        raise EditError(f"the edit of layer {spec.name} is not finite; try a larger rcond")
    weight_delta = item.delta[:, : spec.in_features]
    factors = factorize(weight_delta, max_rank, rtol)
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
    )


def layer_loras(deltas: Iterable[LayerDelta], max_rank: int | None = None, rtol: float = EXACT_RTOL) -> Iterator[LayerLora]:
    """:func:`layer_lora` over a stream of deltas, one layer in memory at a time."""
    for item in deltas:
        yield layer_lora(item, max_rank, rtol)


# ---------------------------------------------------------------- the adapter directory


def adapter_tensors(loras: Sequence[LayerLora]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the keys ``PeftModel.save_pretrained`` writes.

    With any biased layer, every layer gets ``lora_B.bias`` (peft's ``lora_bias`` is adapter-wide):
    zeros where the base layer has no bias.
    """
    with_bias = any(lora.bias is not None for lora in loras)
    tensors: dict[str, torch.Tensor] = {}
    for lora in loras:
        prefix = f"{KEY_PREFIX}{lora.name}"
        tensors[f"{prefix}.lora_A.weight"] = lora.lora_A.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = lora.lora_B.contiguous()
        if with_bias:
            bias = lora.bias if lora.bias is not None else lora.lora_B.new_zeros(lora.lora_B.shape[0])
            tensors[f"{prefix}.lora_B.bias"] = bias.contiguous()
    return tensors


def exact_pattern(names: Iterable[str]) -> str:
    """A regex that matches exactly these module paths (peft full-matches a string ``target_modules``)."""
    return "^(?:" + "|".join(re.escape(name) for name in names) + ")$"


def adapter_config(model_id: str, loras: Sequence[LayerLora]) -> dict[str, Any]:
    """``adapter_config.json`` for the layers: LoRA with scaling 1 and one rank per layer.

    Args:
        model_id: the base model's ID (``base_model_name_or_path``).
        loras: the adapter's layers (at least one).

    Returns:
        The config as peft's ``LoraConfig`` reads it (unlisted fields take peft's defaults).
    """
    top = max(lora.rank for lora in loras)
    # peft matches a pattern key k as r"(.*\.)?(k)$": escaped full paths match one module each.
    ranks = {re.escape(lora.name): lora.rank for lora in loras}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_id,
        "revision": None,
        "r": top,
        "lora_alpha": top,
        "rank_pattern": ranks,
        "alpha_pattern": dict(ranks),
        "target_modules": exact_pattern(lora.name for lora in loras),
        "lora_dropout": 0.0,
        # Describes the Conv1D layers; peft sets it per module anyway (False for an nn.Linear head).
        "fan_in_fan_out": any(lora.transposed for lora in loras),
        "bias": "none",
        "lora_bias": any(lora.bias is not None for lora in loras),
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
    }


def adapter_report(
    loras: Sequence[LayerLora], max_rank: int | None, rtol: float, tied: Mapping[str, Sequence[str]]
) -> dict[str, Any]:
    """Per-layer ranks and errors, totals, and whether peft can merge the adapter safely.

    Args:
        loras: the adapter's layers.
        max_rank: the rank cap that was asked for (``None``: exact).
        rtol: the numerical-rank cut.
        tied: layer -> the parameters sharing its base weight (``lm_head`` -> ``model.embed_tokens.weight``).
    """
    delta_energy = sum(lora.delta_norm**2 for lora in loras)
    error_energy = sum((lora.relative_error * lora.delta_norm) ** 2 for lora in loras)
    parameters = sum(t.numel() for t in adapter_tensors(loras).values())
    dense = sum(lora.lora_B.shape[0] * (lora.lora_A.shape[1] + int(lora.bias is not None)) for lora in loras)
    notes = _merge_notes(loras, tied)
    return {
        "max_rank": max_rank,
        "rtol": rtol,
        "r": max(lora.rank for lora in loras),
        "dtype": str(loras[0].lora_A.dtype).removeprefix("torch."),
        "layers": {lora.name: lora.report() for lora in loras},
        "totals": {
            "layers": len(loras),
            "truncated_layers": sum(lora.rank < lora.numerical_rank for lora in loras),
            "relative_error": math.sqrt(error_energy / delta_energy) if delta_energy > 0 else 0.0,
            "max_relative_error": max(lora.relative_error for lora in loras),
            "max_stored_relative_error": max(lora.stored_relative_error for lora in loras),
            "min_kept_energy": min(lora.kept_energy for lora in loras),
            "parameters": parameters,
            "dense_parameters": dense,
        },
        "mergeable": not notes,
        "notes": notes,
    }


def _merge_notes(loras: Sequence[LayerLora], tied: Mapping[str, Sequence[str]]) -> list[str]:
    notes = [
        f"{lora.name} shares its weight with {', '.join(tied[lora.name])}: serve the adapter unmerged "
        f"(merge_and_unload would change {', '.join(tied[lora.name])} too)"
        for lora in loras
        if tied.get(lora.name)
    ]
    bias_free = [lora.name for lora in loras if lora.bias is None]
    if bias_free and len(bias_free) < len(loras):
        notes.append(
            f"lora_bias is adapter-wide in peft: the bias-free layers {', '.join(bias_free)} carry a zero "
            "lora_B.bias, exact when served, but peft refuses to merge them"
        )
    return notes


def write_adapter(
    target: Path,
    model_id: str,
    loras: Iterable[LayerLora],
    *,
    max_rank: int | None = None,
    rtol: float = EXACT_RTOL,
    tied: Mapping[str, Sequence[str]] | None = None,
    on_layer: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Write a PEFT adapter directory: config, safetensors weights and ``lora_report.json``.

    Layers are factorized as ``loras`` yields them; only their factors are kept until the end.

    Args:
        target: an existing, empty directory.
        model_id: the base model's ID, written as ``base_model_name_or_path``.
        loras: the layers' factors (from :func:`layer_loras`).
        max_rank: the rank cap ``loras`` used, for the report.
        rtol: the numerical-rank cut ``loras`` used, for the report.
        tied: layer -> the parameters sharing its base weight.
        on_layer: progress callback, once per layer.

    Returns:
        The report (also written to ``lora_report.json``).

    Raises:
        EditError: no layer to adapt.
    """
    kept = []
    for lora in loras:
        kept.append(lora)
        if on_layer is not None:
            on_layer()
    if not kept:
        raise EditError("the edit changes no layer, so there is no adapter to write")
    save_file(adapter_tensors(kept), str(target / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (target / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(model_id, kept), indent=2))
    report = adapter_report(kept, max_rank, rtol, tied or {})
    (target / REPORT_FILE).write_text(json.dumps(report, indent=2))
    return report
