"""A Llama checkpoint folder written as one GGUF file, quantized with the ``gguf`` package's quantizers.

What it writes is what llama.cpp's ``convert_hf_to_gguf.py`` writes for a ``LlamaForCausalLM`` and
transformers' GGUF loader reads back: the ``llama.*`` hyperparameters, the byte-level BPE tokenizer
(``tokenizer.ggml.*``: tokens, types, merges, special ids, the chat template) and the tensors under
their GGUF names (``gguf.get_tensor_name_map``), the query and key projections permuted into the
rotary layout llama.cpp uses (the loader undoes it). A tied head writes no ``output.weight``.

Quantization (:data:`GGUF_QUANTIZATIONS`): every matrix whose rows split into whole blocks is stored
in the chosen type; vectors (norms) and matrices that do not split stay float32, as
``convert_hf_to_gguf.py`` keeps them. Each tensor is read, converted and handed to the writer one at a
time; the writer holds the converted tensors until the file is written (the quantized model's size).

Refused by name (:class:`GgufWriteError`): an architecture other than ``LlamaForCausalLM`` (another
family's tensor names, hyperparameters and permutations are not mapped here), a tokenizer that is not
a byte-level BPE ``tokenizer.json``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

# What can be written is decided in gguf_rules (no torch: the API refuses at submit with the same rules).
from service.engine.gguf_rules import (
    GGUF_QUANTIZATIONS,
    WRITABLE_ARCHITECTURES,
    GgufWriteError,
    check_gguf_writable,
    default_gguf_quantization,
    tokenizer_refusal,
)

__all__ = [
    "GGUF_QUANTIZATIONS",
    "WRITABLE_ARCHITECTURES",
    "GgufWriteError",
    "check_gguf_writable",
    "default_gguf_quantization",
    "write_gguf",
]

_CONTROL, _NORMAL, _USER_DEFINED = 3, 1, 4  # gguf.TokenType values


def _permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's rotary layout of a query or key projection (``LlamaModel.permute``)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
    )


def _tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's safetensors shards, one at a time."""
    index = folder / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    for shard in shards:
        with safe_open(str(folder / shard), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _encoded(tensor: torch.Tensor, quantization: str) -> tuple[np.ndarray[Any, Any], Any]:
    """The tensor's bytes in ``quantization`` (a vector, or a matrix whose rows do not split into
    blocks: float32) and the GGML type they are in."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    data = tensor.to(torch.float32).numpy()
    qtype = GGMLQuantizationType[quantization]
    if data.ndim < 2 or quantization == "F32" or data.shape[-1] % GGML_QUANT_SIZES[qtype][0] != 0:
        return data, GGMLQuantizationType.F32
    if quantization == "F16":
        return data.astype(np.float16), GGMLQuantizationType.F16
    return quants.quantize(data, qtype), qtype


def _add_hyperparameters(writer: Any, config: dict[str, Any]) -> None:
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_rope_dimension_count(head_dim)


def _add_tokenizer(writer: Any, folder: Path, config: dict[str, Any]) -> None:
    """The folder's byte-level BPE ``tokenizer.json`` as ``tokenizer.ggml.*`` (with the chat template).

    Raises:
        GgufWriteError: there is no ``tokenizer.json``, or it is not a BPE tokenizer.
    """
    path = folder / "tokenizer.json"
    parsed = json.loads(path.read_text()) if path.is_file() else None
    refusal = tokenizer_refusal(parsed)
    if refusal is not None:
        raise GgufWriteError(refusal)
    tokenizer: dict[str, Any] = parsed or {}  # not None: tokenizer_refusal refused that
    model = tokenizer["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    special = {entry["content"]: entry["id"] for entry in tokenizer.get("added_tokens", [])}
    vocab.update(special)
    size = max(int(config["vocab_size"]), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [_USER_DEFINED] * size
    for token, index in vocab.items():
        tokens[index] = token
        types[index] = _CONTROL if token in special else _NORMAL
    merges = [" ".join(pair) if isinstance(pair, list) else str(pair) for pair in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    side = json.loads((folder / "tokenizer_config.json").read_text()) if (folder / "tokenizer_config.json").is_file() else {}
    for role, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("unk_token", writer.add_unk_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        if isinstance(side.get(role), str) and side[role] in vocab:
            add(vocab[side[role]])
    writer.add_add_bos_token(False)
    template = folder / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())
    elif isinstance(side.get("chat_template"), str):
        writer.add_chat_template(side["chat_template"])


def write_gguf(
    folder: Path, out: Path, quantization: str, name: str, on_tensor: Callable[[], None] | None = None
) -> dict[str, int]:
    """Write the Llama checkpoint in ``folder`` as the GGUF file ``out``.

    Args:
        quantization: one of :data:`GGUF_QUANTIZATIONS`.
        name: ``general.name`` (the variant's ID).
        on_tensor: called after each tensor is converted.

    Returns:
        How many tensors were stored in each GGML type.

    Raises:
        GgufWriteError: the checkpoint is not one this writer maps (its architecture, its tokenizer),
            or a tensor has a name the llama mapping lacks.
    """
    import gguf

    config = json.loads((folder / "config.json").read_text())
    check_gguf_writable(config, quantization)
    blocks = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, blocks)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(name)
    writer.add_file_type(getattr(gguf.LlamaFileType, "ALL_F32" if quantization == "F32" else f"MOSTLY_{quantization}"))
    _add_hyperparameters(writer, config)
    _add_tokenizer(writer, folder, config)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    counts: dict[str, int] = {}
    tied = bool(config.get("tie_word_embeddings"))
    for hf_name, tensor in _tensors(folder):
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reads the tied head from token_embd
        mapped = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise GgufWriteError(f"the tensor {hf_name} has no GGUF name in the llama mapping")
        if hf_name.endswith("q_proj.weight"):
            tensor = _permute(tensor, heads)
        elif hf_name.endswith("k_proj.weight"):
            tensor = _permute(tensor, kv_heads)
        data, qtype = _encoded(tensor, quantization)
        writer.add_tensor(mapped, data, raw_dtype=qtype)
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
        if on_tensor is not None:
            on_tensor()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts
