"""The rules an adapter request is checked against before any LoRA is computed: the targets, the
exactness cut, and what vLLM serves (see :mod:`service.engine.lora` for why each rule holds).

Pure rules, no torch: the API refuses a request that breaks one (a rank vLLM does not serve, a
biased layer in a vLLM adapter) with these, and the variant job factors its edits by the same.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Literal

from api_schemas import VLLM_LORA_RANKS
from service.engine.layers import LayerSpec

# Singular values at or below EXACT_RTOL · σ₁ are taken as zero. The collector's per-batch float32
# products leave a rounding floor near 1e-7 · σ₁ under a concept's directions; on mini-TOFU this cut
# lands exactly on the forget set's 98 completion tokens (62 distinct at layer 0's attention input)
# and drops under 1e-6 of ‖ΔW‖ (a float32 checkpoint's own rounding is ~3e-8 of it).
EXACT_RTOL = 1e-6
LoraTarget = Literal["peft", "vllm"]


def rank_cap(max_rank: int | None, lora_target: LoraTarget) -> int | None:
    """The factorization's rank cap: ``max_rank``; for vLLM one of its ranks, at most the largest.

    Raises:
        ValueError: an unknown target, or for vLLM a rank it does not serve.
    """
    if lora_target == "peft":
        return max_rank
    if lora_target != "vllm":
        raise ValueError(f"unknown lora_target {lora_target!r}: 'peft' or 'vllm'")
    if max_rank is None:
        return VLLM_LORA_RANKS[-1]
    if max_rank not in VLLM_LORA_RANKS:
        allowed = ", ".join(map(str, VLLM_LORA_RANKS))
        raise ValueError(f"lora_rank {max_rank} is not a rank vLLM serves; use one of {allowed}")
    return max_rank


def vllm_rank(directions: Iterable[int]) -> int:
    """The smallest rank vLLM serves that holds every layer's kept directions (at most the largest)."""
    need = max(directions, default=1)
    return next((rank for rank in VLLM_LORA_RANKS if rank >= need), VLLM_LORA_RANKS[-1])


def vllm_biased_layers(layers: Iterable[LayerSpec]) -> list[LayerSpec]:
    """The layers vLLM cannot take an edit of: those with a bias (the edit moves it; vLLM has no LoRA bias)."""
    return [spec for spec in layers if spec.bias]


def vllm_bias_refusal(biased: Sequence[LayerSpec], selected: Sequence[LayerSpec] = ()) -> str:
    """What to tell a user whose vLLM adapter would need ``lora_bias``: the layers, and what to do.

    Args:
        biased: the selected layers with a bias.
        selected: the whole selection, to suggest the ``modules`` that have no bias.
    """
    names = ", ".join(spec.name for spec in biased)
    biased_suffixes = {spec.name.rsplit(".", 1)[-1] for spec in biased}
    bias_free = list(dict.fromkeys(s.name.rsplit(".", 1)[-1] for s in selected if not s.bias))
    keep = [suffix for suffix in bias_free if suffix not in biased_suffixes]
    suggestion = f'select bias-free layers ("modules": {json.dumps(keep)}), ' if keep else ""
    return (
        f'lora_target "vllm": vLLM loads no LoRA bias (lora_bias), and the edit changes the bias of '
        f"{len(biased)} selected layer(s): {names}. To serve it with vLLM, {suggestion}or use format "
        '"checkpoint" or "delta" (the whole edit, biases included); lora_target "peft" keeps the bias edits in '
        "lora_bias for PeftModel"
    )
