"""W-Norm's numerator for several terms from inner products, without reading the engrams again.

``‖Σ_k c_k E_k,l‖²_F = Σ_j Σ_k c_j c_k ⟨E_j,l, E_k,l⟩`` (over the weight columns ``[:, :in]``). The
diagonal is the square of each member's norm, recorded when the universe was built; each
off-diagonal ``⟨E_j, E_k⟩`` is computed once per pair of members, for every layer in one pass, the
first time a variant needs it, and kept in the universe (``pairs/<a>+<b>.json``, a few kilobytes).
From then on a W-Norm variant of any subset whose pairs are known reads each engram once, for its
edit, instead of twice (once for the norms, once for the edit).

Exactness: each product of two float32 (or float64) entries is summed in float64, as
:func:`~service.engine.arithmetic.combined_norm` sums the combined engram's squares; the two agree to
float64 rounding unless the terms nearly cancel, where W-Norm's scale of that layer is near zero
either way.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import torch
from safetensors import safe_open

from service.context import Context
from service.engine.arithmetic import APPLY_BLOCK_VALUES
from service.engine.layers import LayerSpec
from service.engrams.files import EngramFile, layer_file
from service.engrams.manifest import UniverseManifest
from service.storage.keys import engram_pair_key

Pair = tuple[str, str]


def combined_norms(
    ctx: Context,
    manifest: UniverseManifest,
    terms: Sequence[tuple[float, str]],
    paths: Mapping[str, EngramFile],
    layers: Sequence[LayerSpec],
) -> dict[str, float]:
    """``‖Σ_k c_k E_k,l[:, :in]‖_F`` of every layer from the members' norms and their pairs'
    inner products (the missing pairs computed and stored first).

    Args:
        manifest: the built universe's manifest (each member's per-layer ``norms``).
        terms: ``(c_k, member key)``, each member once.
        paths: member key -> its local engram file (for the pairs not stored yet).
    """
    members = [member for _, member in terms]
    products = {pair: _stored_pair(ctx, manifest.universe_id, pair) for pair in itertools.combinations(members, 2)}
    unknown = [spec for spec in layers if any(spec.name not in values for values in products.values())]
    if unknown:
        _compute_pairs(ctx, manifest.universe_id, products, paths, unknown)
    norms = {}
    for spec in layers:
        square = sum(c * c * manifest.engram_norm(m, spec.name) ** 2 for c, m in terms)
        for (c_j, j), (c_k, k) in itertools.combinations(terms, 2):
            square += 2.0 * c_j * c_k * float(products[(j, k)][spec.name])
        norms[spec.name] = math.sqrt(max(square, 0.0))
    return norms


def _stored_pair(ctx: Context, universe_id: str, pair: Pair) -> dict[str, float]:
    return ctx.storage.find_json(engram_pair_key(universe_id, *pair)) or {}


def _compute_pairs(
    ctx: Context,
    universe_id: str,
    products: dict[Pair, dict[str, float]],
    paths: Mapping[str, EngramFile],
    layers: Sequence[LayerSpec],
) -> None:
    """Add ``⟨E_j,l[:, :in], E_k,l[:, :in]⟩`` for ``layers`` to each pair's products, one layer of
    each engram read at a time, and store every pair that grew (with the layers it held: a pair
    first needed for some modules is completed, never replaced, when others need it)."""
    grown = {pair for pair, values in products.items() if any(spec.name not in values for spec in layers)}
    needed = sorted({member for pair in grown for member in pair})
    for spec in layers:
        engrams = {}
        for member in needed:
            with safe_open(str(layer_file(paths[member], spec.name)), framework="pt") as handle:
                engrams[member] = handle.get_tensor(spec.name)
        for j, k in grown:
            if spec.name not in products[(j, k)]:
                products[(j, k)][spec.name] = _inner(engrams[j], engrams[k], spec.in_features)
    for pair in grown:
        ctx.storage.put_json(engram_pair_key(universe_id, *pair), products[pair])


def _inner(first: torch.Tensor, second: torch.Tensor, columns: int) -> float:
    """``⟨A[:, :columns], B[:, :columns]⟩`` in float64, a block of rows at a time (bounded memory)."""
    rows = max(1, APPLY_BLOCK_VALUES // max(columns, 1))
    total = 0.0
    for start in range(0, first.shape[0], rows):
        a = first[start : start + rows, :columns].to(torch.float64)
        b = second[start : start + rows, :columns].to(torch.float64)
        total += float((a * b).sum())
    return total
