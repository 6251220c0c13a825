"""A LoRA adapter directory as ``PeftModel.save_pretrained`` writes it (or as vLLM loads it):
``adapter_model.safetensors``, ``adapter_config.json`` and the service's ``lora_report.json``.

The factors come from :mod:`service.engine.lora` (one :class:`~service.engine.lora.LayerLora` per
edited layer, computed layer by layer from its float64 delta).

``base_model_name_or_path`` is what ``AutoPeftModel*.from_pretrained(adapter_dir)`` loads the base
from (:func:`adapter_base`): the name the request gave (a folder or hub name), else the hub name of
a model registered from ``hf://``, else the service's model ID, which the report says is neither.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer
from safetensors.torch import save_file

from service.engine.errors import EditError
from service.engine.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, KEY_PREFIX, REPORT_FILE, LayerLora, servable_by_vllm
from service.engine.lora_rules import EXACT_RTOL, LoraTarget

# ---------------------------------------------------------------- the base model it names

HF_SCHEME = "hf://"


@dataclass(frozen=True)
class AdapterBase:
    """The base model an adapter names in ``adapter_config.json``.

    Attributes:
        name: ``base_model_name_or_path``.
        revision: peft's ``revision`` (the hub revision of an ``hf://org/name@rev`` model).
        note: why ``name`` will not load by itself (the service's model ID), for the report.
    """

    name: str
    revision: str | None = None
    note: str | None = None


def adapter_base(model_id: str, source: str, requested: str | None = None) -> AdapterBase:
    """The base model an adapter of ``model_id`` names.

    Args:
        model_id: the service's model ID.
        source: the model's registered source (``file://``, ``s3://`` or ``hf://org/name[@revision]``,
            validated at registration).
        requested: the request's ``adapter_base_model`` (a folder or hub name), which wins.
    """
    if requested is not None:
        return AdapterBase(requested)
    if source.startswith(HF_SCHEME):
        name, _, revision = source.removeprefix(HF_SCHEME).partition("@")
        return AdapterBase(name, revision or None)
    return AdapterBase(
        model_id,
        note=(
            f"base_model_name_or_path is the service's model ID {model_id!r}, not a folder or hub name, so "
            "AutoPeftModel.from_pretrained(adapter_dir) cannot find the base by itself: load the base model "
            "and call PeftModel.from_pretrained(base, adapter_dir), or set adapter_base_model on the edit "
            "request to the base model's folder or hub name"
        ),
    )


# ---------------------------------------------------------------- the adapter directory

# How an adapter carries its layers' bias changes (see service.engine.lora): "lora_bias" when every
# layer has a bias, "base_bias" (edited biases stored whole, peft bias "lora_only") when only some do.
BiasLayout = Literal["none", "lora_bias", "base_bias"]


def bias_layout(loras: Sequence[LayerLora]) -> BiasLayout:
    """``lora_bias`` only where peft can merge it (every layer has a bias), else whole biases."""
    biased = [lora.bias is not None for lora in loras]
    if not any(biased):
        return "none"
    return "lora_bias" if all(biased) else "base_bias"


def adapter_tensors(loras: Sequence[LayerLora]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the keys ``PeftModel.save_pretrained`` writes (a conv's as peft's
    conv LoRA holds them: ``lora_A`` ``[r, C_in, *kernel]``, ``lora_B`` ``[out, r, 1, 1]``).

    Bias changes (:func:`bias_layout`): as ``lora_B.bias`` when every layer has a bias; when only some
    do, their edited biases whole as ``base_layer.bias`` (what peft's ``bias="lora_only"`` saves).

    Raises:
        ValueError: a mixed adapter's biased layer without its edited bias.
    """
    layout = bias_layout(loras)
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
        if layout == "lora_bias" and lora.bias is not None:
            tensors[f"{prefix}.lora_B.bias"] = lora.bias.contiguous()
        elif layout == "base_bias" and lora.bias is not None:
            if lora.edited_bias is None:
                raise ValueError(f"layer {lora.name} has a bias change but no edited bias to store")
            tensors[f"{prefix}.base_layer.bias"] = lora.edited_bias.contiguous()
    return tensors


def exact_pattern(names: Iterable[str]) -> str:
    """A regex that matches exactly these module paths (peft full-matches a string ``target_modules``)."""
    return "^(?:" + "|".join(re.escape(name) for name in names) + ")$"


def adapter_config(
    model_id: str | AdapterBase,
    loras: Sequence[LayerLora],
    lora_target: LoraTarget = "peft",
    task_type: str | None = "CAUSAL_LM",
) -> dict[str, Any]:
    """``adapter_config.json`` for the layers: LoRA with scaling 1 and one rank per layer.

    Args:
        model_id: the base model (``base_model_name_or_path`` and ``revision``; a string: the name).
        loras: the adapter's layers (at least one).
        lora_target: ``"vllm"``: every layer has rank ``r``, so no rank/alpha patterns (vLLM reads none).
        task_type: peft's ``task_type``, which picks the ``PeftModel`` class that wraps the model:
            ``None`` for a model peft has no task for (an image classifier: ``PeftModelForCausalLM``
            would call its ``prepare_inputs_for_generation``, which it lacks).

    Returns:
        The config as peft's ``LoraConfig`` reads it (unlisted fields take peft's defaults).
    """
    base = model_id if isinstance(model_id, AdapterBase) else AdapterBase(model_id)
    layout = bias_layout(loras)
    top = max(lora.rank for lora in loras)
    # peft matches a pattern key k as r"(.*\.)?(k)$": escaped full paths match one module each.
    ranks = {re.escape(lora.name): lora.rank for lora in loras} if lora_target == "peft" else {}
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base.name,
        "revision": base.revision,
        "r": top,
        "lora_alpha": top,
        "rank_pattern": ranks,
        "alpha_pattern": dict(ranks),
        "target_modules": exact_pattern(lora.name for lora in loras),
        "lora_dropout": 0.0,
        # Describes the Conv1D layers; peft sets it per module anyway (False for an nn.Linear head).
        "fan_in_fan_out": any(lora.transposed for lora in loras),
        "bias": "lora_only" if layout == "base_bias" else "none",
        "lora_bias": layout == "lora_bias",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
    }


