"""Reading a built universe's engrams: ``Σ_k c_k E_k,l`` one layer at a time, and W-Norm's ``ρ_l``.

A variant of a built universe is arithmetic on these files: no statistics are read, nothing is
decomposed, and no ``O·D²`` product is computed. Each read maps a member's file only while it copies
one layer out (as :class:`~service.engine.checkpoint.CheckpointReader` does for weights).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial

import torch
from safetensors import safe_open

from service.context import Context
from service.engine.arithmetic import apply_engrams, combined_norm
from service.engine.compose import COMPUTE_DTYPE, EngramAlgebra, LayerEdit, LayerWeights
from service.engine.errors import EditError
from service.engine.layers import LayerSpec
from service.engine.stats_io import StatisticsFile
from service.engrams.files import EngramFile, MemberFiles, layer_file
from service.engrams.manifest import UniverseManifest
from service.engrams.pairs import combined_norms
from service.statistics.local import statistics
from service.storage.keys import canonical_digest, engram_key
from service.storage.local_copies import local_object


class StoredEngrams:
    """``Σ_k c_k E_k,l`` of a built universe, read from its members' engram files.

    Args:
        terms: ``(c_k, engram file)`` per term (a member's :class:`MemberFiles` where its engrams are in
            several files); a file named twice has its coefficients added.
        layers: the layers the universe has engrams for (any other is refused by name).
        members: engram file -> its member key in the universe's manifest (where its norms are).
        combined_norms: every layer's ``‖Σ_k c_k E_k,l[:, :in]‖`` at once, without reading the
            engrams (None: each layer's is computed from its engrams).
    """

    def __init__(
        self,
        terms: Sequence[tuple[float, EngramFile]],
        layers: Collection[str],
        members: Mapping[EngramFile, str] | None = None,
        combined_norms: Callable[[Sequence[LayerSpec]], dict[str, float]] | None = None,
        require_layer: Callable[[str], None] | None = None,
    ) -> None:
        self.members = dict(members or {})
        merged: dict[EngramFile, float] = {}
        for coefficient, path in terms:
            merged[path] = merged.get(path, 0.0) + float(coefficient)
        self.terms = [(c, p) for p, c in merged.items()]
        self.layers = set(layers)
        # Several terms' W-Norm numerators from the universe's pair products (service.engrams.pairs).
        self.combined_norms = combined_norms
        # A partial universe's check: a layer of a deferred group is refused naming the group.
        self.require_layer = require_layer

    def read(self, spec: LayerSpec) -> list[tuple[float, torch.Tensor]]:
        """``(c_k, E_k,l)`` per term, as stored (float32 or float64)."""
        if self.require_layer is not None:
            self.require_layer(spec.name)
        if spec.name not in self.layers:
            raise EditError(f"no statistics for layer {spec.name}")
        read = []
        for coefficient, engrams in self.terms:
            with safe_open(str(layer_file(engrams, spec.name)), framework="pt") as handle:
                read.append((coefficient, handle.get_tensor(spec.name)))
        return read

    def engram(self, spec: LayerSpec, weights: LayerWeights) -> torch.Tensor:
        """``Σ_k c_k E_k,l`` as ``[out, in(+1)]`` float64 (what :class:`EngramAlgebra` computes)."""
        total: torch.Tensor | None = None
        for coefficient, engram in self.read(spec):
            term = engram.to(COMPUTE_DTYPE)
            total = term.mul_(coefficient) if total is None else total.add_(term, alpha=coefficient)
        if total is None:
            raise EditError(f"the edit of layer {spec.name} has no term: a variant has at least one")
        return total

    def norm(self, spec: LayerSpec) -> float:
        """``‖Σ_k c_k E_k,l[:, :in]‖_F`` (W-Norm's numerator), float64."""
        return combined_norm(spec, self.read(spec))

    def edit(self, spec: LayerSpec, weights: LayerWeights, scale: float) -> LayerEdit:
        """The layer's edited parameters, ``[W | b] + f_l · Σ_k c_k E_k,l``, streamed by row blocks."""
        return apply_engrams(spec, weights, [(scale * c, e) for c, e in self.read(spec)], scale)


def stored_engrams(ctx: Context, manifest: UniverseManifest, terms: Mapping[str, float]) -> StoredEngrams:
    """The engrams of ``terms`` (statistics prefix -> coefficient) in a built universe, as local files
    (or, for a universe built in stages, fetched per layer: a partial universe's deferred layers are
    refused by name when read).

    Raises:
        EditError: a term is not a member of the universe.
    """
    keys = {m.stats: m.key for m in manifest.members}
    outside = sorted(p for p in terms if p not in keys)
    if outside:
        raise EditError(f"statistics {', '.join(outside)} are not members of universe {manifest.universe_id}")
    paths: dict[str, EngramFile] = {
        p: MemberFiles(ctx, manifest, keys[p])
        if manifest.engrams[keys[p]].files
        else local_object(ctx, engram_key(manifest.universe_id, keys[p]))
        for p in terms
    }
    members = {paths[p]: keys[p] for p in terms}
    member_terms = [(c, keys[p]) for p, c in terms.items()]
    member_paths = {keys[p]: paths[p] for p in terms}
    norms = partial(combined_norms, ctx, manifest, member_terms, member_paths)
    return StoredEngrams([(c, paths[p]) for p, c in terms.items()], manifest.layers, members, norms, manifest.require_layer)


def stored_editor(
    source: StoredEngrams, load: Callable[[LayerSpec], LayerWeights], scales: Mapping[str, float]
) -> Callable[[LayerSpec], LayerEdit | None]:
    """One layer's edit on demand for the streaming writers (``None`` for a zero scale)."""

    def edit(spec: LayerSpec) -> LayerEdit | None:
        scale = scales[spec.name]
        return None if scale == 0.0 else source.edit(spec, load(spec), scale)

    return edit


def relative_norms(layers: Sequence[LayerSpec], engrams: StoredEngrams, manifest: UniverseManifest) -> dict[str, float]:
    """W-Norm's ``ρ_l = ‖Σ_k c_k E_k,l[:, :in]‖_F / ‖W_l‖_F`` of every layer.

    One member: from the norms recorded when the universe was built (nothing read). Several: from
    those norms and the members' pair products (:mod:`service.engrams.pairs`, computed once per pair),
    else the norm of the summed stored engram, one layer at a time.
    """
    for spec in layers:
        manifest.require_layer(spec.name)  # a deferred group's layer is refused naming its group
        if spec.name not in engrams.layers:
            raise EditError(f"no statistics for layer {spec.name}")
    several = len(engrams.terms) > 1 and engrams.combined_norms is not None
    combined = engrams.combined_norms(layers) if several and engrams.combined_norms else {}
    rho = {}
    for spec in layers:
        weight_norm = max(manifest.weight_norm(spec.name), 1e-30)
        if len(engrams.terms) == 1 and engrams.terms[0][1] in engrams.members:
            coefficient, path = engrams.terms[0]
            norm = abs(coefficient) * manifest.engram_norm(engrams.members[path], spec.name)
        else:
            norm = combined[spec.name] if spec.name in combined else engrams.norm(spec)
        rho[spec.name] = norm / weight_norm
    return rho


# ---------------------------------------------------------------- from statistics


def statistics_algebra(
    ctx: Context,
    terms: Mapping[str, float],
    term_stats: Mapping[str, str],
    universe_stats: Sequence[str],
    rcond: float | None,
) -> EngramAlgebra:
    """An :class:`EngramAlgebra` over statistics, sharing this process's factor cache.

    Args:
        terms: name -> coefficient; ``term_stats``: each name's statistics prefix.
        universe_stats: the universe's statistics prefixes.
    """
    # Each file is opened at most once per request, even when the shared cache is too small to
    # keep the whole universe.
    loaded: dict[str, StatisticsFile] = {}

    def stats(prefix: str) -> StatisticsFile:
        if prefix not in loaded:
            loaded[prefix] = statistics(ctx, prefix)
        return loaded[prefix]

    summed = [(float(terms[n]), stats(prefix)) for n, prefix in term_stats.items()]
    universe = [stats(prefix) for prefix in universe_stats]
    # The factors of what still combines statistics directly (the memory-trace maps of service.maps),
    # in this process's cache of this store (ENGRAM_FACTOR_CACHE_BYTES).
    universe_key = canonical_digest(sorted(universe_stats))
    factors = ctx.caches.factors.of(ctx.storage)
    return EngramAlgebra(summed, universe, rcond, universe_key=universe_key, factor_cache=factors)
