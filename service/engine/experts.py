"""Fused mixture-of-experts layers, edited expert by expert.

transformers 5 fuses the experts of each sparse MLP into one module (``mlp.experts``) holding two
3-D parameters, ``gate_up_proj`` ``[E, 2I, H]`` (expert ``e``'s gate rows ``[0, I)``, up rows
``[I, 2I)``) and ``down_proj`` ``[E, H, I]``, called as ``experts(hidden_states [N, H],
top_k_index [N, k], top_k_weights [N, k])``. With ``R_e`` the tokens whose top-k holds ``e``::

    out_t += top_k_weight(t, e) · down_e(act(gate_e · x_t) ⊙ up_e · x_t)     for t in R_e

To the engram each expert is three linear layers of its own, named after the module:
``<experts>.<e>.gate_proj`` and ``<experts>.<e>.up_proj`` (``H -> I``, one input group: the hidden
states of the tokens routed to ``e``) and ``<experts>.<e>.down_proj`` (``I -> H``, input
``act(gate)·up`` of those tokens). The universe, the engrams and the variants treat them as any
other layer.

Statistics: ``Σ_e = Σ_{t ∈ R_e, counted} x_t x_tᵀ``, *not* weighted by the routing weight. The
paper's estimator is the second moment of what the edited linear map reads, and expert ``e``'s maps
read ``x_t`` itself: the routing weight multiplies the expert's output after ``down_proj``, outside
every map that is edited. Counts are routed tokens and the sums are not normalised, so the engram
``W·Σ_t·Σ_U⁺`` is the same product as for a dense layer (ai-engram's adapter keeps means and undoes
them with its ``count_ratio`` scaling; the result is the same).

An expert that no counted token of a concept reached gets zero statistics (count 0) for that concept:
its engram ``W·0·Σ_U⁺`` is zero. One that no concept of the universe reached has ``Σ_U = 0``, whose
pseudo-inverse is zero: its edit is zero and it is written unchanged. Either way it stays in the
model's layers and in every statistics file, never silently dropped.

The router (``mlp.gate``: a top-k router holding a 2-D weight, not an ``nn.Linear``) is not edited:
the variant routes every token as the base model would for the same hidden state, which is the
routing the per-expert statistics were collected under.

Understood layout, anything else refused by name (:func:`unsupported_experts`): a module whose only
parameters are ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``, with ``act_fn``,
built by transformers' ``use_experts_implementation`` with its defaults (gate and up concatenated,
not transposed, no bias, gated, no post-expert norm) and its default gate ``act(gate)·up``. On disk,
fused (the parameters' own keys, edited slice by slice) or one key per expert and projection (the
keys transformers' conversion mapping merges, ``mlp.experts.{e}.gate_proj.weight`` or Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``), edited key by key: :mod:`service.engine.expert_keys`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.nn import functional as F

from service.engine.editable import is_editable
from service.engine.expert_names import DOWN, GATE, PROJECTIONS, UP, expert_layer
from service.engine.layers import LayerSpec, block_index


@functools.cache
def _default_apply_gate() -> Callable[..., torch.Tensor] | None:
    """transformers' default gate (a class with another one computes something else); imported on
    first use, so a process that only checks requests never imports transformers."""
    try:
        from transformers.integrations.moe import _default_apply_gate as gate
    except ImportError:  # pragma: no cover - an older transformers: no fused experts are understood
        return None
    return cast("Callable[..., torch.Tensor]", gate)


FUSED = ("gate_up_proj", "down_proj")  # the fused parameters, as named in the module and the checkpoint
# use_experts_implementation's options and the values of the layout read here.
_DEFAULT_LAYOUT = {
    "is_concatenated": True,
    "is_transposed": False,
    "has_bias": False,
    "has_gate": True,
    "has_post_expert_norm": False,
}


@dataclass(frozen=True)
class FusedExperts:
    """One fused experts module the service edits expert by expert.

    Attributes:
        name: its module path (``model.layers.0.mlp.experts``).
        num_experts: ``E``.
        hidden: ``H``, the width of the hidden states (gate/up input, down output).
        intermediate: ``I``, each expert's intermediate width (gate/up output, down input).
    """

    name: str
    num_experts: int
    hidden: int
    intermediate: int

    def layer_name(self, expert: int, projection: str) -> str:
        return f"{self.name}.{expert}.{projection}"

    def layer_specs(self) -> list[LayerSpec]:
        """Every expert's gate, up and down layers, expert by expert."""
        block = block_index(self.name)
        specs = []
        for expert in range(self.num_experts):
            for projection in PROJECTIONS:
                width_in, width_out = (
                    (self.intermediate, self.hidden) if projection == DOWN else (self.hidden, self.intermediate)
                )
                specs.append(LayerSpec(self.layer_name(expert, projection), width_in, width_out, False, False, block))
        return specs

    def rows(self, projection: str) -> tuple[str, int, int]:
        """Where a projection lives in the fused parameters: (parameter, first row, row stop) of ``[e]``."""
        if projection == GATE:
            return "gate_up_proj", 0, self.intermediate
        if projection == UP:
            return "gate_up_proj", self.intermediate, 2 * self.intermediate
        return "down_proj", 0, self.hidden


