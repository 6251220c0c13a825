"""Editable layers by name: what the service knows of each (:class:`LayerSpec`), and the rules that
select them, weigh them and name them to a user.

Pure data and string rules, no torch: the API checks a request's ``modules`` and ``layers`` against
a registered model's layout with these. Which modules of a live model are editable, and how their
weights are laid out, is :mod:`service.engine.editable`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Container names whose ``.<name>.<index>.`` segment carries the block index: Llama ``layers``,
# GPT-2 ``h``, BERT ``layer``, T5/others ``block``/``blocks``.
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks|block)\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class ConvKernel:
    """How a convolution reads its input; kept in the model's layout (JSON: lists for tuples).

    Attributes:
        kind: ``"conv1d"`` or ``"conv2d"``.
        in_channels: ``C_in``.
        kernel_size: per spatial dimension.
        stride: per spatial dimension.
        padding: ``(before, after)`` zeros per spatial dimension (``'same'`` made explicit; it may
            be asymmetric, as torch pads it).
        dilation: per spatial dimension.
        groups: always 1 for an edited layer (why: :mod:`service.engine.conv`).
    """

    kind: str
    in_channels: int
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    dilation: tuple[int, ...]
    groups: int = 1

    @property
    def patch_width(self) -> int:
        """The flat weight's columns: ``C_in/groups · Π kernel_size``."""
        return self.in_channels // self.groups * math.prod(self.kernel_size)

    @property
    def spatial_dims(self) -> int:
        return len(self.kernel_size)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "in_channels": self.in_channels,
            "kernel_size": list(self.kernel_size),
            "stride": list(self.stride),
            "padding": [list(pair) for pair in self.padding],
            "dilation": list(self.dilation),
            "groups": self.groups,
        }

    @classmethod
    def from_json(cls, data: Any) -> ConvKernel:
        """From :meth:`to_json`'s form (or ``dataclasses.asdict``'s, tuples instead of lists)."""
        return cls(
            kind=str(data["kind"]),
            in_channels=int(data["in_channels"]),
            kernel_size=tuple(int(k) for k in data["kernel_size"]),
            stride=tuple(int(s) for s in data["stride"]),
            padding=tuple((int(p[0]), int(p[1])) for p in data["padding"]),
            dilation=tuple(int(d) for d in data["dilation"]),
            groups=int(data.get("groups", 1)),
        )

    def adapter_refusal(self, lora_target: str) -> str | None:
        """Why a LoRA adapter for ``lora_target`` cannot carry this conv's edit, or ``None``.

        peft wraps a conv in a ``lora_A`` conv of the same kernel, stride and padding and a 1×1
        ``lora_B``: its ``B·A`` is the edit, but ``lora_A`` is built without the conv's dilation, so
        served unmerged it would read other input values. vLLM serves no LoRA on a convolution.
        """
        if lora_target == "vllm":
            return "vLLM serves no LoRA on a convolution"
        if any(d != 1 for d in self.dilation):
            return (
                f"peft builds the LoRA of a conv without its dilation {list(self.dilation)}, so the "
                "adapter served unmerged would apply another map"
            )
        return None

    def output_length(self, size: int, dim: int) -> int:
        """Output positions along spatial dimension ``dim`` for an input ``size`` wide (torch's formula)."""
        before, after = self.padding[dim]
        reach = self.dilation[dim] * (self.kernel_size[dim] - 1) + 1
        return (size + before + after - reach) // self.stride[dim] + 1


@dataclass(frozen=True)
class LayerSpec:
    """One editable layer.

    Attributes:
        name: module path (``model.layers.0.self_attn.q_proj``).
        in_features: input width D (without the bias column).
        out_features: output width.
        bias: whether the layer has a bias; its statistics then use the augmented input ``[x; 1]``.
        transposed: ``True`` for ``Conv1D``, whose stored weight is ``[in, out]``.
        block: the block index parsed from the name, ``None`` for layers outside the blocks.
        kernel: for a convolution (:mod:`service.engine.conv`), how it reads its input; its
            ``in_features`` is then the patch width ``C_in · Π kernel_size`` and its stored weight
            ``[out, C_in, *kernel_size]``. ``None`` for every other layer (and in layouts recorded
            before convolutions were edited).
    """

    name: str
    in_features: int
    out_features: int
    bias: bool
    transposed: bool
    block: int | None
    kernel: ConvKernel | None = None

    def __post_init__(self) -> None:
        if self.kernel is not None and not isinstance(self.kernel, ConvKernel):  # read back from JSON
            object.__setattr__(self, "kernel", ConvKernel.from_json(self.kernel))

    @property
    def stat_dim(self) -> int:
        """Width of this layer's covariance: the input, plus one for an absorbed bias."""
        return self.in_features + (1 if self.bias else 0)


