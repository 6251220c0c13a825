"""A LoRA adapter directory as ``PeftModel.save_pretrained`` writes it (or as vLLM loads it):
``adapter_model.safetensors``, ``adapter_config.json`` and the service's ``lora_report.json``.

The factors come from :mod:`service.engine.lora` (one :class:`~service.engine.lora.LayerLora` per
edited layer, computed layer by layer from its float64 delta).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from service.engine.errors import EditError
from service.engine.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, KEY_PREFIX, REPORT_FILE, LayerLora, servable_by_vllm
from service.engine.lora_rules import EXACT_RTOL, LoraTarget

# ---------------------------------------------------------------- the adapter directory


def adapter_tensors(loras: Sequence[LayerLora]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the keys ``PeftModel.save_pretrained`` writes (a conv's as peft's
    conv LoRA holds them: ``lora_A`` ``[r, C_in, *kernel]``, ``lora_B`` ``[out, r, 1, 1]``).

    With any biased layer, every layer gets ``lora_B.bias`` (peft's ``lora_bias`` is adapter-wide):
    zeros where the base layer has no bias.
    """
    with_bias = any(lora.bias is not None for lora in loras)
    tensors: dict[str, torch.Tensor] = {}
    for lora in loras:
        prefix = f"{KEY_PREFIX}{lora.name}"
        lora_a, lora_b = lora.lora_A, lora.lora_B
        if lora.kernel is not None:  # peft's conv LoRA: A a conv of the layer's kernel, B a 1×1 conv
            ones = (1,) * len(lora.kernel.kernel_size)
            lora_a = lora_a.reshape(lora.rank, lora.kernel.in_channels, *lora.kernel.kernel_size)
            lora_b = lora_b.reshape(lora_b.shape[0], lora.rank, *ones)
        tensors[f"{prefix}.lora_A.weight"] = lora_a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = lora_b.contiguous()
        if with_bias:
            bias = lora.bias if lora.bias is not None else lora.lora_B.new_zeros(lora.lora_B.shape[0])
            tensors[f"{prefix}.lora_B.bias"] = bias.contiguous()
    return tensors


def exact_pattern(names: Iterable[str]) -> str:
    """A regex that matches exactly these module paths (peft full-matches a string ``target_modules``)."""
    return "^(?:" + "|".join(re.escape(name) for name in names) + ")$"


def adapter_config(
    model_id: str, loras: Sequence[LayerLora], lora_target: LoraTarget = "peft", task_type: str | None = "CAUSAL_LM"
) -> dict[str, Any]:
    """``adapter_config.json`` for the layers: LoRA with scaling 1 and one rank per layer.

    Args:
        model_id: the base model's ID (``base_model_name_or_path``).
        loras: the adapter's layers (at least one).
        lora_target: ``"vllm"``: every layer has rank ``r``, so no rank/alpha patterns (vLLM reads none).
        task_type: peft's ``task_type``, which picks the ``PeftModel`` class that wraps the model:
            ``None`` for a model peft has no task for (an image classifier: ``PeftModelForCausalLM``
            would call its ``prepare_inputs_for_generation``, which it lacks).

    Returns:
        The config as peft's ``LoraConfig`` reads it (unlisted fields take peft's defaults).
    """
    top = max(lora.rank for lora in loras)
    # peft matches a pattern key k as r"(.*\.)?(k)$": escaped full paths match one module each.
    ranks = {re.escape(lora.name): lora.rank for lora in loras} if lora_target == "peft" else {}
    return {
        "peft_type": "LORA",
        "task_type": task_type,
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
    loras: Sequence[LayerLora],
    max_rank: int | None,
    rtol: float,
    tied: Mapping[str, Sequence[str]],
    lora_target: LoraTarget = "peft",
) -> dict[str, Any]:
    """Per-layer ranks, errors and kept energy, totals, and whether peft can merge the adapter safely.

    Args:
        loras: the adapter's layers.
        max_rank: the rank cap that was asked for (``None``: exact, or for vLLM the smallest rank
            that holds every layer).
        rtol: the numerical-rank cut.
        tied: layer -> the parameters sharing its base weight (``lm_head`` -> ``model.embed_tokens.weight``).
        lora_target: what the adapter was written for.
    """
    delta_energy = sum(lora.delta_norm**2 for lora in loras)
    error_energy = sum((lora.relative_error * lora.delta_norm) ** 2 for lora in loras)
    kept = sum(lora.kept_energy * lora.delta_norm**2 for lora in loras)
    parameters = sum(t.numel() for t in adapter_tensors(loras).values())
    dense = sum(lora.lora_B.shape[0] * (lora.lora_A.shape[1] + int(lora.bias is not None)) for lora in loras)
    notes = _merge_notes(loras, tied)
    return {
        "lora_target": lora_target,
        "max_rank": max_rank,
        "rtol": rtol,
        "r": max(lora.rank for lora in loras),
        "dtype": str(loras[0].lora_A.dtype).removeprefix("torch."),
        "layers": {lora.name: lora.report() for lora in loras},
        "totals": {
            "layers": len(loras),
            "truncated_layers": sum(lora.truncated for lora in loras),
            "relative_error": math.sqrt(error_energy / delta_energy) if delta_energy > 0 else 0.0,
            "max_relative_error": max(lora.relative_error for lora in loras),
            "max_stored_relative_error": max(lora.stored_relative_error for lora in loras),
            "kept_energy": kept / delta_energy if delta_energy > 0 else 1.0,
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
    lora_target: LoraTarget = "peft",
    task_type: str | None = "CAUSAL_LM",
) -> dict[str, Any]:
    """Write a PEFT adapter directory: config, safetensors weights and ``lora_report.json``.

    Layers are factorized as ``loras`` yields them; only their factors are kept until the end.

    Args:
        target: an existing, empty directory.
        model_id: the base model's ID, written as ``base_model_name_or_path``.
        loras: the layers' factors (from :func:`layer_loras`, with the same ``lora_target``).
        max_rank: the rank cap ``loras`` used, for the report; for vLLM the adapter's rank (``None``:
            the smallest rank vLLM serves that holds every layer's kept directions).
        rtol: the numerical-rank cut ``loras`` used, for the report.
        tied: layer -> the parameters sharing its base weight.
        on_layer: progress callback, once per layer.
        lora_target: ``"vllm"``: every layer padded to the one rank, no bias (see the module notes).
        task_type: peft's ``task_type`` (:func:`adapter_config`).

    Returns:
        The report (also written to ``lora_report.json``).

    Raises:
        EditError: no layer to adapt, or a layer with a bias edit for vLLM.
    """
    kept = []
    for lora in loras:
        kept.append(lora)
        if on_layer is not None:
            on_layer()
    if not kept:
        raise EditError("the edit changes no layer, so there is no adapter to write")
    if lora_target == "vllm":
        kept = servable_by_vllm(kept, max_rank)
    save_file(adapter_tensors(kept), str(target / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (target / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(model_id, kept, lora_target, task_type), indent=2))
    report = adapter_report(kept, max_rank, rtol, tied or {}, lora_target)
    (target / REPORT_FILE).write_text(json.dumps(report, indent=2))
    return report
