"""Which layers published statistics hold (``service.statistics.cover.statistics_layers``), new and legacy manifests."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from engram_fixtures.models import make_tiny_bert_encoder
from service.config import Settings
from service.context import ProcessCaches
from service.engine.checkpoint import inspect_model_dir
from service.engine.collect import LayerStatistics
from service.engine.stats_io import save_statistics
from service.statistics.cover import statistics_layers
from service.statistics.key import statistics_key
from service.statistics.manifest import StatisticsManifest
from service.storage.local import LocalStorage


def _stored_without_the_pooler(tmp_path: Path, names: list[str]) -> tuple[SimpleNamespace, str]:
    """A store holding statistics of ``names`` (every layer but BERT's pooler), and their prefix."""
    stats = LayerStatistics(
        sums={n: torch.eye(33, dtype=torch.float64) for n in names},
        counts=dict.fromkeys(names, 40),
        layer_group={n: n for n in names},
    )
    storage = LocalStorage(tmp_path / "store")
    prefix = "stats/m/d/s/"
    save_statistics(stats, tmp_path / "stats.safetensors")
    storage.put_file(statistics_key(prefix), tmp_path / "stats.safetensors")
    return SimpleNamespace(storage=storage, caches=ProcessCaches.from_settings(Settings())), prefix


def test_legacy_statistics_without_the_pooler_are_read_from_their_header(tmp_path: Path) -> None:
    """Statistics published before per-record layers were collected hold no pooler and their
    manifest has no ``lacking``: the layers come from the file's header, so an edit names the pooler."""
    layout = inspect_model_dir(make_tiny_bert_encoder(tmp_path / "bert"))
    names = [spec.name for spec in layout.layers if spec.name != "pooler.dense"]
    ctx, prefix = _stored_without_the_pooler(tmp_path, names)
    legacy = StatisticsManifest(tokens=40, layers=len(names), settings={"max_length": 512})
    assert statistics_layers(ctx, prefix, legacy, layout) == frozenset(names)
    # New manifests say it themselves (no file read): modules selected, minus the lacking ones.
    current = StatisticsManifest(
        tokens=40, layers=3, lacking=("encoder.layer.0.attention.self.key",), settings={"modules": ["key", "query"]}
    )
    assert statistics_layers(ctx, "stats/none/", current, layout) == {
        "encoder.layer.0.attention.self.query",
        "encoder.layer.1.attention.self.query",
        "encoder.layer.1.attention.self.key",
    }


def test_statistics_of_a_layout_with_fewer_layers_are_read_from_their_header(tmp_path: Path) -> None:
    """Statistics share their key with those a version that listed fewer layers collected (GPT-NeoX's
    head, stored as ``embed_out``, was left out before): their manifest counts fewer layers than
    today's layout selects, so the file's header decides, and an edit that needs the head is refused
    by name instead of leaving it unedited."""
    layout = inspect_model_dir(make_tiny_bert_encoder(tmp_path / "bert"))
    names = [spec.name for spec in layout.layers if spec.name != "pooler.dense"]
    ctx, prefix = _stored_without_the_pooler(tmp_path, names)
    older_layout = StatisticsManifest(tokens=40, layers=len(names), lacking=(), settings={"max_length": 512})
    held = statistics_layers(ctx, prefix, older_layout, layout)
    assert held == frozenset(names)
    assert "pooler.dense" not in held


def test_two_stores_in_one_process_read_their_own_headers(tmp_path: Path) -> None:
    """The header cache keys by store as well as prefix: the same prefix in two stores (two test
    worlds, or two contexts) may hold other layers, and each context reads its own (a cache keyed by
    the prefix alone answered the second store with the first store's layers)."""
    layout = inspect_model_dir(make_tiny_bert_encoder(tmp_path / "bert"))
    every = [spec.name for spec in layout.layers]
    legacy = StatisticsManifest(tokens=40, layers=1, settings={"max_length": 512})  # no "lacking": the header decides
    one, prefix = _stored_without_the_pooler(tmp_path / "one", every[:2])
    two, same = _stored_without_the_pooler(tmp_path / "two", every[2:5])
    assert prefix == same
    assert statistics_layers(one, prefix, legacy, layout) == frozenset(every[:2])
    assert statistics_layers(two, prefix, legacy, layout) == frozenset(every[2:5])
