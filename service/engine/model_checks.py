"""What a model folder must be before the service reads it: a safe Hugging Face checkpoint
(safetensors only, no remote code, the rules of :mod:`service.engine.model_files`) holding
full-precision weights, neither declared quantized in ``config.json`` nor stored packed or in 8 bits.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from safetensors import safe_open

from service.engine.image_models import PREPROCESSOR_CONFIG, check_preprocessor_config, model_kind
from service.engine.layers import summarize_names
from service.engine.model_file_descriptors import ModelFiles
from service.engine.model_files import (
    PICKLE_SUFFIXES,
    ModelSourceError,
    check_links,
    check_shard_name,
    check_tokenizer_config,
    present,
    read_side_json,
    weight_files,
)


def validate_model_dir(path: Path, files: ModelFiles | None = None) -> dict[str, Any]:
    """Check a directory is a safe Hugging Face checkpoint and return its ``config.json``.

    Args:
        path: the model folder.
        files: its files opened by a job or a registration: the side files are then read through
            these descriptors, so what is checked is what is used (else by name, as the API does).

    Raises:
        ModelSourceError: missing config, pickle-only weights, remote code, unreadable files, a
            link leading out of the folder, a shard name that is not a plain file name in it, more
            layers than :data:`MAX_LAYERS`, an image model without a usable preprocessor_config.json.
    """
    if not path.is_dir():
        raise ModelSourceError(f"{path} is not a directory")
    check_links(path)
    has, read = _side_readers(path, files)
    if not has("config.json"):
        raise ModelSourceError(f"{path} has no config.json")
    config = read("config.json")
    if not isinstance(config, dict):
        raise ModelSourceError("config.json is not a JSON object")
    if "auto_map" in config:
        raise ModelSourceError("the model needs remote code (config.json has auto_map), which is refused")
    check_not_quantized(config)
    check_layer_count(config)
    check_side_json(path, files)
    check_tokenizer_config(path, files)
    if model_kind(config) == "image":  # how it reads an image is its processor's (service.engine.image_models)
        check_preprocessor_config(read(PREPROCESSOR_CONFIG) if has(PREPROCESSOR_CONFIG) else None, config)
    if not (files.shards if files is not None else weight_files(path)):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ModelSourceError(f"pickle weights are refused ({', '.join(pickles)}); convert to safetensors")
        raise ModelSourceError(f"{path} has no safetensors weights")
    return config


def check_model_dir(path: Path) -> None:
    """Check a directory is a safe Hugging Face checkpoint (:func:`validate_model_dir`, by name): what
    a registration or an inspection checks before it reads the folder.

    Raises:
        ModelSourceError: naming the folder's first problem.
    """
    validate_model_dir(path)


# transformers builds every declared layer, even on the meta device, in time that grows faster than
# their number: 1024 Llama layers take 2 s, 200 000 held a registration job for hours, its memory
# growing by gigabytes. The largest published models have under 200 layers.
MAX_LAYERS = 1024
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers")


def check_layer_count(config: Mapping[str, Any]) -> None:
    """Refuse a config declaring more than :data:`MAX_LAYERS` layers, counted over the config and its
    sub-configs one level down (``text_config``, ``vision_config``…: built as well).

    Raises:
        ModelSourceError: naming the count.
    """
    scopes = [config, *(value for value in config.values() if isinstance(value, Mapping))]
    layers = sum(max((_count(scope.get(key)) for key in _LAYER_KEYS), default=0) for scope in scopes)
    if layers > MAX_LAYERS:
        raise ModelSourceError(f"config.json declares {layers} layers; the service registers models of at most {MAX_LAYERS}")


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# JSON side files transformers reads as objects (not tokenizer.json or vocab.json: large, and read by
# the registration job's tokenizer check), and those of them whose ``auto_map`` asks for remote code.
_OBJECT_FILES = (
    "generation_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "preprocessor_config.json",
)
_CODE_FILES = ("tokenizer_config.json", "preprocessor_config.json")


def _side_readers(path: Path, files: ModelFiles | None) -> tuple[Callable[[str], bool], Callable[[str], Any]]:
    """``(has, read_json)`` of a folder's side files: through ``files`` when given, else by name."""
    if files is not None:
        return files.has, files.read_json
    return partial(present, path), partial(read_side_json, path)


