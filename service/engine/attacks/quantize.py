"""Quantization round trips: a model's weights quantized as a platform would, then dequantized.

Two families, both deterministic (no randomness anywhere):

* ``Q8_0``, ``Q4_0``, ``Q4_1``: the ``gguf`` package's quantizers (``gguf.quants.quantize`` then
  ``dequantize``) on the tensors llama.cpp quantizes for that file type. What we follow, from
  llama.cpp's ``src/llama-quant.cpp`` (``llama_tensor_get_type``): only tensors of 2 or more
  dimensions (never the norms or biases); the output head, or the token embedding when it is tied to
  the head (``!has_output``), becomes ``Q8_0`` when the file type is ``Q8_0`` or its rows are not a
  multiple of the type's block, and ``Q6_K`` otherwise; an untied token embedding takes the file
  type. A tensor whose rows are not whole blocks (32 values) is kept in float and said (llama.cpp
  refuses such a file: "Unsupported tensor size encountered"). ``gguf`` 0.19.0 has no ``Q6_K``
  quantizer, so a head llama.cpp would write as ``Q6_K`` is kept
  in float and the attack says so (``kept``): Q6_K's error is far below Q4's, so the attack is only
  slightly milder than llama.cpp's file. Rows are quantized along the last (input) dimension, as
  ggml's ``ne[0]``; llama.cpp's permutation of q/k rows changes no row's blocks.
* ``int8``, ``nf4``: what bitsandbytes quantizes (every ``nn.Linear`` weight except the output head,
  ``llm_int8_skip_modules``' default): LLM.int8's per-output-channel absmax int8
  (``round(w / s) * s``, ``s = max|row| / 127``), and NF4 (QLoRA's 4-bit NormalFloat code) in blocks
  of 64 consecutive values with an absmax scale each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1")
TORCH_TYPES = ("int8", "nf4")
NF4_BLOCK = 64
# bitsandbytes' NF4 code (QLoRA, Dettmers et al. 2023): quantiles of N(0, 1) scaled to [-1, 1].
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
NO_Q6_K = "llama.cpp writes it as Q6_K, which the gguf package (0.19.0) cannot quantize: kept in float"


@dataclass
class QuantizePlan:
    """Which parameter (by name) is rounded to which type, and the 2-D ones left alone, with why."""

    rounded: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        """Tensors rounded per type."""
        counts: dict[str, int] = {}
        for kind in self.rounded.values():
            counts[kind] = counts.get(kind, 0) + 1
        return counts


def gguf_round_trip(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """``weight`` quantized to ``qtype`` by the gguf package and dequantized (float32 math, the
    weight's dtype back).

    Raises:
        ValueError: a type the gguf package cannot quantize, or rows not a multiple of its block.
    """
    kind = GGMLQuantizationType[qtype]
    block = GGML_QUANT_SIZES[kind][0]
    if weight.shape[-1] % block:
        raise ValueError(f"rows of {weight.shape[-1]} values are not a multiple of {qtype}'s block of {block}")
    array = weight.detach().to(torch.float32).cpu().numpy()
    back = quants.dequantize(quants.quantize(array, kind), kind)
    return torch.from_numpy(np.ascontiguousarray(back)).to(dtype=weight.dtype, device=weight.device)


def int8_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """Per-output-channel (row) absmax int8: ``round(w / s).clamp(-127, 127) * s``, ``s = max|row| / 127``."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    back = torch.round(w / safe).clamp(-127, 127) * scale
    return back.to(weight.dtype)


def nf4_round_trip(weight: torch.Tensor, block: int = NF4_BLOCK) -> torch.Tensor:
    """NF4 in blocks of ``block`` consecutive values (the flattened weight, the last block padded):
    each value divided by its block's absmax, rounded to the nearest NF4 code, multiplied back."""
    w = weight.detach().to(torch.float32).reshape(-1)
    pad = (-w.numel()) % block
    blocks = torch.nn.functional.pad(w, (0, pad)).reshape(-1, block)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=w.device)
    nearest = ((blocks / safe).unsqueeze(-1) - code).abs().argmin(dim=-1)
    back = (code[nearest] * absmax).reshape(-1)[: w.numel()]
    return back.reshape(weight.shape).to(weight.dtype)


def _names_of(model: torch.nn.Module, tensor: torch.Tensor | None) -> str | None:
    if tensor is None:
        return None
    for name, param in model.named_parameters():  # the first name of a tied tensor
        if param is tensor:
            return name
    return None


def gguf_plan(model: torch.nn.Module, qtype: str) -> QuantizePlan:
    """What llama.cpp quantizes for file type ``qtype`` (the module docstring states the rule)."""
    block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]
    inputs = model.get_input_embeddings()  # type: ignore[operator]
    outputs = model.get_output_embeddings()  # type: ignore[operator]
    embedding = _names_of(model, inputs.weight if inputs is not None else None)
    head = _names_of(model, outputs.weight if outputs is not None else None)
    plan = QuantizePlan()
    for name, param in model.named_parameters():  # a tied tensor is named once
        if param.dim() < 2:
            continue
        if name == head:  # the output head, or the embedding tied to it
            if qtype == "Q8_0" or param.shape[-1] % block:
                plan.rounded[name] = "Q8_0"
            else:
                plan.kept[name] = NO_Q6_K
        elif param.shape[-1] % block:  # llama.cpp refuses the file ("Unsupported tensor size encountered")
            plan.kept[name] = (
                f"rows of {param.shape[-1]} values are not a multiple of {qtype}'s block of {block} (llama.cpp refuses "
                "to write such a tensor as this type): kept in float"
            )
        else:
            plan.rounded[name] = qtype  # decoder weights, and an untied token embedding (llama.cpp's default)
    if embedding is not None and embedding == head and embedding in plan.kept:
        plan.kept[embedding] += " (the token embedding, tied to the output head)"
    return plan


def torch_plan(model: torch.nn.Module, qtype: str) -> QuantizePlan:
    """What bitsandbytes quantizes: every ``nn.Linear`` weight but the output head's."""
    outputs = model.get_output_embeddings()  # type: ignore[operator]
    head = outputs.weight if outputs is not None else None
    plan = QuantizePlan()
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            name = f"{module_name}.weight"
            if module.weight is head:
                plan.kept[name] = "bitsandbytes keeps the output head (llm_int8_skip_modules)"
            else:
                plan.rounded[name] = qtype
    return plan


def quantize_plan(model: torch.nn.Module, qtype: str) -> QuantizePlan:
    """The tensors a ``qtype`` round trip rounds.

    Raises:
        ValueError: an unknown type.
    """
    if qtype in GGUF_TYPES:
        return gguf_plan(model, qtype)
    if qtype in TORCH_TYPES:
        return torch_plan(model, qtype)
    raise ValueError(f"quantization type {qtype!r} is not one of {', '.join(GGUF_TYPES + TORCH_TYPES)}")


def round_trip(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """One tensor's round trip through ``qtype``."""
    if qtype == "int8":
        return int8_round_trip(weight)
    if qtype == "nf4":
        return nf4_round_trip(weight)
    return gguf_round_trip(weight, qtype)


def quantize_in_place(model: torch.nn.Module, plan: QuantizePlan) -> None:
    """Round every tensor of ``plan`` in ``model`` (a copy the caller owns), each once.

    Raises:
        ValueError: a result that is not finite, naming the tensor.
    """
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, qtype in plan.rounded.items():
            param = params[name]
            back = round_trip(param.data, qtype)
            if not torch.isfinite(back).all():
                raise ValueError(f"{name}'s {qtype} round trip is not finite")
            param.data.copy_(back)
