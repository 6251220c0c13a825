"""An engram file's format name and the dtype each layer's engram is stored in.

Named apart from :mod:`service.engrams.build` (which computes engrams with torch) so that the
projection of a universe's bytes (:mod:`service.universes.projection`), which the API runs before a
build is queued, lays out the same files without importing torch. The precision rule is explained
in :mod:`service.engrams.build`.
"""

from __future__ import annotations

ENGRAMS_FORMAT = "engram-engrams/1"


def engram_dtype(weight_dtype: str) -> str:
    """The stored dtype of a layer's engram (safetensors name) for its weight's stored dtype: its own
    where that costs no accuracy the variant keeps (float64, bfloat16), else float32 (float16's range
    could overflow an engram; see :mod:`service.engrams.build`)."""
    return weight_dtype if weight_dtype in ("F64", "BF16") else "F32"
