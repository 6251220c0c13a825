"""Checkpoint keys stored under another name than the parameter they load into.

transformers renames some keys as it loads a checkpoint: older names of a model's own modules
(GPT-NeoX's ``embed_out`` is loaded as ``lm_head``), the base model's prefix added or dropped (a
``LlamaModel`` checkpoint, ``layers.0.…``, loaded into ``LlamaForCausalLM``, ``model.layers.0.…``),
and the renames of its conversion mapping. A layer whose weight sits under such a key is as editable
as any other: the variant writes the new weight back under the stored key, and transformers loads it
into the same parameter again. Only plain renames are followed: a key that a converter reshapes or
merges on load (fused experts) is read by :mod:`service.engine.expert_keys` or not at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only; the model is built by the caller
    from transformers import PreTrainedModel


def renamed_parameters(model: PreTrainedModel, shapes: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """Parameter name -> the checkpoint key transformers loads into it under another name.

    Args:
        model: the model (on the meta device is enough): its conversion mapping, base-model
            prefix and parameter shapes.
        shapes: every checkpoint key -> its stored shape (from the safetensors headers).

    Returns:
        Only keys stored under a name of their own that a plain rename maps onto a parameter of
        the same shape; a key already named like its parameter is not listed.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # pragma: no cover - a transformers without conversion mappings
        return {}
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    meta = model.state_dict(keep_vars=True)
    # transformers models: a class attribute some architectures leave unset
    prefix = getattr(model, "base_model_prefix", None) or None
    found: dict[str, str] = {}
    # Sorted: transformers reads keys in this order, and its grouped renames arm on the first key.
    for key in sorted(shapes):
        if key in meta:
            continue
        target, converted_by = rename_source_key(key, renamings, converters, prefix, meta)
        parameter = meta.get(target)
        if converted_by is not None or parameter is None or tuple(parameter.shape) != tuple(shapes[key]):
            continue
        if found.setdefault(target, key) != key:
            found[target] = ""  # two stored keys load into one parameter: follow neither
    return {name: key for name, key in found.items() if key}