def describe_fused_experts(name: str, module: nn.Module) -> FusedExperts | None:
    """The module as :class:`FusedExperts` when its layout is the one understood here, else ``None``."""
    params = dict(module.named_parameters())
    if set(params) != set(FUSED) or _default_apply_gate() is None:
        return None
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
        return None
    experts, double, hidden = (int(n) for n in gate_up.shape)
    if tuple(down.shape) != (experts, hidden, double // 2):
        return None
    # a transformers experts module: the layout is recognised by its attributes, whichever class it is
    if not callable(getattr(module, "act_fn", None)):
        return None
    if any(not hasattr(module, option) or getattr(module, option) != value for option, value in _DEFAULT_LAYOUT.items()):
        return None
    # the class's own gate, when transformers' default one is overridden (an architecture of its own)
    if getattr(type(module), "_apply_gate", None) is not _default_apply_gate():
        return None
    return FusedExperts(name, experts, hidden, double // 2)


def find_fused_experts(model: nn.Module) -> list[FusedExperts]:
    """Every understood fused experts module of ``model``, in module order."""
    found = []
    for name, module in model.named_modules():
        described = describe_fused_experts(name, module)
        if described is not None:
            found.append(described)
    return found


def unsupported_experts(model: nn.Module) -> list[str]:
    """Parameters of a mixture of experts that the engram cannot edit: every parameter of a module
    inside an ``experts`` container that is not an understood fused module (per-expert Linears, which
    see only the tokens routed to them; fused layouts other than :func:`describe_fused_experts`'s),
    and any other weight of 3 or more dimensions with more than one slice, outside a convolution
    (``ParallelExperts``-style packs). Linears named by module path, other parameters by parameter path.

    A router (``mlp.gate``) and shared experts (``shared_expert(s)``) see every token: they are not
    listed (a router that is an ``nn.Linear`` is an ordinary editable layer).
    """
    understood = {experts.name for experts in find_fused_experts(model)}
    found: list[str] = []
    for module_name, module in model.named_modules():
        if module_name in understood:
            continue
        inside = "experts" in module_name.split(".")
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if inside:
                found.append(module_name if is_editable(module) else full)
            elif _packs_experts(module, param):
                found.append(full)
    return list(dict.fromkeys(found))


def _packs_experts(module: nn.Module, param: nn.Parameter) -> bool:
    """A weight of 3 or more dimensions, one slice per expert, outside a convolution. A leading
    dimension of 1 packs nothing: SigLIP's attention-pooling ``probe`` [1, 1, D], ViT's ``cls_token``
    and ``position_embeddings`` [1, N, D] are single tensors, not experts."""
    packed = param.dim() >= 3 and param.shape[0] > 1
    return packed and not isinstance(module, nn.modules.conv._ConvNd) and not is_editable(module)


# ---------------------------------------------------------------- collection


@dataclass
class ExpertRequest:
    """What collection reads of one fused experts module: the projections asked for, per expert.

    Attributes:
        experts: the module.
        wanted: expert -> projections asked for (a subset of :data:`~service.engine.expert_names.PROJECTIONS`).
    """

    experts: FusedExperts
    wanted: dict[int, list[str]] = field(default_factory=dict)

    def input_group(self, expert: int) -> str | None:
        """The gate/up input group's key (the first of the two layers asked for), or ``None``."""
        projections = self.wanted.get(expert, [])
        first = next((p for p in (GATE, UP) if p in projections), None)
        return None if first is None else self.experts.layer_name(expert, first)


def expert_requests(layers: Iterable[LayerSpec], modules: Mapping[str, nn.Module]) -> dict[str, ExpertRequest]:
    """Group the expert layers among ``layers`` by their experts module (the model's modules are left out).

    Raises:
        ValueError: a layer that is neither a module of the model nor an expert layer; an expert
            layer whose module is not an understood fused experts module of the model, or whose
            expert index is out of range (naming the layer).
    """
    requests: dict[str, ExpertRequest] = {}
    for spec in layers:
        if spec.name in modules:
            continue
        parsed = expert_layer(spec.name)
        if parsed is None:
            raise ValueError(f"layer {spec.name} is not a module of the model")
        container, expert, projection = parsed
        if container not in requests:
            module = modules.get(container)
            described = None if module is None else describe_fused_experts(container, module)
            if described is None:
                raise ValueError(f"layer {spec.name}: {container} is not a fused experts module this service reads")
            requests[container] = ExpertRequest(described)
        if expert >= requests[container].experts.num_experts:
            raise ValueError(f"layer {spec.name}: {container} has {requests[container].experts.num_experts} experts")
        requests[container].wanted.setdefault(expert, []).append(projection)
    return requests


def experts_call(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden_states, top_k_index)`` of a call ``experts(hidden_states, top_k_index, top_k_weights)``."""
    hidden = args[0] if args else kwargs["hidden_states"]
    top_k = args[1] if len(args) > 1 else kwargs["top_k_index"]
    return hidden, top_k


def routed_to(top_k_index: torch.Tensor, expert: int) -> torch.Tensor:
    """Which rows (``[N]`` bool) hold ``expert`` among their top-k."""
    return (top_k_index == expert).any(dim=-1)


def fused_parameter(module: nn.Module, name: str) -> torch.Tensor:
    """A fused parameter as the forward will see it: accelerate's CPU offload leaves it on ``meta``
    until the module's own forward runs, so it is read from the offload's weights map then."""
    param: torch.Tensor = getattr(module, name)
    if param.device.type != "meta":
        return param
    # accelerate's offload hook, present only on an offloaded module
    weights_map = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
    if weights_map is None:
        raise RuntimeError(f"the experts' {name} is on the meta device and no offload holds its values")
    offloaded: torch.Tensor = weights_map[name]  # accelerate's hook is untyped
    return offloaded


class _GatedExperts(Protocol):
    """A fused experts module's gate, as transformers' default ``_apply_gate`` computes it."""

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor: ...


def down_input(module: nn.Module, routed: torch.Tensor, expert: int) -> torch.Tensor:
    """``act(gate)·up`` of the routed hidden states, computed as the experts' forward computes it
    (same dtype, transformers' own gate function): what ``down_proj[expert]`` reads."""
    weight = fused_parameter(module, "gate_up_proj")[expert].to(routed.device)
    # describe_fused_experts checked that the class's gate is transformers' default one; nn.Module's
    # __getattr__ is typed Tensor | Module, so the method is named through a protocol.
    return cast(_GatedExperts, module)._apply_gate(F.linear(routed, weight))
