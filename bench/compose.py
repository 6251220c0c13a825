"""Variants from statistics, the safetensors copy floor, and ai-engram's recompute.

``compose_variant`` is the statistics path (``service.engrams.store.statistics_algebra``): read
the statistics files, build the :class:`EngramAlgebra` (with the worker's factor cache), compute the
per-layer scales, and write the checkpoint directory shard by shard with ``write_checkpoint``. It is
what variants did before universes were stored, and what the memory-trace maps still do; variants of
a built universe are arithmetic on its stored engrams, measured by :mod:`bench.universe`.
"""

from __future__ import annotations

import hashlib
import inspect
import shutil
import time
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from service.engine.checkpoint import CheckpointReader
from service.engine.checkpoint_write import write_checkpoint
from service.engine.collect import LayerStatistics
from service.engine.compose import EngramAlgebra, layer_editor, layer_scales
from service.engine.layers import select_layers
from service.engine.layout import ModelLayout
from service.engine.model_files import weight_files
from service.engine.stats_io import StatisticsFile


def service_caches() -> tuple[MutableMapping[Any, Any], MutableMapping[Any, Any]] | None:
    """Caches sized as a worker's (its Context's ``caches.stats_files`` and ``caches.factors``,
    :class:`service.context.ProcessCaches`): statistics by storage key, universe pseudo-inverse
    factors by universe."""
    from service.config import Settings
    from service.context import STATS_FILE_ENTRIES
    from service.storage.lru import ByteLRU

    factors: ByteLRU[Any] = ByteLRU(Settings().factor_cache_bytes, lambda f: int(f.nbytes))
    return ByteLRU(STATS_FILE_ENTRIES, lambda _: 1), factors


def clear_caches(caches: tuple[MutableMapping[Any, Any], MutableMapping[Any, Any]] | None) -> None:
    """A fresh worker: nothing loaded, nothing decomposed."""
    for cache in caches or ():
        cache.clear()


def compose_variant(
    model_dir: Path,
    layout: ModelLayout,
    term_files: Sequence[Path],
    universe_files: Sequence[Path],
    out_dir: Path,
    *,
    coefficient: float = -1.0,
    scaling: str = "uniform",
    caches: tuple[MutableMapping[Any, Any], MutableMapping[Any, Any]] | None = None,
) -> dict[str, float]:
    """Build one checkpoint variant from statistics files; returns the seconds of each phase.

    Mirrors ``run_variant``/``_algebra``/``_write_variant`` (format ``checkpoint``, every layer
    selected, default ``rcond``). With ``caches`` (sized as the worker's)
    it reuses what earlier variants loaded and decomposed, keyed as the service keys them (a file
    stands for a storage key, the sorted universe for ``universe_key``); without, each file is
    loaded once and each input group decomposed once for this variant only.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    stats_cache, factor_cache = caches if caches is not None else ({}, {})
    t0 = time.perf_counter()

    def stats(file: Path) -> StatisticsFile:
        cached = stats_cache.get(str(file))
        if cached is None:
            cached = stats_cache[str(file)] = StatisticsFile(file)  # as the worker reads them: per group
        return cached

    terms = [(coefficient, stats(f)) for f in term_files]
    universe = [stats(f) for f in universe_files]
    t1 = time.perf_counter()
    extra: dict[str, Any] = {}
    if "factor_cache" in inspect.signature(EngramAlgebra).parameters:
        extra = {"universe_key": "|".join(sorted(map(str, universe_files))), "factor_cache": factor_cache}
    algebra = EngramAlgebra(terms, universe, None, **extra)
    reader = CheckpointReader(model_dir, layout)
    layers = select_layers(layout.layers, None, None)
    scales = layer_scales(layers, algebra, reader.layer_weights, scaling)  # type: ignore[arg-type]
    t2 = time.perf_counter()
    edited = {name for name, scale in scales.items() if scale != 0.0}
    write_checkpoint(model_dir, out_dir, layout, layer_editor(algebra, reader.layer_weights, scales), edited)
    t3 = time.perf_counter()
    return {"load_stats_s": t1 - t0, "scales_s": t2 - t1, "edit_and_write_s": t3 - t2, "total_s": t3 - t0}


def _copy_shards(model_dir: Path, out_dir: Path) -> list[str]:
    """``load_file`` + ``save_file`` of every shard of ``model_dir`` into ``out_dir``; the shards."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = list(weight_files(model_dir))
    for shard in shards:
        tensors = load_file(str(model_dir / shard))
        save_file(tensors, str(out_dir / shard), metadata={"format": "pt"})
        del tensors
    return shards


def copy_floor(model_dir: Path, out_dir: Path) -> float:
    """Seconds to ``load_file`` + ``save_file`` every shard of the unchanged checkpoint."""
    start = time.perf_counter()
    _copy_shards(model_dir, out_dir)
    return time.perf_counter() - start


def variant_floor(files_dir: Path, out_dir: Path) -> float:
    """Seconds to ``load_file`` + ``save_file`` every shard of a *variant's* files, then sha256 them.

    The fair floor of a checkpoint variant: its own bytes (a tied head edited is untied, so the
    Llama-3.2-1B-shaped slice's variant is 1.26 GB where the model is 0.73 GB) copied, and hashed
    as a variant's manifest needs. Hashing after the copy is the floor on a machine with no spare
    core; with one, the job overlaps the two.
    """
    start = time.perf_counter()
    for shard in _copy_shards(files_dir, out_dir):
        digest = hashlib.sha256()
        with (out_dir / shard).open("rb", buffering=0) as handle:
            while chunk := handle.read(16 << 20):
                digest.update(chunk)
    return time.perf_counter() - start


def clear(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- ai-engram


def to_ai_statistics(stats: LayerStatistics) -> Any:
    """The engine's sums as ai-engram ``Statistics`` (float32 means + counts).

    Layers of one input group share one tensor, as ai-engram's own ``dedupe()`` leaves them after
    collection, so its factor cache can reuse one eigendecomposition per group.
    """
    from engram import Statistics

    means = {g: (s / max(stats.counts[g], 1)).to(torch.float32) for g, s in stats.sums.items()}
    cov = {layer: means[g] for layer, g in stats.layer_group.items()}
    count = {layer: int(stats.counts[g]) for layer, g in stats.layer_group.items()}
    return Statistics(cov, count)


def ai_engram_total(all_stats: Sequence[Any]) -> Any:
    """ai-engram's universe: the count-weighted merge of every concept, deduplicated so q/k/v
    and gate/up share one matrix again (its best case: one eigendecomposition per group)."""
    from engram import Statistics

    return Statistics.merge(*all_stats).dedupe()


def ai_engram_recompute(model: Any, tokenizer: Any, targets: Sequence[Any], total: Any, out_dir: Path) -> dict[str, float]:
    """ai-engram's way to a variant, timed: ``compute_engram_weights`` (which merges the target
    list) + ``apply`` (``alpha=1``, default ``count_ratio`` scale = the service's ``uniform``,
    ``inplace=True``: no model copy) + ``save_pretrained`` (+ the tokenizer files).

    The model is already in memory and ``total`` precomputed; the caller restores the weights.
    """
    from engram import EngramEditor

    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    editor = EngramEditor(model)
    engram = editor.compute_engram_weights(list(targets), total)
    t1 = time.perf_counter()
    editor.apply(engram, alpha=1.0, inplace=True)
    del engram
    t2 = time.perf_counter()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    t3 = time.perf_counter()
    return {"compute_engram_weights_s": t1 - t0, "apply_s": t2 - t1, "save_s": t3 - t2, "total_s": t3 - t0}