def check_side_json(path: Path, files: ModelFiles | None = None) -> None:
    """Refuse a JSON side file that is not an object, or that asks for remote code: either
    registered before, and every job that loads the tokenizer then failed.

    Raises:
        ModelSourceError: naming the file (also one too large or nested too deeply to parse).
    """
    has, read = _side_readers(path, files)
    for name in _OBJECT_FILES:
        if not has(name):
            continue
        values = read(name)
        if not isinstance(values, dict):
            raise ModelSourceError(f"{name} is not a JSON object")
        if name in _CODE_FILES and "auto_map" in values:
            raise ModelSourceError(f"the model needs remote code ({name} has auto_map), which is refused")


# Where config.json declares quantization: transformers' key, compressed-tensors' older one, and
# the same keys inside a multimodal model's text config.
_QUANTIZATION_KEYS = ("quantization_config", "compression_config")
QUANTIZED_ADVICE = (
    "the service edits full-precision weights only: register the unquantized model (its float16, bfloat16 or "
    "float32 checkpoint) and quantize the variant afterwards"
)


def check_not_quantized(config: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose config declares quantization, naming the method.

    Packed integer weights (GPTQ, AWQ, bitsandbytes) are not matrices the engram can edit, and an
    edit cast back to FP8 or int8 would round away; only unquantized checkpoints are registered.

    Raises:
        ModelSourceError: ``quantization_config`` (or ``compression_config``) is present, top-level
            or in ``text_config``; the message names ``quant_method`` (``unknown`` when missing).
    """
    scopes: list[tuple[str, Mapping[str, Any]]] = [("", config)]
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping):
        scopes.append(("text_config.", text_config))
    for scope, values in scopes:
        for key in _QUANTIZATION_KEYS:
            if values.get(key) is None:
                continue
            quant = values[key]
            method = quant.get("quant_method") if isinstance(quant, Mapping) else None
            method = method[:64] if isinstance(method, str) and method.strip() else "unknown"
            raise ModelSourceError(
                f"the checkpoint is quantized (config.json {scope}{key}.quant_method: {method!r}); {QUANTIZED_ADVICE}"
            )


# Stored weight dtypes an edit can be written back in; anything else (int8/uint8/int32 packs,
# FP8, FP4) is a quantized tensor, refused when the config does not say so.
_EDITABLE_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
_DTYPE_NAMES = {
    "I8": "int8", "U8": "uint8", "I16": "int16", "U16": "uint16", "I32": "int32", "U32": "uint32",
    "I64": "int64", "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2", "F6_E2M3": "float6_e2m3", "F6_E3M2": "float6_e3m2",
}  # fmt: skip
# Keys of packed quantized weights that replace ``<layer>.weight`` (GPTQ/AWQ, compressed-tensors).
_PACKED_SUFFIXES = (".qweight", ".weight_packed")


def check_weight_dtypes(
    files: ModelFiles, weight_keys: Mapping[str, str], key_files: Mapping[str, str], names: Collection[str]
) -> None:
    """Refuse packed or 8-bit weights for editable layers that a config without quantization hides.

    Args:
        files: the model folder's opened files.
        weight_keys: each editable layer whose weight is in the checkpoint -> the key holding it,
            in the order the refusal lists them (the layout's).
        key_files: every checkpoint key -> its shard.
        names: every editable layer of the model, in the checkpoint or not.

    Raises:
        ModelSourceError: naming each such layer and its stored dtype (or its packed key).
    """
    found: dict[str, list[str]] = {}
    by_shard: dict[str, list[tuple[str, str]]] = {}
    for layer, key in weight_keys.items():
        by_shard.setdefault(key_files[key], []).append((layer, key))
    for shard, entries in by_shard.items():
        with safe_open(str(files.path(check_shard_name(shard))), framework="pt") as handle:
            for layer, key in entries:
                dtype = str(handle.get_slice(key).get_dtype())
                if dtype not in _EDITABLE_DTYPES:
                    found.setdefault(_DTYPE_NAMES.get(dtype, dtype.lower()), []).append(layer)
    for name in names:
        packed = next((name + suffix for suffix in _PACKED_SUFFIXES if name + suffix in key_files), None)
        if packed is not None and name not in weight_keys:
            found.setdefault(f"packed as {packed.rsplit('.', 1)[1]}", []).append(name)
    if found:
        listed = "; ".join(f"{summarize_names(layers)} ({dtype})" for dtype, layers in found.items())
        raise ModelSourceError(
            "the checkpoint stores quantized weights for editable layers though config.json declares no "
            f"quantization_config: {listed}; {QUANTIZED_ADVICE}"
        )