def block_index(name: str) -> int | None:
    """Parse the transformer-block index from a module path, or ``None``."""
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None


_NUMBERED_SEGMENT = re.compile(r"(?:^|\.)\d+(?:\.|$)")


def staged_block_indices(names: Iterable[str]) -> dict[str, int]:
    """Block indices for blocks that sit in numbered stages (ResNet's and ConvNeXt's
    ``encoder.stages.<s>.layers.<l>``, where the parsed index ``l`` restarts in every stage): the
    blocks numbered in order of first appearance across the stages, so that ``stages.1.layers.0``
    is block 2 after two blocks in stage 0. Names whose block container is not inside a numbered
    one (every text model) are left out: their parsed index is already unique.

    Args:
        names: layer names in module order.

    Returns:
        name -> its block, for the staged names only.
    """
    order: dict[str, int] = {}
    blocks = {}
    for name in names:
        match = _LAYER_INDEX.search(name)
        if match is None or not _NUMBERED_SEGMENT.search(name[: match.start()]):
            continue
        blocks[name] = order.setdefault(name[: match.end(1)], len(order))
    return blocks


def module_type(name: str) -> str:
    """The module's path inside its block (``self_attn.q_proj``), or the whole path outside blocks."""
    match = _LAYER_INDEX.search(name)
    return name[match.end() :] if match and match.end() < len(name) else name


def select_layers(
    layers: Iterable[LayerSpec],
    modules: Sequence[str] | None = None,
    blocks: Sequence[int] | None = None,
) -> list[LayerSpec]:
    """PEFT-style selection: module-name suffixes AND block indices.

    Args:
        layers: candidate layers.
        modules: name suffixes (``"q_proj"`` matches ``...self_attn.q_proj``); ``None`` keeps all.
        blocks: block indices; ``None`` keeps all, otherwise layers outside blocks are dropped.

    Returns:
        The layers that pass both filters, in input order.
    """
    chosen = []
    for spec in layers:
        if modules is not None and not any(_suffix_matches(spec.name, s) for s in modules):
            continue
        if blocks is not None and spec.block not in set(blocks):
            continue
        chosen.append(spec)
    return chosen


def unmatched_suffixes(layers: Sequence[LayerSpec], modules: Sequence[str]) -> list[str]:
    """The suffixes in ``modules`` that match no layer (almost always a typo worth a 422)."""
    return [s for s in modules if not any(_suffix_matches(spec.name, s) for spec in layers)]


def _suffix_matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def module_strength(name: str, strengths: Mapping[str, float] | None) -> float:
    """The strength factor of layer ``name``: that of the longest suffix in ``strengths`` it ends
    with (``mlp.gate_proj`` over ``gate_proj``), else 1."""
    matching = [suffix for suffix in strengths or {} if _suffix_matches(name, suffix)]
    return float(strengths[max(matching, key=len)]) if strengths and matching else 1.0


def with_module_strengths(scales: Mapping[str, float], strengths: Mapping[str, float] | None) -> dict[str, float]:
    """Per-layer ``f_l · s_l``: each layer's scale times its module's strength factor."""
    return {name: scale * module_strength(name, strengths) for name, scale in scales.items()}


def summarize_names(names: Iterable[str]) -> str:
    """Module or parameter paths in a short, readable form, numbered segments merged:
    ``model.layers.{0..3}.mlp.experts.gate_up_proj, down_proj`` for 8 names. Groups (same path up
    to the last segment, numbers aside) are joined by ``"; "``, in order of first appearance."""
    groups: dict[tuple[str, ...], tuple[dict[int, set[int]], list[str]]] = {}
    for name in dict.fromkeys(names):
        *parent, leaf = name.split(".")
        template = tuple("#" if part.isdigit() else part for part in parent)
        numbers, leaves = groups.setdefault(template, ({}, []))
        for position, part in enumerate(parent):
            if part.isdigit():
                numbers.setdefault(position, set()).add(int(part))
        if leaf not in leaves:
            leaves.append(leaf)
    rendered = []
    for template, (numbers, leaves) in groups.items():
        parts = [_number_set(numbers[i]) if part == "#" else part for i, part in enumerate(template)]
        rendered.append(".".join([*parts, ", ".join(leaves)]))
    return "; ".join(rendered)


def _number_set(values: set[int]) -> str:
    """``{0..3,5}`` (a single number as itself)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return str(ordered[0])
    runs: list[list[int]] = []
    for value in ordered:
        if runs and value == runs[-1][-1] + 1:
            runs[-1].append(value)
        else:
            runs.append([value])
    text = ",".join(f"{run[0]}..{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in runs)
    return "{" + text + "}"
