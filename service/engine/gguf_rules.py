"""What a GGUF variant can be, decided without torch or the ``gguf`` package (the API decides it at submit).

:func:`check_gguf_writable` refuses what :func:`service.engine.gguf_write.write_gguf` does not map:
an architecture other than ``LlamaForCausalLM`` (a mixture of experts, an image classifier, another
family), a quantization it does not write; :func:`check_gguf_tokenizer` refuses a folder whose
tokenizer is not a byte-level BPE ``tokenizer.json`` (the writer says the same when it runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GGUF_QUANTIZATIONS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
WRITABLE_ARCHITECTURES = ("LlamaForCausalLM",)
TOKENIZER_FILE = "tokenizer.json"


class GgufWriteError(ValueError):
    """The checkpoint cannot be written as GGUF; the message says why."""


def check_gguf_writable(config: dict[str, Any], quantization: str) -> None:
    """Refuse what :func:`~service.engine.gguf_write.write_gguf` cannot write, before anything is computed.

    Raises:
        GgufWriteError: naming the architecture or the quantization.
    """
    architectures = config.get("architectures") or [config.get("model_type", "unknown")]
    if list(architectures) != list(WRITABLE_ARCHITECTURES):
        raise GgufWriteError(
            f'format "gguf" writes {", ".join(WRITABLE_ARCHITECTURES)} only; this model is '
            f'{", ".join(map(str, architectures))}: use format "checkpoint" and convert it with llama.cpp'
        )
    if quantization not in GGUF_QUANTIZATIONS:
        raise GgufWriteError(f"gguf quantization {quantization!r} is not one of {', '.join(GGUF_QUANTIZATIONS)}")


def default_gguf_quantization(source_quantization: str | None) -> str:
    """A GGUF variant's quantization when the request names none: its model's own (the GGUF file it
    was registered from) where this writer writes it, else F16 (half the float32 size, and lossless
    for a model trained in 16 bits)."""
    return source_quantization if source_quantization in GGUF_QUANTIZATIONS else "F16"


def tokenizer_refusal(tokenizer: Any) -> str | None:
    """Why a parsed ``tokenizer.json`` (None: the folder has none) cannot be written as GGUF, or None."""
    if tokenizer is None:
        return f'format "gguf" needs the model\'s {TOKENIZER_FILE} (a fast tokenizer): the folder has none'
    model = tokenizer.get("model") if isinstance(tokenizer, dict) else None
    kind = model.get("type") if isinstance(model, dict) else None
    if kind != "BPE":
        return f'format "gguf" writes byte-level BPE tokenizers; this one is {kind!r}'
    return None


def check_gguf_tokenizer(folder: Path) -> None:
    """Refuse a model folder whose tokenizer the writer cannot map (read from ``tokenizer.json``
    only; nothing is loaded). A folder this process cannot read is left to the job, which says the same.

    Raises:
        GgufWriteError: no ``tokenizer.json``, or one that is not BPE.
    """
    from service.engine.model_files import ModelSourceError, present, read_side_json

    try:
        if not folder.is_dir():
            return
        tokenizer = read_side_json(folder, TOKENIZER_FILE) if present(folder, TOKENIZER_FILE) else None
    except (OSError, ModelSourceError):
        return  # unreadable here: the job reads it and says
    refusal = tokenizer_refusal(tokenizer)
    if refusal is not None:
        raise GgufWriteError(refusal)
