"""Engram arithmetic: ``W_new = W + Σ_k c_k · f_l · W_k⁺`` with ``W_k⁺ = W · Σ_k · Σ_universe⁺``.

Because the engram is linear in ``Σ_k``, the edit of a whole set of terms is one product:
``Σ_k c_k W_k⁺ = W · (Σ_k c_k Σ_k) · Σ_universe⁺``. So a variant costs the same for one concept or
eight, and the universe's pseudo-inverse factors are computed once per input group and reused by
every layer that reads that input (q/k/v, gate/up).

All arithmetic runs in float64 (``COMPUTE_DTYPE``): the result is cast back to the checkpoint's
dtype once, at the end, after a finiteness check.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from service.engine.editable import stored_weight, weight_matrix
from service.engine.errors import EditError
from service.engine.layers import LayerSpec
from service.engine.linalg import PinvFactors, packed_dim, pinv_factors, unpack_symmetric

COMPUTE_DTYPE = torch.float64
Scaling = Literal["uniform", "weight_norm"]


class GroupedStatistics(Protocol):
    """What the algebra reads of a concept's statistics: :class:`~service.engine.collect.LayerStatistics` (in memory,
    full or packed sums) or :class:`~service.engine.stats_io.StatisticsFile` (read per group)."""

    @property
    def layer_group(self) -> Mapping[str, str]: ...

    @property
    def sums(self) -> Mapping[str, torch.Tensor]: ...


class EngramSource(Protocol):
    """Where a layer's ``Σ_k c_k W_k⁺`` comes from: :class:`EngramAlgebra` (computed from
    statistics) or a universe's stored engrams (:class:`service.engrams.store.StoredEngrams`)."""

    def engram(self, spec: LayerSpec, weights: LayerWeights) -> torch.Tensor: ...


@dataclass(frozen=True)
class LayerWeights:
    """A layer's stored parameters: ``weight`` in checkpoint layout, ``bias`` or ``None``."""

    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass(frozen=True)
class LayerEdit:
    """The edited parameters of one layer, in checkpoint layout and dtype."""

    spec: LayerSpec
    weight: torch.Tensor
    bias: torch.Tensor | None
    scale: float


@dataclass(frozen=True)
class LayerDelta:
    """One layer's edit before it is applied: what a checkpoint adds and a LoRA adapter factorizes.

    Attributes:
        spec: the layer.
        weights: its base parameters, in checkpoint layout and dtype.
        delta: ``f_l · Σ_k c_k W_k⁺`` as ``[out, in(+1)]`` float64 (bias column last).
        scale: the layer's ``f_l``.
    """

    spec: LayerSpec
    weights: LayerWeights
    delta: torch.Tensor
    scale: float


