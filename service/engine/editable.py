"""Which modules of a transformers model the engram edits, and how their weights are laid out.

Every ``nn.Linear``, every GPT-2 style ``Conv1D`` and every ungrouped ``nn.Conv1d``/``nn.Conv2d``
(:mod:`service.engine.conv`) is an editable layer; other convolutions are refused by name
(:func:`refused_layers`). The engram mathematics works on the canonical ``[out, in]`` matrix;
``Conv1D`` stores its weight transposed (``[in, out]``) and a convolution as ``[out, C_in, *kernel]``
(its ``in`` is the flattened patch), so the two helpers here are the only place that knows about
the difference.

Kept apart from :mod:`service.engine.layers` (the layers by name, no torch) because only a process
that holds a model needs it.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import nn

from service.engine.conv import conv_kernel, conv_refusal, is_conv
from service.engine.layers import LayerSpec, block_index, staged_block_indices


@functools.cache
def _editable_types() -> tuple[type[nn.Module], ...]:
    """The module types the engram edits; GPT-2's Conv1D when transformers (a hard dependency of the
    service, optional to the core) provides it. Imported on first use: a process that only checks
    requests never imports transformers."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a hard dependency of the service
        return (nn.Linear,)
    return (nn.Linear, Conv1D)


def is_editable(module: nn.Module) -> bool:
    """True for the layer types the engram edits (``nn.Linear``, GPT-2 ``Conv1D``, and the
    convolutions :func:`~service.engine.conv.conv_refusal` accepts)."""
    if is_conv(module):
        return conv_refusal(module) is None
    return isinstance(module, _editable_types())


# nn.MultiheadAttention (SigLIP's pooling head, CLIP-style heads) hands its out_proj's weight to
# F.multi_head_attention_forward instead of calling the layer, so no hook on out_proj ever sees its input:
# statistics could never be collected, and the layer would stay listed as editable but unusable.
_FUNCTIONAL_CALLERS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)
_CALLED_BY_WEIGHT = (
    "is a child of nn.MultiheadAttention, which uses its weight directly (F.multi_head_attention_forward) "
    "without calling the layer: its inputs cannot be observed, so no statistics exist for it"
)


def _called_by_weight(model: nn.Module) -> set[str]:
    """Names of the Linear layers whose parent reads their weight instead of calling them."""
    return {
        f"{parent}.{child}" if parent else child
        for parent, module in model.named_modules()
        if isinstance(module, _FUNCTIONAL_CALLERS)
        for child, sub in module.named_children()
        if isinstance(sub, _editable_types())
    }


def refused_layers(model: nn.Module) -> dict[str, str]:
    """The layers of ``model`` the engram does not edit, each with the reason (so that none is left
    out unsaid: a grouped conv, a ``Conv3d``, the out_proj of an ``nn.MultiheadAttention``), in module
    order."""
    refused = {}
    unobservable = _called_by_weight(model)
    for name, module in model.named_modules():
        reason = conv_refusal(module) if is_conv(module) else None
        if name in unobservable:
            reason = _CALLED_BY_WEIGHT
        if reason is not None:
            refused[name] = reason
    return refused


def layer_spec(name: str, module: nn.Module) -> LayerSpec:
    """Describe an editable module.

    Args:
        name: its path in ``model.named_modules()``.
        module: an ``nn.Linear``, ``Conv1D``, or ungrouped ``nn.Conv1d``/``nn.Conv2d``.

    Returns:
        The layer's :class:`LayerSpec`.
    """
    has_bias = getattr(module, "bias", None) is not None  # torch's and transformers' modules: a bias attribute or none
    if isinstance(module, nn.Conv1d | nn.Conv2d):
        kernel = conv_kernel(module)
        return LayerSpec(name, kernel.patch_width, int(module.out_channels), has_bias, False, block_index(name), kernel)
    transposed = not isinstance(module, nn.Linear)
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"layer {name}: {type(module).__name__}.weight is not a tensor")
    rows, cols = weight.shape
    in_features, out_features = (rows, cols) if transposed else (cols, rows)
    return LayerSpec(name, int(in_features), int(out_features), has_bias, transposed, block_index(name))


def editable_layers(model: nn.Module) -> list[LayerSpec]:
    """Every editable layer of ``model``, in module order (blocks inside numbered stages numbered
    across the stages: :func:`~service.engine.layers.staged_block_indices`)."""
    unobservable = _called_by_weight(model)
    specs = [layer_spec(name, m) for name, m in model.named_modules() if is_editable(m) and name not in unobservable]
    staged = staged_block_indices(spec.name for spec in specs)
    return [replace(spec, block=staged[spec.name]) if spec.name in staged else spec for spec in specs]


def weight_matrix(weight: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """The canonical ``[out, in]`` view of a stored weight (a convolution's flattened to
    ``[out, C_in · Π kernel]``, channel-major: the order its unfolded patches have)."""
    if spec.kernel is not None:
        return weight.reshape(spec.out_features, spec.in_features)
    return weight.mT if spec.transposed else weight


def stored_weight(matrix: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """Back from ``[out, in]`` to the layout the checkpoint stores."""
    if spec.kernel is not None:
        shape = (spec.out_features, spec.kernel.in_channels // spec.kernel.groups, *spec.kernel.kernel_size)
        return matrix.reshape(shape).contiguous()
    return matrix.mT.contiguous() if spec.transposed else matrix.contiguous()
