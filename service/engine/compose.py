"""Engram arithmetic: ``W_new = W + Σ_k c_k · f_l · W_k⁺`` with ``W_k⁺ = W · Σ_k · Σ_universe⁺``.

Because the engram is linear in ``Σ_k``, the edit of a whole set of terms is one product:
``Σ_k c_k W_k⁺ = W · (Σ_k c_k Σ_k) · Σ_universe⁺``. So a variant costs the same for one concept or
eight, and the universe's pseudo-inverse factors are computed once per input group and reused by
every layer that reads that input (q/k/v, gate/up).

All arithmetic runs in float64 (``COMPUTE_DTYPE``): the result is cast back to the checkpoint's
dtype once, at the end, after a finiteness check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from service.engine.layers import LayerSpec
from service.engine.linalg import PinvFactors, packed_dim, pinv_factors, unpack_symmetric

COMPUTE_DTYPE = torch.float64
Scaling = Literal["uniform", "weight_norm"]


class GroupedStatistics(Protocol):
    """What the algebra reads of a concept's statistics: :class:`LayerStatistics` (in memory,
    full or packed sums) or :class:`~service.engine.stats_io.StatisticsFile` (read per group)."""

    @property
    def layer_group(self) -> Mapping[str, str]: ...

    @property
    def sums(self) -> Mapping[str, torch.Tensor]: ...


class EditError(ValueError):
    """The requested edit cannot be computed (missing statistics, non-finite result)."""


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
        assert factors.basis is not None  # mixed_basis is an order of the factored form only
        return ((w_aug @ product) @ factors.basis.mT).cpu()

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
                assert factors.basis is not None
                mixed_basis = (self._mixed(layer) @ factors.basis) * factors.inverse_eigenvalues
                product = mixed_basis @ factors.basis.mT if order == "projector" else mixed_basis
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
    w = weights.weight.to(COMPUTE_DTYPE)
    w = w.mT if spec.transposed else w
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
    weight = new_w[:, : spec.in_features]
    weight = weight.mT if spec.transposed else weight
    bias = new_w[:, spec.in_features] if spec.bias else None
    return LayerEdit(
        spec,
        weight.contiguous().to(weights.weight.dtype),
        None if bias is None or weights.bias is None else bias.contiguous().to(weights.bias.dtype),
        scale,
    )


# Values per block of :func:`apply_engrams`: 1 MB of float32, in a core's cache, and big enough for
# torch to share an elementwise op among its threads. Measured on the 2-core machine, quiet, for a
# bf16 8192 x 2048 layer and one term: 23 ms with 32K-value blocks (one thread per op, the
# per-op cost dominating), 15 ms with 256K on one thread, 10 ms on two; a 1B-shaped variant's
# arithmetic went from 1.2 s to about 0.3 s. (On a machine whose cores are all taken a two-thread
# op can stall for a time slice; a worker normally has its cores.)
APPLY_BLOCK_VALUES = 1 << 18

# Checkpoint and engram dtypes whose edits are summed in float32 (see :func:`apply_engrams`);
# anything else (a float64 checkpoint, a float64 engram) sums in float64.
_FLOAT32_SUM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def apply_engrams(
    spec: LayerSpec, weights: LayerWeights, terms: Sequence[tuple[float, torch.Tensor]], scale: float
) -> LayerEdit:
    """``[W | b] + Σ_k c_k · E_k`` for one layer, cast back to the checkpoint's dtype.

    For engrams already computed (a universe's stored ``E_k``, ``[out, in(+1)]``), done a block of
    rows at a time, so a layer costs one read of ``W`` and of each engram, and is refused when the
    result is not finite.

    Precision: a float32 or 16-bit checkpoint with float32 or 16-bit engrams (universes store
    float32 engrams for float32 and float16 checkpoints, bfloat16 ones for bfloat16 checkpoints)
    is edited in float32: the terms are summed first (``Δ = Σ c_k E_k``: its rounding is relative
    to the *edit's* size, about ``k`` float32 ulps of ``Σ|c_k E_k|``), then added to ``W`` with one
    rounding, which is the rounding the checkpoint's own dtype makes anyway. One term is a single
    fused ``W + c·E`` (one rounding). This is a third of the memory traffic of summing in float64
    and measured within the exactness bars of tests/engrams and tests/variants. A float64 checkpoint
    or a float64 engram is summed in float64, as :func:`layer_edits` does.

    Args:
        spec: the layer.
        weights: its base parameters, in checkpoint layout and dtype.
        terms: ``(c_k · f_l, E_k)`` per engram.
        scale: the layer's ``f_l``, recorded on the edit.

    Raises:
        EditError: a term's shape does not fit the layer, or the result is not finite.
    """
    for _, engram in terms:
        if tuple(engram.shape) != (spec.out_features, spec.stat_dim):
            raise EditError(
                f"the engram of layer {spec.name} is {tuple(engram.shape)}, not {(spec.out_features, spec.stat_dim)}"
            )
    if spec.bias and weights.bias is None:
        raise EditError(f"layer {spec.name} has statistics with a bias column but no bias tensor")
    if not terms:
        raise EditError(f"the edit of layer {spec.name} has no engram")
    new_w = torch.empty((spec.out_features, spec.in_features), dtype=weights.weight.dtype)
    new_b = torch.empty(spec.out_features, dtype=weights.bias.dtype) if spec.bias and weights.bias is not None else None
    if _sums_in_float32(weights, terms):
        _add_in_float32(spec, weights, terms, new_w, new_b)
    else:
        _add_in_float64(spec, weights, terms, new_w, new_b)
    weight = new_w.mT.contiguous() if spec.transposed else new_w
    return LayerEdit(spec, weight, new_b, scale)


def _sums_in_float32(weights: LayerWeights, terms: Sequence[tuple[float, torch.Tensor]]) -> bool:
    dtypes = [weights.weight.dtype] + ([weights.bias.dtype] if weights.bias is not None else [])
    return all(d in _FLOAT32_SUM_DTYPES for d in dtypes) and all(e.dtype in _FLOAT32_SUM_DTYPES for _, e in terms)


def _add_in_float64(
    spec: LayerSpec,
    weights: LayerWeights,
    terms: Sequence[tuple[float, torch.Tensor]],
    new_w: torch.Tensor,
    new_b: torch.Tensor | None,
) -> None:
    """``new_w | new_b = [W | b] + Σ c_k E_k``, summed in float64, one cast at the end."""
    w = weights.weight.mT if spec.transposed else weights.weight
    for first, acc in _row_blocks(spec.out_features, spec.stat_dim, COMPUTE_DTYPE):
        last = first + acc.shape[0]
        acc[:, : spec.in_features].copy_(w[first:last])
        if new_b is not None:
            assert weights.bias is not None
            acc[:, spec.in_features].copy_(weights.bias[first:last])
        for coefficient, engram in terms:
            acc.add_(engram[first:last], alpha=coefficient)  # a float32 engram is promoted value by value
        # A NaN or an infinity anywhere makes the block's sum non-finite (a sum of finite weights
        # cannot overflow float64): one reduction, where isfinite().all() costs two passes.
        if not math.isfinite(float(acc.sum())):
            raise EditError(f"the edit of layer {spec.name} is not finite; try a larger rcond")
        new_w[first:last].copy_(acc[:, : spec.in_features])
        if new_b is not None:
            new_b[first:last].copy_(acc[:, spec.in_features])


def _add_in_float32(
    spec: LayerSpec,
    weights: LayerWeights,
    terms: Sequence[tuple[float, torch.Tensor]],
    new_w: torch.Tensor,
    new_b: torch.Tensor | None,
) -> None:
    """``new_w | new_b = [W | b] + Σ c_k E_k`` in float32 (see :func:`apply_engrams`); the bias
    column (one value per output) is summed in float64.

    A float32 checkpoint is written by one fused op per block (``W + c·E``, or ``W + Δ``). A 16-bit
    one is summed in a float32 block and cast once on the copy out: torch's mixed-dtype ops round
    ``c·E`` to 16 bits when both operands are 16-bit, and its mixed-dtype add into a 16-bit output
    runs at half the speed of a float32 add and a cast.
    """
    w = weights.weight.mT if spec.transposed else weights.weight
    cols = spec.in_features
    block_rows = max(1, APPLY_BLOCK_VALUES // spec.stat_dim)
    to_float32 = new_w.dtype == torch.float32
    buffer = None if to_float32 and len(terms) == 1 else torch.empty((block_rows, cols), dtype=torch.float32)
    for first in range(0, spec.out_features, block_rows):
        last = min(first + block_rows, spec.out_features)
        target = new_w[first:last]
        rows = [(c, e[first:last, :cols]) for c, e in terms]
        if buffer is None:  # float32, one term: a single, fused, singly rounded W + c·E
            torch.add(w[first:last], rows[0][1], alpha=rows[0][0], out=target)
        else:
            acc = buffer[: last - first]
            if len(rows) == 1:  # W + c·E in float32, rounded once to 16 bits below
                acc.copy_(w[first:last])
                acc.add_(rows[0][1], alpha=rows[0][0])
            else:  # Δ = Σ c_k E_k first: its rounding is relative to the edit's size
                acc.copy_(rows[0][1])
                acc.mul_(rows[0][0])
                for coefficient, engram in rows[1:]:
                    acc.add_(engram, alpha=coefficient)
                if to_float32:
                    torch.add(w[first:last], acc, out=target)
                else:
                    acc.add_(w[first:last])
            if not to_float32:
                target.copy_(acc)
        _require_finite(spec, target)
    if new_b is not None:
        assert weights.bias is not None
        bias = weights.bias.to(COMPUTE_DTYPE)
        for coefficient, engram in terms:
            bias.add_(engram[:, cols], alpha=coefficient)
        _require_finite(spec, bias)
        new_b.copy_(bias)


def _require_finite(spec: LayerSpec, block: torch.Tensor) -> None:
    """Refuse a block with a NaN or an infinity: one float32 sum, and the exact test only when that
    sum is not finite (large finite values can overflow a float32 sum)."""
    if not math.isfinite(float(block.sum())) and not bool(torch.isfinite(block).all()):
        raise EditError(f"the edit of layer {spec.name} is not finite; try a larger rcond")


def combined_norm(spec: LayerSpec, terms: Sequence[tuple[float, torch.Tensor]]) -> float:
    """``‖Σ_k c_k · E_k[:, :in]‖_F`` (W-Norm's numerator) in float64, a block of rows at a time."""
    total = 0.0
    for first, acc in _row_blocks(spec.out_features, spec.in_features, COMPUTE_DTYPE):
        last = first + acc.shape[0]
        acc.zero_()
        for coefficient, engram in terms:
            acc.add_(engram[first:last, : spec.in_features], alpha=coefficient)
        total += float(acc.square_().sum())
    return math.sqrt(total)


def _row_blocks(rows: int, width: int, dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, a [block rows, width] buffer)`` for every block of ``rows`` (one buffer, reused);
    a block holds about :data:`APPLY_BLOCK_VALUES` values."""
    buffer = torch.empty((max(1, APPLY_BLOCK_VALUES // width), width), dtype=dtype)
    for first in range(0, rows, buffer.shape[0]):
        yield first, buffer[: min(buffer.shape[0], rows - first)]
