"""A Linear layer whose parent uses its weight without calling it is refused by name, not listed as editable.

``nn.MultiheadAttention`` (SigLIP's attention-pooling head) hands ``out_proj.weight`` to
``F.multi_head_attention_forward``: a forward hook on ``out_proj`` never fires, so statistics of its input
cannot be collected. Before this check the layer was listed as editable and every unlearn that needed it
was a 409 about missing statistics.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from service.engine.editable import editable_layers, refused_layers

pytestmark = pytest.mark.fast


class _PoolingHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.mlp = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled, _ = self.attention(x, x, x)
        return self.mlp(pooled)


def test_the_out_proj_of_a_multihead_attention_is_refused_naming_why() -> None:
    head = _PoolingHead()
    seen: list[str] = []
    head.attention.out_proj.register_forward_hook(lambda *_: seen.append("out_proj"))
    head(torch.randn(2, 3, 8))
    assert seen == [], "the premise: the layer's own forward is never called"

    names = [spec.name for spec in editable_layers(head)]
    assert names == ["mlp"]
    refused = refused_layers(head)
    assert list(refused) == ["attention.out_proj"]
    assert "nn.MultiheadAttention" in refused["attention.out_proj"]