@dataclass
class EngramAlgebra:
    """Combines cached statistics into per-layer edits.

    Attributes:
        terms: ``(coefficient, statistics)`` per concept in the edit.
        universe: statistics of every concept in the universe (targets and references).
        rcond: relative eigenvalue cut of the universe pseudo-inverse (``None``: ``D · eps32``).
        universe_key: names the universe's statistics; with it, ``factor_cache`` may be shared by
            every edit of the same universe (all 2ⁿ−1 subsets decompose each input group once).
        factor_cache: where pseudo-inverse factors are kept, per (universe, rcond, input group).
        factor_source: layer name -> the universe's factors for that layer's input group, when they
            are stored (a universe built once): then nothing is decomposed and ``universe`` may be empty.
        device: where the float64 products run (``"cuda"`` on a GPU with strong FP64); weights,
            statistics and factors are moved there once per layer or group, and every engram comes
            back to the CPU.
    """

    terms: Sequence[tuple[float, GroupedStatistics]]
    universe: Sequence[GroupedStatistics]
    rcond: float | None = None
    universe_key: str | None = None
    factor_cache: MutableMapping[Hashable, PinvFactors] = field(default_factory=dict, repr=False)
    factor_source: Callable[[str], PinvFactors] | None = field(default=None, repr=False)
    device: str = "cpu"
    # Σ_k c_k Σ_k and the group-level product of the last input group: the layers of a group
    # (q/k/v, gate/up) come one after another and share both.
    _last_mixed: tuple[tuple[str, ...], torch.Tensor] | None = field(default=None, init=False, repr=False)
    _last_product: tuple[tuple[str, ...], str, torch.Tensor] | None = field(default=None, init=False, repr=False)
    _group_sizes: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _moved_factors: tuple[int, PinvFactors] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.terms:
            raise EditError("an edit needs at least one term")
        if not self.universe and self.factor_source is None:
            raise EditError("the universe is empty")

    def engram(self, spec: LayerSpec, weights: LayerWeights) -> torch.Tensor:
        """``Σ_k c_k W_k⁺`` for one layer, as ``[out, in(+1)]`` float64 (bias column last), on the CPU."""
        w_aug = augmented_weight(spec, weights).to(self.device)
        factors = self._on_device(self.factors(spec.name))
        out_total = spec.out_features * self._group_size(spec.name)
        order = product_order(out_total, spec.stat_dim, factors.rank, factors.explicit)
        if order == "weight_first":
            return factors.apply_right(w_aug @ self._mixed(spec.name)).cpu()
        product = self._group_product(spec.name, order, factors)
        if order == "projector":
            return (w_aug @ product).cpu()
        # mixed_basis is an order of the factored form only
        return ((w_aug @ product) @ factors.factored_basis().mT).cpu()

    def _on_device(self, factors: PinvFactors) -> PinvFactors:
        """``factors`` on :attr:`device` (moved once per group: a group's layers come in a row)."""
        if self.device == "cpu":
            return factors
        if self._moved_factors is None or self._moved_factors[0] != id(factors):
            self._moved_factors = None
            self._moved_factors = (id(factors), factors.to(self.device))
        return self._moved_factors[1]

    def _group_product(self, layer: str, order: Order, factors: PinvFactors) -> torch.Tensor:
        """The right-hand factor the group's layers share: ``M·V·Λ⁻¹`` ([D, k]), or for
        ``projector`` the whole ``M·Σ⁺ = M·V·Λ⁻¹·Vᵀ`` ([D, D])."""
        groups = tuple(self._group(stats, layer) for _, stats in self.terms)
        if self._last_product is None or self._last_product[:2] != (groups, order):
            if factors.explicit:
                product = factors.apply_right(self._mixed(layer))  # projector: M·Σ⁺
            else:
                basis = factors.factored_basis()
                mixed_basis = (self._mixed(layer) @ basis) * factors.inverse_eigenvalues
                product = mixed_basis @ basis.mT if order == "projector" else mixed_basis
            self._last_product = (groups, order, product)
        return self._last_product[2]

    def _group_size(self, layer: str) -> int:
        """How many layers read this layer's input (1, or 3 for q/k/v, 2 for gate/up)."""
        stats = self.terms[0][1]
        group = self._group(stats, layer)
        if group not in self._group_sizes:
            self._group_sizes[group] = sum(1 for g in stats.layer_group.values() if g == group)
        return self._group_sizes[group]

    def _mixed(self, layer: str) -> torch.Tensor:
        groups = tuple(self._group(stats, layer) for _, stats in self.terms)
        if self._last_mixed is None or self._last_mixed[0] != groups:
            pairs = ((c, stats.sums[g]) for (c, stats), g in zip(self.terms, groups, strict=True))
            self._last_mixed = None  # let the previous group's go first (a GPU holds one at a time)
            self._last_mixed = (groups, weighted_sum(pairs).to(self.device))
        return self._last_mixed[1]

    def factors(self, layer: str) -> PinvFactors:
        """Pseudo-inverse factors of the universe covariance feeding ``layer`` (cached per group)."""
        if self.factor_source is not None:
            return self.factor_source(layer)
        key = (self.universe_key or id(self), self.rcond, tuple(self._group(stats, layer) for stats in self.universe))
        cached = self.factor_cache.get(key)
        if cached is None:
            total = weighted_sum((1.0, stats.sums[self._group(stats, layer)]) for stats in self.universe)
            cached = self.factor_cache[key] = pinv_factors(total, self.rcond)
        return cached

    @staticmethod
    def _group(stats: GroupedStatistics, layer: str) -> str:
        try:
            return stats.layer_group[layer]
        except KeyError:
            raise EditError(f"no statistics for layer {layer}") from None


