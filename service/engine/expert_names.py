"""Expert layers by name: each expert of a fused experts module is three layers of its own,
``<experts>.<e>.gate_proj``, ``up_proj`` and ``down_proj`` (:mod:`service.engine.experts` explains
why), and the rules that read those names.

Pure names, no torch: the API refuses a request that would put an expert in a peft adapter, or
calibrate over experts, from a registered model's layout with these.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from service.engine.errors import EditError
from service.engine.layers import LayerSpec, summarize_names

GATE, UP, DOWN = "gate_proj", "up_proj", "down_proj"
PROJECTIONS = (GATE, UP, DOWN)
_EXPERT_LAYER = re.compile(r"^(?P<container>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>gate_proj|up_proj|down_proj)$")


def expert_layer(name: str) -> tuple[str, int, str] | None:
    """``(experts module, expert, projection)`` of an expert layer's name, else ``None``."""
    match = _EXPERT_LAYER.match(name)
    if match is None:
        return None
    return match["container"], int(match["expert"]), match["projection"]


def is_expert_layer(name: str) -> bool:
    """Whether a layer of a model's layout is one expert's projection of a fused experts module
    (per-expert ``nn.Linear`` modules inside an ``experts`` container are refused at registration,
    so a layout holds no other layer with such a name)."""
    return expert_layer(name) is not None


def check_adapter_layers(layers: Iterable[LayerSpec]) -> None:
    """Refuse expert layers in a peft adapter: LoRA wraps modules, and an expert of a fused module is
    a slice of a 3-D parameter that no module holds, so peft would load the adapter without its
    expert weights (a silent half-edit).

    Raises:
        EditError: naming the expert layers and what to do instead.
    """
    experts = [spec.name for spec in layers if is_expert_layer(spec.name)]
    if experts:
        raise EditError(
            f'format "peft" cannot carry the expert layers {summarize_names(experts)} (each is a slice of a fused '
            'parameter, which no LoRA module wraps); use format "checkpoint" or "delta", or modules that leave the '
            "experts out"
        )
