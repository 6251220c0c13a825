"""Float64 references of the engram algebra (``service.engine.compose``) and the bars an edit is held
to: ``[W | b]`` written out here, a pseudo-inverse with its own eigendecomposition and cut, and the
engram ``[W | b] · Σ_k · Σ_U⁺``. Shared by the engine's, universes', variants' and calibration's tests.
"""

from __future__ import annotations

import torch

from service.engine.compose import LayerEdit, LayerWeights
from service.engine.layers import LayerSpec
from service.engine.linalg import EPS_FLOAT32

WEIGHT_TOL = 1e-6  # new weights vs reference: the float32 cast of the result costs ~6e-8
DELTA_TOL = 1e-4  # the edit itself (new - old) vs reference, the brief's exactness bar


def reference_pinv(sigma: torch.Tensor, rcond: float | None = None) -> torch.Tensor:
    """Dense float64 pseudo-inverse keeping eigenvalues above ``rcond · λ_max`` (default D · eps32)."""
    sym = (sigma.double() + sigma.double().T) * 0.5
    cut = sigma.shape[0] * EPS_FLOAT32 if rcond is None else rcond
    lam, vec = torch.linalg.eigh(sym)
    keep = lam > cut * lam.max()
    return (vec[:, keep] / lam[keep]) @ vec[:, keep].T


def augmented(spec: LayerSpec, weights: LayerWeights) -> torch.Tensor:
    """``[W | b]`` as ``[out, in(+1)]`` float64, written out here rather than imported."""
    w = weights.weight.double()
    if spec.transposed:
        w = w.T
    if spec.bias:
        assert weights.bias is not None
        w = torch.cat([w, weights.bias.double()[:, None]], dim=1)
    return w


def reference_engram(spec: LayerSpec, weights: LayerWeights, target: torch.Tensor, universe: torch.Tensor) -> torch.Tensor:
    return augmented(spec, weights) @ target.double() @ reference_pinv(universe)


def canonical(edit: LayerEdit) -> torch.Tensor:
    """An edit's ``[W | b]`` in ``[out, in(+1)]`` layout, float64."""
    w = edit.weight.double()
    w = w.T if edit.spec.transposed else w
    if edit.bias is not None:
        w = torch.cat([w, edit.bias.double()[:, None]], dim=1)
    return w


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())