Order = Literal["weight_first", "mixed_basis", "projector"]


def product_order(out_total: int, dim: int, rank: int, explicit: bool = False) -> Order:
    """The cheapest way to compute ``W·M·Σ⁺`` for an input group, by multiply-adds.

    Args:
        out_total: output rows of every layer reading this input (q+k+v, gate+up, or one layer).
        dim: the input width ``D`` (plus one with a bias column).
        rank: ``k``, the directions the universe pseudo-inverse keeps.
        explicit: whether ``Σ⁺`` is held as a ``[D, D]`` matrix (else as factors ``V·Λ⁻¹·Vᵀ``).

    Returns:
        Factored: ``weight_first``: ``(W·M)·V·Λ⁻¹·Vᵀ`` per layer (``O·D² + 2·O·D·k``), best for a
        wide input read by a narrow layer (``down_proj``); ``mixed_basis``: ``M·V·Λ⁻¹`` once per
        group, then ``(W·that)·Vᵀ`` (``D²·k + 2·O·D·k``), best when ``k < O``; ``projector``:
        ``M·Σ⁺`` once per group, then ``W·that`` (``2·D²·k + O·D²``), best for many outputs (q/k/v,
        gate/up, lm_head). Explicit: ``weight_first`` ``(W·M)·Σ⁺`` (``2·O·D²``) or ``projector``
        (``D³ + O·D²``).
    """
    if explicit:
        costs: dict[Order, int] = {
            "weight_first": 2 * out_total * dim * dim,
            "projector": dim**3 + out_total * dim * dim,
        }
    else:
        costs = {
            "weight_first": out_total * dim * dim + 2 * out_total * dim * rank,
            "mixed_basis": dim * dim * rank + 2 * out_total * dim * rank,
            "projector": 2 * dim * dim * rank + out_total * dim * dim,
        }
    return min(costs, key=lambda order: (costs[order], order != "weight_first"))


