"""Float64 references for fused mixture-of-experts edits, written out independently of the service.

A float64 copy of the model runs one record at a time; each experts call's hidden states and top-k
routing are captured, and every expert gets the rows its maps read: the counted tokens routed to it
(``x`` for gate/up, ``silu(gate)·up`` for down), not weighted by the routing weight.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from service.engine.expert_names import expert_layer
from service.engine.linalg import default_rcond
from service.engine.records import Record, encode_record


def reference_rows(model: nn.Module, tokenizer: Any, records: Sequence[Record], max_length: int) -> dict[str, torch.Tensor]:
    """Each expert layer's input rows, float64: a float64 copy run one record at a time (no padding)."""
    assert model.config.hidden_act == "silu"
    copy64 = copy.deepcopy(model).double().eval()
    copy64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    modules = {name: m for name, m in copy64.named_modules() if name.endswith("mlp.experts")}
    calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    handles = [
        m.register_forward_pre_hook(lambda _m, args, name=name: calls.append((name, args[0], args[1])))
        for name, m in modules.items()
    ]
    rows: dict[str, list[torch.Tensor]] = defaultdict(list)
    try:
        with torch.no_grad():
            for record in records:
                example = encode_record(tokenizer, record, max_length)
                counted = torch.tensor(example.counted)
                calls.clear()
                copy64(input_ids=torch.tensor([example.input_ids]))
                for name, hidden, top_k in calls:
                    fused = modules[name]
                    for e in range(fused.gate_up_proj.shape[0]):
                        x = hidden[(top_k == e).any(dim=-1) & counted]
                        gate, up = (x @ fused.gate_up_proj[e].T).chunk(2, dim=-1)
                        rows[f"{name}.{e}.gate_proj"].append(x)
                        rows[f"{name}.{e}.up_proj"].append(x)
                        rows[f"{name}.{e}.down_proj"].append(F.silu(gate) * up)
    finally:
        for handle in handles:
            handle.remove()
    return {layer: torch.cat(parts) for layer, parts in rows.items()}


def reference_pinv(sigma: torch.Tensor) -> torch.Tensor:
    lam, vecs = torch.linalg.eigh(sigma)
    keep = lam > max(default_rcond(sigma.shape[0]) * float(lam[-1]), 0.0)
    return (vecs[:, keep] / lam[keep]) @ vecs[:, keep].T


def expert_weight(model: nn.Module, layer: str) -> torch.Tensor:
    """An expert layer's ``[out, in]`` weight, read from a loaded model's fused parameters."""
    container, e, projection = expert_layer(layer)  # type: ignore[misc]
    fused = model.get_submodule(container)
    inter = fused.down_proj.shape[2]
    if projection == "down_proj":
        return fused.down_proj[e]
    return fused.gate_up_proj[e, :inter] if projection == "gate_proj" else fused.gate_up_proj[e, inter:]
