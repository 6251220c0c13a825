"""Which modules of a transformers model the engram edits, and how their weights are laid out.

Every ``nn.Linear`` and every GPT-2 style ``Conv1D`` is an editable layer. The engram
mathematics works on the canonical ``[out, in]`` matrix; ``Conv1D`` stores its weight transposed
(``[in, out]``), so the two helpers here are the only place that knows about the difference.

Kept apart from :mod:`service.engine.layers` (the layers by name, no torch) because only a process
that holds a model needs it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from service.engine.layers import LayerSpec, block_index


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
    """True for the layer types the engram edits (``nn.Linear`` and GPT-2 ``Conv1D``)."""
    return isinstance(module, _editable_types())


def layer_spec(name: str, module: nn.Module) -> LayerSpec:
    """Describe an editable module.

    Args:
        name: its path in ``model.named_modules()``.
        module: an ``nn.Linear`` or ``Conv1D``.

    Returns:
        The layer's :class:`LayerSpec`.
    """
    transposed = not isinstance(module, nn.Linear)
    weight = module.weight
    assert isinstance(weight, torch.Tensor), f"{type(module).__name__}.weight is not a tensor"
    rows, cols = weight.shape
    in_features, out_features = (rows, cols) if transposed else (cols, rows)
    has_bias = getattr(module, "bias", None) is not None
    return LayerSpec(name, int(in_features), int(out_features), has_bias, transposed, block_index(name))


def editable_layers(model: nn.Module) -> list[LayerSpec]:
    """Every editable layer of ``model``, in module order."""
    return [layer_spec(name, m) for name, m in model.named_modules() if is_editable(m)]


def weight_matrix(weight: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """The canonical ``[out, in]`` view of a stored weight."""
    return weight.mT if spec.transposed else weight


def stored_weight(matrix: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """Back from ``[out, in]`` to the layout the checkpoint stores."""
    return matrix.mT.contiguous() if spec.transposed else matrix.contiguous()
