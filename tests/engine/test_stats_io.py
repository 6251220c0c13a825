"""Statistics files: the ``rows`` form of low-rank concepts, its expansion, and old files.

A concept with fewer tokens than an input group is wide is stored as its activations ``X``
(float32, exactly what the model produced) instead of ``Σ = XᵀX``. These tests check that the
form is chosen only when it is smaller, that reading it back gives the very sum collection kept
(bit for bit: both sides run :func:`service.engine.linalg.gram` on the same rows), that a worker's
packed expansion holds the same numbers, and that files written before the form existed still read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engram_fixtures.demo import make_facts
from engram_fixtures.models import make_tiny_llama, make_tokenizer
from service.engine.checkpoint import load_model, load_tokenizer
from service.engine.collect import LayerStatistics, collect_statistics
from service.engine.compose import EngramAlgebra, LayerWeights
from service.engine.editable import editable_layers
from service.engine.linalg import gram, pack_symmetric
from service.engine.records import Record, encode_record, make_batches, pad_token_id
from service.engine.stats_io import (
    StatisticsFile,
    expand_statistics,
    load_statistics,
    rows_are_smaller,
    save_statistics,
)

HIDDEN = 32  # groups 32 wide (attention, MLP input, lm_head) and 64 wide (down_proj)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stats-io")
    return make_tiny_llama(root / "llama", hidden=HIDDEN, layers=2, seed=4, tokenizer=make_tokenizer())


def collect(path: Path, n_facts: int) -> LayerStatistics:
    """Statistics of the answers of ``n_facts`` facts (about 5 tokens each)."""
    model, tokenizer = load_model(path), load_tokenizer(path)
    records = [Record(prompt=p, completion=c) for p, c in make_facts(n_facts, seed=9)]
    examples = [encode_record(tokenizer, record, 120) for record in records]
    return collect_statistics(model, make_batches(examples, 4, pad_token_id(tokenizer)), editable_layers(model))


@pytest.fixture(scope="module")
def low_rank(llama: Path) -> LayerStatistics:
    """Between 32 and 64 tokens: the 64-wide down_proj inputs stay rows, the rest are sums."""
    stats = collect(llama, 8)
    assert HIDDEN < stats.tokens <= 2 * HIDDEN, stats.tokens
    return stats


def test_the_rows_form_is_chosen_only_when_it_takes_fewer_bytes() -> None:
    # float64 triangle: D(D+1)/2 · 8 bytes against T · D · 4 bytes of float32 rows.
    assert rows_are_smaller(64, 64, torch.float64)
    assert not rows_are_smaller(65, 64, torch.float64)
    # float32 triangle: half the bytes, so rows must be under (D+1)/2.
    assert rows_are_smaller(32, 64, torch.float32)
    assert not rows_are_smaller(33, 64, torch.float32)
    assert not rows_are_smaller(0, 64, torch.float64), "an empty concept stays a (zero) sum"


def test_low_rank_groups_are_stored_as_rows_and_read_back_bit_for_bit(low_rank: LayerStatistics, tmp_path: Path) -> None:
    path = tmp_path / "stats.safetensors"
    save_statistics(low_rank, path)
    stored = StatisticsFile(path)
    wide = {g for g, s in low_rank.sums.items() if s.shape[0] == 2 * HIDDEN}
    assert wide and stored.has_rows
    assert {g for g, form in stored.forms.items() if form == "rows"} == wide
    with safe_open(str(path), framework="pt") as handle:
        for group in wide:
            rows = handle.get_tensor(group)
            assert rows.dtype == torch.float32 and torch.equal(rows, low_rank.factors[group])
    loaded = load_statistics(path)
    assert loaded.counts == low_rank.counts and loaded.layer_group == low_rank.layer_group
    for group, sigma in low_rank.sums.items():
        assert torch.equal(loaded.sums[group], sigma), group  # float64 storage, same gram: exact
    assert set(loaded.factors) == wide

    # Smaller than the same statistics with every group packed.
    packed = tmp_path / "packed.safetensors"
    save_statistics(LayerStatistics(low_rank.sums, low_rank.counts, low_rank.layer_group), packed)
    assert not StatisticsFile(packed).has_rows
    assert path.stat().st_size < packed.stat().st_size


def test_expansion_gives_packed_float64_sums_and_copies_the_rest(low_rank: LayerStatistics, tmp_path: Path) -> None:
    source, expanded = tmp_path / "rows.safetensors", tmp_path / "expanded.safetensors"
    save_statistics(low_rank, source, extra={"model_digest": "abc"})
    expand_statistics(source, expanded)
    before, after = StatisticsFile(source), StatisticsFile(expanded)
    assert before.has_rows and not after.has_rows
    assert after.metadata["model_digest"] == "abc"
    assert (after.counts, after.layer_group, after.dims) == (before.counts, before.layer_group, before.dims)
    with safe_open(str(source), framework="pt") as old, safe_open(str(expanded), framework="pt") as new:
        for group, form in before.forms.items():
            if form == "packed":  # triangles copied byte for byte
                assert torch.equal(new.get_tensor(group), old.get_tensor(group)), group
            else:  # rows: their float64 sum, exactly what collection kept
                assert new.get_tensor(group).dtype == torch.float64
                assert torch.equal(new.get_tensor(group), pack_symmetric(low_rank.sums[group])), group


def test_an_edit_from_a_rows_file_equals_the_edit_from_memory(
    llama: Path, low_rank: LayerStatistics, tmp_path: Path
) -> None:
    other = collect(llama, 3)
    files = []
    for name, stats in (("target", low_rank), ("other", other)):
        files.append(tmp_path / f"{name}.safetensors")
        save_statistics(stats, files[-1])
    model = load_model(llama)
    modules = dict(model.named_modules())
    in_memory = EngramAlgebra([(-1.0, low_rank)], [low_rank, other])
    from_files = EngramAlgebra([(-1.0, StatisticsFile(files[0]))], [StatisticsFile(f) for f in files])
    for spec in editable_layers(model):
        weights = LayerWeights(modules[spec.name].weight.detach(), None)
        expected = in_memory.engram(spec, weights)
        torch.testing.assert_close(from_files.engram(spec, weights), expected, rtol=1e-12, atol=1e-12)


def test_files_written_before_the_rows_form_still_read(low_rank: LayerStatistics, tmp_path: Path) -> None:
    """engram-stats/1: every group packed float64, no "forms" entry."""
    path = tmp_path / "v1.safetensors"
    tensors = {g: pack_symmetric(s) for g, s in low_rank.sums.items()}
    meta = {
        "format": "engram-stats/1",
        "layer_group": json.dumps(low_rank.layer_group),
        "counts": json.dumps(low_rank.counts),
        "dims": json.dumps({g: int(s.shape[0]) for g, s in low_rank.sums.items()}),
    }
    save_file(tensors, str(path), metadata=meta)
    stored = StatisticsFile(path)
    assert not stored.has_rows
    loaded = load_statistics(path)
    for group, sigma in low_rank.sums.items():
        assert torch.equal(loaded.sums[group], sigma), group


@pytest.mark.parametrize(("tokens", "dim"), [(1000, 300), (50, 700), (3, 257)])
def test_gram_from_the_block_upper_triangle_equals_the_float64_product(tokens: int, dim: int) -> None:
    """Widths that are not a multiple of the block, more and fewer rows than columns: the mirrored
    block triangle is exactly symmetric and within float32-product rounding of XᵀX in float64."""
    rows = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(dim))
    sigma = gram(rows, chunk=128)  # several chunks where there are enough rows
    expected = rows.double().T @ rows.double()
    assert sigma.dtype == torch.float64 and torch.equal(sigma, sigma.T)
    assert float((sigma - expected).norm() / expected.norm()) < 1e-6


def test_a_group_no_token_reached_is_stored_as_no_rows(tmp_path: Path) -> None:
    """An expert that no counted token reached has a zero sum: it is stored as ``[0, D]`` rows (no
    bytes) and reads back as that zero sum; a group with tokens keeps its form."""
    dim = 48
    reached = torch.randn(100, dim, dtype=torch.float64)
    stats = LayerStatistics(
        sums={"idle": torch.zeros(dim, dim, dtype=torch.float64), "busy": reached.T @ reached},
        counts={"idle": 0, "busy": 100},
        layer_group={"experts.0.gate_proj": "idle", "experts.1.gate_proj": "busy"},
    )
    path = tmp_path / "stats.safetensors"
    save_statistics(stats, path)
    stored = StatisticsFile(path)
    assert stored.forms == {"idle": "rows", "busy": "packed"}
    with safe_open(str(path), framework="pt") as handle:
        assert tuple(handle.get_tensor("idle").shape) == (0, dim)
    loaded = load_statistics(path)
    assert torch.equal(loaded.sums["idle"], torch.zeros(dim, dim, dtype=torch.float64))
    assert torch.equal(loaded.sums["busy"], stats.sums["busy"])
    assert loaded.counts == stats.counts
    assert path.stat().st_size < dim * (dim + 1) // 2 * 8 + 4096  # one packed triangle, not two
