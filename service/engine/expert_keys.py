"""Where a checkpoint keeps each expert layer's weight (:mod:`service.engine.experts`), and one
expert's slice read from, or written into, a fused key.

Two layouts are read: fused (``<experts>.gate_up_proj`` ``[E, 2I, H]`` and ``<experts>.down_proj``
``[E, H, I]``, each expert a slice of rows), or one ``[out, in]`` key per expert and projection, as
transformers' conversion mapping merges them on load (``mlp.experts.{e}.gate_proj.weight``,
Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``). Any other layout is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from service.engine.expert_names import DOWN, GATE, PROJECTIONS, UP
from service.engine.experts import FUSED, FusedExperts
from service.engine.layers import LayerSpec, summarize_names
from service.engine.model_files import ModelSourceError

if TYPE_CHECKING:  # annotations only; the model is built by the caller
    from transformers import PreTrainedModel

_EXPERT_INDEX = re.compile(r"(?:^|\.)experts\.(\d+)\.")


@dataclass(frozen=True)
class ExpertStorage:
    """Where the checkpoint keeps each expert layer's weight.

    Attributes:
        weight_keys: layer -> checkpoint key holding its weight (a 2-D key, or the fused 3-D key).
        slices: layer -> ``[expert, first row, row stop]`` of the fused key, for fused storage.
    """

    weight_keys: dict[str, str]
    slices: dict[str, list[int]]


def expert_storage(
    model: PreTrainedModel,
    experts: Sequence[FusedExperts],
    shapes: Mapping[str, Sequence[int]],
    renamed: Mapping[str, str] | None = None,
) -> ExpertStorage:
    """Map every expert layer to its place in the checkpoint.

    Args:
        model: the model (on the meta device is enough), for transformers' conversion mapping.
        experts: its fused experts modules.
        shapes: every checkpoint key -> its stored shape.
        renamed: parameter name -> the checkpoint key transformers renames into it
            (:func:`service.engine.key_renames.renamed_parameters`): GraniteMoE stores its fused
            experts as ``block_sparse_moe.input_linear.weight`` / ``output_linear.weight``.

    Raises:
        ModelSourceError: naming the experts whose weights the checkpoint stores in another layout.
    """
    weight_keys: dict[str, str] = {}
    slices: dict[str, list[int]] = {}
    per_expert = _per_expert_keys(model, shapes)
    unread = []
    for module in experts:
        fused = [_stored_key(f"{module.name}.{name}", shapes, renamed or {}) for name in FUSED]
        if all(key in shapes for key in fused):
            expected = (
                (module.num_experts, 2 * module.intermediate, module.hidden),
                (module.num_experts, module.hidden, module.intermediate),
            )
            if [tuple(shapes[key]) for key in fused] != list(expected):
                unread.append(module.name)
                continue
            for expert in range(module.num_experts):  # the order of module.layer_specs()
                for projection in PROJECTIONS:
                    layer = module.layer_name(expert, projection)
                    param, start, stop = module.rows(projection)
                    weight_keys[layer] = fused[FUSED.index(param)]
                    slices[layer] = [expert, start, stop]
            continue
        keys = per_expert.get(module.name, {})
        specs = module.layer_specs()
        if not all(_stored_as(keys.get(spec.name), shapes, (spec.out_features, spec.in_features)) for spec in specs):
            unread.append(module.name)
            continue
        weight_keys.update({spec.name: keys[spec.name] for spec in specs})
    if unread:
        raise ModelSourceError(
            f"the checkpoint stores the experts of {summarize_names(n + '.*' for n in unread)} in a layout the service does "
            "not read (neither the fused gate_up_proj [E, 2I, H] and down_proj [E, H, I] nor one [out, in] weight per "
            "expert that transformers merges into them); nothing of this model can be edited"
        )
    return ExpertStorage(weight_keys, slices)


def _stored_key(parameter: str, shapes: Mapping[str, Sequence[int]], renamed: Mapping[str, str]) -> str:
    """The checkpoint key of a fused parameter: its own name, else the key renamed into it."""
    return parameter if parameter in shapes else renamed.get(parameter, parameter)


def _stored_as(key: str | None, shapes: Mapping[str, Sequence[int]], shape: tuple[int, int]) -> bool:
    return key is not None and key in shapes and tuple(shapes[key]) == shape


def _per_expert_keys(model: PreTrainedModel, shapes: Mapping[str, Sequence[int]]) -> dict[str, dict[str, str]]:
    """experts module -> (expert layer -> checkpoint key), from the keys transformers' conversion
    mapping merges into a fused parameter by stacking the experts (``MergeModulelist(dim=0)``) and,
    for ``gate_up_proj``, concatenating ``[gate, up]`` along the rows (``Concatenate(dim=1)``).
    A key merged any other way is not mapped (its experts are then refused by name)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # pragma: no cover - a transformers without conversion mappings
        return {}
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    meta = model.state_dict()
    # transformers models: a class attribute some architectures leave unset
    prefix = getattr(model, "base_model_prefix", None)
    found: dict[str, dict[str, str]] = {}
    for key in shapes:
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        converter = next((c for c in converters if pattern is not None and pattern in c.source_patterns), None)
        container, _, param = target.rpartition(".")
        index = _EXPERT_INDEX.search(key)
        if converter is None or pattern is None or index is None or param not in FUSED:
            continue
        # transformers' conversion ops: only the concatenating ones have a dim
        ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
        if param == "gate_up_proj" and len(converter.source_patterns) == 2:
            understood = ops == [(MergeModulelist, 0), (Concatenate, 1)]
            projection = (GATE, UP)[converter.source_patterns.index(pattern)]
        else:
            understood, projection = param == "down_proj" and ops == [(MergeModulelist, 0)], DOWN
        if understood:
            layer = f"{container}.{int(index.group(1))}.{projection}"
            if found.setdefault(container, {}).setdefault(layer, key) != key:
                found[container][layer] = ""  # two keys for one expert: not a layout read here
    return found


def read_expert_slice(handle: Any, key: str, where: Sequence[int]) -> torch.Tensor:
    """One expert's ``[out, in]`` weight from a fused key of an open safetensors file (``handle``:
    what ``with safe_open(...)`` gives, untyped in safetensors' stub)."""
    expert, start, stop = where
    weight: torch.Tensor = handle.get_slice(key)[expert : expert + 1, start:stop].squeeze(0).contiguous()
    return weight


def fused_tensor_with_edits(
    base: torch.Tensor,
    layers: Sequence[tuple[LayerSpec, Sequence[int]]],
    edited_weight: Callable[[LayerSpec], torch.Tensor | None],
) -> torch.Tensor:
    """A fused experts tensor with some experts' slices replaced.

    Args:
        base: the stored fused tensor (``[E, ·, ·]``, its own dtype).
        layers: the edited layers it holds and their ``[expert, first row, row stop]``.
        edited_weight: a layer's new ``[out, in]`` weight in the stored dtype (``None``: unchanged).

    Returns:
        ``base`` with those slices overwritten (every other value untouched).
    """
    for spec, (expert, start, stop) in layers:
        weight = edited_weight(spec)
        if weight is not None:
            base[expert, start:stop] = weight.to(base.dtype)
    return base
