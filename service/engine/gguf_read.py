"""A GGUF file read into the plain checkpoint folder every other part of the service reads.

transformers' own GGUF loader (``from_pretrained(folder, gguf_file=...)``, which reads the file with
the ``gguf`` package) maps the file's tensors and metadata onto a transformers model and
dequantizes every tensor; :func:`dequantize_gguf` saves that model as ``config.json`` (without the
loader's ``quantization_config``, which would mark the folder as a quantized checkpoint) and
``model.safetensors`` in float32, with the tokenizer the file carries (fast, its chat template kept).
float32 because every GGUF block format the loader reads is a small integer times a float16 (or
float32) scale, plus a float16 minimum for the ``_1`` and ``K`` formats: float32 holds that product
exactly for 4- and 5-bit blocks and to within one float32 rounding for the others, so the folder is the
file's model, not a rounding of it.

What the loader cannot read is refused by name before any tensor is read (:func:`check_gguf_readable`):
an architecture its mapping lacks, a tensor type the ``gguf`` package cannot dequantize.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from service.engine.model_files import ModelSourceError

# Tensor types stored as plain numbers (read as they are) rather than in quantized blocks.
_PLAIN_TYPES = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})
# Keys of the loader's config a saved checkpoint must not carry.
_LOADER_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF file's header says about it.

    Attributes:
        architecture: ``general.architecture`` (``llama``, ``qwen2``...).
        quantization: the file's quantization type (``Q4_1``, ``Q8_0``, ``F16``...): ``general.file_type``
            without its ``MOSTLY_`` (or ``ALL_``: ``ALL_F32`` is ``F32``, the name the writer takes) prefix,
            else the most common type among its tensors.
        tensor_types: every tensor type the file holds, with how many tensors have it.
    """

    architecture: str
    quantization: str
    tensor_types: dict[str, int]


def read_gguf_header(path: Path) -> GgufHeader:
    """The header of the GGUF file at ``path`` (metadata and tensor descriptions: no tensor is read).

    Raises:
        ModelSourceError: the file is not a GGUF file the ``gguf`` package reads.
    """
    from gguf import GGUFReader, LlamaFileType

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise ModelSourceError(f"{path.name} is not a readable GGUF file: {exc}") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelSourceError(f"{path.name} has no general.architecture: not a model GGUF file")
    tensor_types = dict(Counter(tensor.tensor_type.name for tensor in reader.tensors))
    file_type = reader.fields.get("general.file_type")
    try:
        quantization = (
            LlamaFileType(int(file_type.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_") if file_type else ""
        )
    except ValueError:
        quantization = ""
    if not quantization and tensor_types:
        quantization = max(tensor_types, key=lambda name: tensor_types[name])
    return GgufHeader(architecture=str(field.contents()), quantization=quantization, tensor_types=tensor_types)


def dequantizable_types() -> frozenset[str]:
    """The tensor types the ``gguf`` package dequantizes: the plain ones and each block format it
    has a class for."""
    from gguf import GGMLQuantizationType, quants

    blocks = {member.name for member in GGMLQuantizationType if hasattr(quants, member.name)}
    return _PLAIN_TYPES | frozenset(blocks)


def supported_architectures() -> frozenset[str]:
    """The GGUF architectures transformers' loader maps onto a model."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return frozenset(GGUF_SUPPORTED_ARCHITECTURES)


def check_gguf_readable(header: GgufHeader, name: str) -> None:
    """Refuse a GGUF file transformers' loader cannot read into a model, naming why.

    Raises:
        ModelSourceError: its architecture is not one the loader maps, or a tensor type is not one
            the ``gguf`` package dequantizes.
    """
    architectures = supported_architectures()
    if header.architecture not in architectures:
        raise ModelSourceError(
            f"{name} is a GGUF of architecture {header.architecture!r}, which transformers' GGUF loader cannot "
            f"read (it reads {', '.join(sorted(architectures))}): register the model's safetensors checkpoint instead"
        )
    unreadable = sorted(set(header.tensor_types) - dequantizable_types())
    if unreadable:
        raise ModelSourceError(
            f"{name} holds tensors of type {', '.join(unreadable)}, which the gguf package cannot dequantize: "
            "register a GGUF quantized otherwise (Q8_0, Q4_K...) or the safetensors checkpoint"
        )


def dequantize_gguf(path: Path, folder: Path) -> None:
    """Write the model of the GGUF file at ``path`` into the empty ``folder`` as a plain checkpoint:
    ``config.json``, ``model.safetensors`` (float32) and the file's tokenizer.

    Raises:
        ModelSourceError: the loader fails on the file, or its tokenizer is not a fast one.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError, OSError) as exc:
        raise ModelSourceError(f"transformers' GGUF loader cannot read {path.name}: {exc}") from None
    settings = loaded.config.to_dict()
    for key in _LOADER_KEYS:
        settings.pop(key, None)
    config = type(loaded.config)(**settings)
    config.architectures = [type(loaded).__name__]
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())  # strict: every tensor the file maps to, none missing
    plain.save_pretrained(folder, safe_serialization=True)
    if not tokenizer.is_fast:
        raise ModelSourceError(f"the tokenizer of {path.name} does not convert to a fast tokenizer")
    tokenizer.save_pretrained(folder)