class LayerReport(BaseModel):
    """One layer of an adapter's report (:meth:`service.engine.lora.LayerLora.report`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    kept_rank: int
    numerical_rank: int
    relative_error: float
    stored_relative_error: float
    kept_energy: float
    delta_norm: float
    scale: float
    bias: bool


class ReportTotals(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: int
    truncated_layers: int
    relative_error: float
    max_relative_error: float
    max_stored_relative_error: float
    kept_energy: float
    min_kept_energy: float
    parameters: int
    dense_parameters: int


class AdapterReport(BaseModel):
    """A peft adapter's ``lora_report.json`` (:func:`adapter_report`), shown on its variant.

    ``base_model_name_or_path`` and ``revision`` only when the report names the base model (left
    out otherwise, as the file always had them).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_model_name_or_path: str | None = None
    revision: str | None = None
    lora_target: LoraTarget
    max_rank: int | None
    rtol: float
    r: int
    dtype: str
    layers: dict[str, LayerReport]
    totals: ReportTotals
    bias: str
    mergeable: bool
    notes: list[str]

    @model_serializer(mode="wrap")
    def _as_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.base_model_name_or_path is None:  # no base model named: neither key
            data.pop("base_model_name_or_path", None)
            data.pop("revision", None)
        return data


def adapter_report(
    loras: Sequence[LayerLora],
    max_rank: int | None,
    rtol: float,
    tied: Mapping[str, Sequence[str]],
    lora_target: LoraTarget = "peft",
    base: AdapterBase | None = None,
) -> AdapterReport:
    """Per-layer ranks, errors and kept energy, totals, whether peft can merge the adapter safely, and
    notes on loading it (the merge's obstacles first).

    Args:
        loras: the adapter's layers.
        max_rank: the rank cap that was asked for (``None``: exact, or for vLLM the smallest rank
            that holds every layer).
        rtol: the numerical-rank cut.
        tied: layer -> the parameters sharing its base weight (``lm_head`` -> ``model.embed_tokens.weight``).
        lora_target: what the adapter was written for.
        base: the base model the config names (given: the report repeats it, with its note).
    """
    delta_energy = sum(lora.delta_norm**2 for lora in loras)
    error_energy = sum((lora.relative_error * lora.delta_norm) ** 2 for lora in loras)
    kept = sum(lora.kept_energy * lora.delta_norm**2 for lora in loras)
    parameters = sum(t.numel() for t in adapter_tensors(loras).values())
    dense = sum(lora.lora_B.shape[0] * (lora.lora_A.shape[1] + int(lora.bias is not None)) for lora in loras)
    blocking = _merge_notes(loras, tied)
    notes = blocking + _loading_notes(loras, base)
    base_fields = {} if base is None else {"base_model_name_or_path": base.name, "revision": base.revision}
    report = {
        **base_fields,
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
        "bias": bias_layout(loras),
        "mergeable": not blocking,
        "notes": notes,
    }
    return AdapterReport.model_validate(report)


def _merge_notes(loras: Sequence[LayerLora], tied: Mapping[str, Sequence[str]]) -> list[str]:
    notes = [
        f"{lora.name} shares its weight with {', '.join(tied[lora.name])}: serve the adapter unmerged "
        f"(merge_and_unload would change {', '.join(tied[lora.name])} too)"
        for lora in loras
        if tied.get(lora.name)
    ]
    return notes


def _loading_notes(loras: Sequence[LayerLora], base: AdapterBase | None) -> list[str]:
    """What loading the adapter does or needs that peft does not say by itself."""
    notes = []
    if bias_layout(loras) == "base_bias":
        biased = ", ".join(lora.name for lora in loras if lora.bias is not None)
        notes.append(
            "peft's lora_bias is adapter-wide and cannot merge into the layers without a bias, so the edited "
            f'biases of {biased} are stored whole (bias "lora_only"): PeftModel.from_pretrained writes them '
            "into the base model's layers, where they stay after disable_adapter() or unload()"
        )
    if base is not None and base.note is not None:
        notes.append(base.note)
    return notes


def write_adapter(
    target: Path,
    model_id: str | AdapterBase,
    loras: Iterable[LayerLora],
    *,
    max_rank: int | None = None,
    rtol: float = EXACT_RTOL,
    tied: Mapping[str, Sequence[str]] | None = None,
    on_layer: Callable[[], None] | None = None,
    lora_target: LoraTarget = "peft",
    task_type: str | None = "CAUSAL_LM",
) -> AdapterReport:
    """Write a PEFT adapter directory: config, safetensors weights and ``lora_report.json``.

    Layers are factorized as ``loras`` yields them; only their factors are kept until the end.

    Args:
        target: an existing, empty directory.
        model_id: the base model (:func:`adapter_base`; a string: ``base_model_name_or_path``).
        loras: the layers' factors (from :func:`~service.engine.lora.layer_loras`, with the same ``lora_target``).
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
    base = model_id if isinstance(model_id, AdapterBase) else AdapterBase(model_id)
    save_file(adapter_tensors(kept), str(target / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (target / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(base, kept, lora_target, task_type), indent=2))
    report = adapter_report(kept, max_rank, rtol, tied or {}, lora_target, base)
    (target / REPORT_FILE).write_text(json.dumps(report.model_dump(mode="json"), indent=2))
    return report