def weighted_sum(pairs: Iterable[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """``Σ c · Σ`` as a full ``[D, D]`` float64 matrix, from full or packed (1-D upper-triangle) sums.

    Packed sums are added while packed and unpacked once: unpacking is the costly step, and a
    universe of n concepts would otherwise pay it n times per input group. ``pairs`` is consumed
    one at a time, so a generator reading each sum from disk holds one sum in memory, not n.
    """
    packed: torch.Tensor | None = None
    full: torch.Tensor | None = None
    for c, t in pairs:
        term = t.to(COMPUTE_DTYPE)
        if t.ndim == 1:
            packed = c * term if packed is None else packed.add_(term, alpha=c)
        else:
            full = c * term if full is None else full.add_(term, alpha=c)
    if packed is not None:
        unpacked = unpack_symmetric(packed, packed_dim(packed.numel()))
        full = unpacked if full is None else full.add_(unpacked)
    if full is None:
        raise EditError("no statistics to combine")
    return full


def augmented_weight(spec: LayerSpec, weights: LayerWeights) -> torch.Tensor:
    """``[W | b]`` in canonical ``[out, in(+1)]`` layout, float64."""
    w = weight_matrix(weights.weight.to(COMPUTE_DTYPE), spec)
    if spec.bias:
        if weights.bias is None:
            raise EditError(f"layer {spec.name} has statistics with a bias column but no bias tensor")
        w = torch.cat([w, weights.bias.to(COMPUTE_DTYPE).reshape(-1, 1)], dim=1)
    return w


def relative_norm(spec: LayerSpec, engram: torch.Tensor, weights: LayerWeights) -> float:
    """The paper's W-Norm ``ρ_l = ‖W_l⁺‖_F / ‖W_l‖_F`` (weight columns only, as ai-engram does)."""
    w_norm = float(weights.weight.to(COMPUTE_DTYPE).norm())
    return float(engram[:, : spec.in_features].norm()) / max(w_norm, 1e-30)


def relative_norms(
    layers: Sequence[LayerSpec], algebra: EngramSource, load: Callable[[LayerSpec], LayerWeights]
) -> dict[str, float]:
    """``ρ_l`` of the algebra's edit for every layer: where the memory lives (the paper's Fig. 4)."""
    rho = {}
    for spec in layers:
        weights = load(spec)
        rho[spec.name] = relative_norm(spec, algebra.engram(spec, weights), weights)
    return rho


def layer_scales(
    layers: Sequence[LayerSpec],
    algebra: EngramSource,
    load: Callable[[LayerSpec], LayerWeights],
    scaling: Scaling,
) -> dict[str, float]:
    """Per-layer factor ``f_l``: 1 (uniform) or ``ρ_l / max_l ρ_l`` (weight_norm).

    For weight_norm, ``ρ_l`` is measured on the requested edit ``Σ_k c_k W_k⁺`` (for an unlearn
    request: the engram of the removed set), so the schedule follows where that memory lives.
    Only the norms are kept: :func:`layer_edits` computes each engram again rather than holding
    every layer's float64 engram (a second, double-precision copy of the model) between passes.
    """
    if scaling == "uniform":
        return {spec.name: 1.0 for spec in layers}
    if scaling != "weight_norm":
        raise EditError(f"unknown scaling {scaling!r}")
    return normalized_scales(relative_norms(layers, algebra, load))


def normalized_scales(rho: Mapping[str, float]) -> dict[str, float]:
    """W-Norm's ``f_l = ρ_l / max_l ρ_l`` (all zero when every ``ρ_l`` is)."""
    top = max(rho.values(), default=0.0)
    return {name: (value / top if top > 0 else 0.0) for name, value in rho.items()}


def layer_deltas(
    layers: Sequence[LayerSpec],
    algebra: EngramSource,
    load: Callable[[LayerSpec], LayerWeights],
    scales: Mapping[str, float],
) -> Iterator[LayerDelta]:
    """The float64 change of each layer, one layer at a time (nothing model-sized is held).

    Args:
        layers: the layers to edit now (a subset of those ``scales`` was computed for).
        algebra: the terms and universe.
        load: reads a layer's current parameters from the checkpoint.
        scales: per-layer ``f_l`` from :func:`layer_scales` over the whole selection.

    Yields:
        One :class:`LayerDelta` per layer with a non-zero scale (not yet checked for finiteness).
    """
    for spec in layers:
        scale = scales[spec.name]
        if scale == 0.0:
            continue
        weights = load(spec)
        yield LayerDelta(spec, weights, scale * algebra.engram(spec, weights), scale)


def layer_edits(
    layers: Sequence[LayerSpec],
    algebra: EngramSource,
    load: Callable[[LayerSpec], LayerWeights],
    scales: Mapping[str, float],
) -> Iterator[LayerEdit]:
    """Edited parameters for each layer, one layer at a time (see :func:`layer_deltas`).

    Yields:
        One :class:`LayerEdit` per layer with a non-zero scale.

    Raises:
        EditError: a layer's result is not finite.
    """
    for item in layer_deltas(layers, algebra, load, scales):
        yield _apply_delta(item.spec, item.weights, item.delta, item.scale)


def layer_editor(
    algebra: EngramSource, load: Callable[[LayerSpec], LayerWeights], scales: Mapping[str, float]
) -> Callable[[LayerSpec], LayerEdit | None]:
    """One layer's edit on demand (``None`` for a zero scale), for writers that stream layer by layer."""

    def edit(spec: LayerSpec) -> LayerEdit | None:
        return next(iter(layer_edits([spec], algebra, load, scales)), None)

    return edit


def _apply_delta(spec: LayerSpec, weights: LayerWeights, delta: torch.Tensor, scale: float) -> LayerEdit:
    new_w = augmented_weight(spec, weights) + delta
    if not torch.isfinite(new_w).all():
        raise EditError(f"the edit of layer {spec.name} is not finite; try a larger rcond")
    weight = stored_weight(new_w[:, : spec.in_features], spec)
    bias = new_w[:, spec.in_features] if spec.bias else None
    return LayerEdit(
        spec,
        weight.contiguous().to(weights.weight.dtype),
        None if bias is None or weights.bias is None else bias.contiguous().to(weights.bias.dtype),
        scale,
    )
