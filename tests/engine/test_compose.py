"""Engram arithmetic (``service.engine.compose``) against float64 references and ai-engram.

``W_new = W + Σ_k c_k · f_l · W Σ_k (Σ_universe)⁺`` with ``f_l = 1`` (uniform) or
``f_l = ρ_l / max ρ`` (weight_norm, ``ρ_l = ‖W_l⁺‖_F / ‖W_l‖_F``). Statistics come from
``collect_statistics`` (checked on its own in ``test_collect.py``); the references here redo only
the algebra, in float64, with their own eigendecomposition and cut.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import engram
import pytest
import torch
from torch import nn

from engram_fixtures.demo import make_facts
from engram_fixtures.models import make_tiny_bert, make_tiny_gpt2, make_tiny_llama, make_tokenizer
from service.engine import collect as collect_module
from service.engine import compose as compose_module
from service.engine.checkpoint import CheckpointReader, inspect_model_dir, load_model, load_tokenizer
from service.engine.collect import LayerStatistics
from service.engine.compose import EngramAlgebra, LayerEdit, LayerWeights, layer_edits, layer_scales
from service.engine.layers import LayerSpec, select_layers, unmatched_suffixes
from service.engine.layout import ModelLayout
from service.engine.linalg import default_rcond, pinv_factors
from service.engine.records import Record, encode_record, make_batches, pad_token_id
from service.engine.stats_io import StatisticsFile, save_statistics
from tests.helpers.algebra import DELTA_TOL, WEIGHT_TOL, augmented, canonical, reference_engram, rel

MAX_LENGTH = 120
ALPHA = 0.8
LINEAR_TOL = 1e-6
# Measured: max relative delta difference to ai-engram 5.7e-4 over the 15 layers (median 1e-6
# uniform, 1.3e-4 weight_norm); ai-engram projects in float32 from incrementally averaged means.
ORACLE_TOL = 2e-2


# ------------------------------------------------------------------------------------- fixtures


class Tiny:
    """A tiny checkpoint on disk, its layout, reader, loaded model and tokenizer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.layout: ModelLayout = inspect_model_dir(path)
        self.reader = CheckpointReader(path, self.layout)
        self.model: nn.Module = load_model(path)
        self.tokenizer: Any = load_tokenizer(path)

    def stats(self, records: Sequence[Record], batch_size: int = 16) -> LayerStatistics:
        examples = [encode_record(self.tokenizer, r, MAX_LENGTH) for r in records]
        batches = make_batches(examples, batch_size, pad_token_id(self.tokenizer))
        return collect_module.collect_statistics(self.model, batches, self.layout.layers)

    def weights64(self, spec: LayerSpec) -> LayerWeights:
        """The checkpoint weights in float64, so an edit's result is not rounded to float32."""
        w = self.reader.layer_weights(spec)
        return LayerWeights(w.weight.double(), None if w.bias is None else w.bias.double())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tiny]:
    root = tmp_path_factory.mktemp("compose-models")
    tokenizer = make_tokenizer()
    return {
        "llama": Tiny(make_tiny_llama(root / "llama", hidden=32, layers=2, seed=0, tokenizer=tokenizer)),
        "gpt2": Tiny(make_tiny_gpt2(root / "gpt2", hidden=32, layers=2, seed=0, tokenizer=tokenizer)),
        "bert": Tiny(make_tiny_bert(root / "bert", hidden=32, layers=2, seed=0)),
    }


def text_records(start: int, stop: int, seed: int = 11) -> list[Record]:
    return [Record(text=p + c) for p, c in make_facts(200, seed=seed)[start:stop]]


@pytest.fixture(scope="module")
def forget_retain(tiny: dict[str, Tiny]) -> dict[str, tuple[LayerStatistics, LayerStatistics]]:
    """~1,500 forget and ~3,000 retain tokens per model: 30-140x the layer widths."""
    forget, retain = text_records(0, 40), text_records(40, 120)
    return {arch: (t.stats(forget), t.stats(retain)) for arch, t in tiny.items()}


# ------------------------------------------------------------------------------------- references


def edits_by_name(
    layers: Sequence[LayerSpec], algebra: EngramAlgebra, load: Any, scaling: str = "uniform"
) -> dict[str, LayerEdit]:
    scales = layer_scales(layers, algebra, load, scaling)  # type: ignore[arg-type]
    return {e.spec.name: e for e in layer_edits(layers, algebra, load, scales)}


# ------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("scaling", ["uniform", "weight_norm"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_edit_equals_float64_reference(
    tiny: dict[str, Tiny],
    forget_retain: dict[str, tuple[LayerStatistics, LayerStatistics]],
    arch: str,
    scaling: str,
) -> None:
    t = tiny[arch]
    forget, retain = forget_retain[arch]
    layers = t.layout.layers
    algebra = EngramAlgebra(terms=[(-ALPHA, forget)], universe=[forget, retain])
    edits = edits_by_name(layers, algebra, t.reader.layer_weights, scaling)
    assert set(edits) == {spec.name for spec in layers}

    engrams, rho = {}, {}
    for spec in layers:
        weights = t.reader.layer_weights(spec)
        engrams[spec.name] = reference_engram(
            spec, weights, forget.sum_for(spec.name), forget.sum_for(spec.name) + retain.sum_for(spec.name)
        )
        rho[spec.name] = float(engrams[spec.name][:, : spec.in_features].norm() / weights.weight.double().norm())
    top = max(rho.values())
    for spec in layers:
        weights = t.reader.layer_weights(spec)
        f = 1.0 if scaling == "uniform" else rho[spec.name] / top
        edit = edits[spec.name]
        assert edit.weight.dtype == weights.weight.dtype and edit.weight.shape == weights.weight.shape
        assert (edit.bias is not None) == spec.bias
        assert edit.scale == pytest.approx(f, rel=1e-9)
        old = augmented(spec, weights)
        expected = old - ALPHA * f * engrams[spec.name]
        assert rel(canonical(edit), expected) < WEIGHT_TOL, spec.name
        assert rel(canonical(edit) - old, expected - old) < DELTA_TOL, spec.name
    if scaling == "weight_norm":
        assert max(e.scale for e in edits.values()) == pytest.approx(1.0, rel=1e-12)
        assert min(e.scale for e in edits.values()) < 0.9, "the schedule is not flat"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_statistics_give_the_same_engrams(
    tiny: dict[str, Tiny], forget_retain: dict[str, tuple[LayerStatistics, LayerStatistics]], arch: str, tmp_path: Path
) -> None:
    """Packed sums read per group from disk (as workers read them) are combined packed and unpacked
    once, alone or mixed with full in-memory sums: the same engrams."""
    forget, retain = forget_retain[arch]
    files = {}
    for name, stats in (("forget", forget), ("retain", retain)):
        files[name] = tmp_path / f"{name}.safetensors"
        save_statistics(stats, files[name])
    lazy = {name: StatisticsFile(f) for name, f in files.items()}
    assert all(lazy["forget"].sums[g].ndim == 1 for g in lazy["forget"].sums)
    assert lazy["forget"].layer_group == forget.layer_group and lazy["forget"].tokens == forget.tokens
    full = EngramAlgebra(terms=[(-0.7, forget), (0.2, retain)], universe=[forget, retain])
    on_disk = EngramAlgebra(terms=[(-0.7, lazy["forget"]), (0.2, lazy["retain"])], universe=list(lazy.values()))
    mixed = EngramAlgebra(terms=[(-0.7, lazy["forget"]), (0.2, retain)], universe=[forget, lazy["retain"]])
    for spec in tiny[arch].layout.layers:
        weights = tiny[arch].weights64(spec)
        expected = full.engram(spec, weights)
        assert rel(on_disk.engram(spec, weights), expected) < 1e-12, spec.name
        assert rel(mixed.engram(spec, weights), expected) < 1e-12, spec.name


GPU = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))


@pytest.mark.parametrize(
    ("explicit", "order"),
    [(False, "weight_first"), (False, "mixed_basis"), (False, "projector"), (True, "weight_first"), (True, "projector")],
)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("device", ["cpu", GPU])
def test_every_product_order_gives_the_same_engram(
    tiny: dict[str, Tiny],
    forget_retain: dict[str, tuple[LayerStatistics, LayerStatistics]],
    arch: str,
    explicit: bool,
    order: str,
    device: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The group-level orderings, with Σ⁺ factored or explicit, are rearrangements of one
    product: equal to the float64 reference, on the CPU and (float64) on a GPU."""
    forget, retain = forget_retain[arch]
    monkeypatch.setattr(compose_module, "product_order", lambda *_: order)
    forced = functools.partial(compose_module.pinv_factors, explicit=explicit)
    monkeypatch.setattr(compose_module, "pinv_factors", forced)
    algebra = EngramAlgebra(terms=[(-ALPHA, forget)], universe=[forget, retain], device=device)
    for spec in tiny[arch].layout.layers:
        weights = tiny[arch].weights64(spec)
        universe = forget.sum_for(spec.name) + retain.sum_for(spec.name)
        expected = -ALPHA * reference_engram(spec, weights, forget.sum_for(spec.name), universe)
        engram = algebra.engram(spec, weights)
        assert engram.device.type == "cpu"
        assert rel(engram, expected) < 1e-10, (spec.name, order)


def test_product_order_follows_the_multiply_add_counts() -> None:
    # The bench's ~100M Llama (hidden 768, MLP 2048, vocab 8000), universe rank k at full width.
    assert compose_module.product_order(3 * 768, 768, 768) == "projector"  # q/k/v
    assert compose_module.product_order(2 * 2048, 768, 768) == "projector"  # gate/up
    assert compose_module.product_order(8000, 768, 768) == "projector"  # lm_head
    assert compose_module.product_order(768, 768, 768) == "weight_first"  # o_proj: a tie keeps the plain order
    assert compose_module.product_order(768, 2048, 2048) == "weight_first"  # down_proj: narrow output, wide input
    assert compose_module.product_order(768, 2048, 300) == "mixed_basis"  # down_proj, small universe
    # Σ⁺ explicit (more than half the directions kept): (W·M)·Σ⁺ for one narrow layer, M·Σ⁺ first
    # for a group with more outputs than inputs.
    assert compose_module.product_order(768, 2048, 2048, explicit=True) == "weight_first"  # down_proj
    assert compose_module.product_order(768, 768, 768, explicit=True) == "weight_first"  # o_proj: a tie
    assert compose_module.product_order(3 * 768, 768, 768, explicit=True) == "projector"  # q/k/v


def test_pinv_is_explicit_when_most_directions_are_kept() -> None:
    """Same pseudo-inverse either way; the explicit [D, D] form only above half the rank."""
    gen = torch.Generator().manual_seed(3)
    for rank, explicit in ((12, True), (5, False)):
        x = torch.randn(rank, 16, generator=gen, dtype=torch.float64)
        sigma = x.T @ x
        factors = pinv_factors(sigma)
        assert factors.rank == rank and factors.explicit is explicit
        eye = torch.eye(16, dtype=torch.float64)
        assert rel(factors.apply_right(eye), torch.linalg.pinv(sigma, hermitian=True)) < 1e-9
        assert factors.nbytes == 8 * (rank + (16 * 16 if explicit else 16 * rank))


def test_llama_case_is_well_conditioned(
    tiny: dict[str, Tiny], forget_retain: dict[str, tuple[LayerStatistics, LayerStatistics]]
) -> None:
    """No eigenvalue of a Llama universe covariance sits within 20% of the cut, so the reference
    above does not depend on rounding; the default cut is D · eps32 and keeps almost everything."""
    forget, retain = forget_retain["llama"]
    for group, sigma in forget.sums.items():
        total = sigma + retain.sums[group]
        lam = torch.linalg.eigvalsh(total)
        ratio = lam / (default_rcond(total.shape[0]) * lam.max())
        assert bool(((ratio > 1.2) | (ratio < 1 / 1.2)).all()), group
        assert int((ratio > 1).sum()) >= total.shape[0] - 1, group
        assert forget.tokens + retain.tokens > 50 * total.shape[0]


# ------------------------------------------------------------------------------------- linearity


def test_any_subset_is_the_sum_of_its_members(tiny: dict[str, Tiny], monkeypatch: pytest.MonkeyPatch) -> None:
    t = tiny["llama"]
    calls: list[int] = []
    real_collect = collect_module.collect_statistics

    def counting_collect(*args: Any, **kwargs: Any) -> LayerStatistics:
        calls.append(1)
        return real_collect(*args, **kwargs)

    monkeypatch.setattr(collect_module, "collect_statistics", counting_collect)
    concepts = {name: t.stats(text_records(i * 25, (i + 1) * 25, seed=21)) for i, name in enumerate("abcr")}
    targets, universe = ["a", "b", "c"], list(concepts.values())

    def no_forward(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("a composition ran the model")

    monkeypatch.setattr(t.model, "forward", no_forward)
    layers = t.layout.layers
    single = {k: EngramAlgebra([(1.0, concepts[k])], universe) for k in targets}
    engrams = {(k, s.name): single[k].engram(s, t.weights64(s)) for k in targets for s in layers}
    subsets = [c for n in (1, 2, 3) for c in itertools.combinations(targets, n)]
    assert len(subsets) == 7
    for subset in subsets:
        algebra = EngramAlgebra([(-ALPHA, concepts[k]) for k in subset], universe)
        edits = edits_by_name(layers, algebra, t.weights64)
        for spec in layers:
            old = augmented(spec, t.weights64(spec))
            expected = -ALPHA * sum(engrams[(k, spec.name)] for k in subset)
            assert isinstance(expected, torch.Tensor)
            err = rel(canonical(edits[spec.name]) - old, expected)
            assert err < LINEAR_TOL, f"{subset} {spec.name}: {err:.2e}"
    assert len(calls) == 4, "every subset was composed from the 4 cached statistics"


def test_adding_an_engram_back_inverts_removing_it(
    tiny: dict[str, Tiny], forget_retain: dict[str, tuple[LayerStatistics, LayerStatistics]]
) -> None:
    """Engram arithmetic with a positive coefficient is the exact opposite edit (paper §5.3)."""
    t = tiny["gpt2"]
    forget, retain = forget_retain["gpt2"]
    layers = t.layout.layers
    removed = edits_by_name(layers, EngramAlgebra([(-1.0, forget)], [forget, retain]), t.weights64)
    added = edits_by_name(layers, EngramAlgebra([(1.0, forget)], [forget, retain]), t.weights64)
    for spec in layers:
        old = augmented(spec, t.weights64(spec))
        down, up = canonical(removed[spec.name]) - old, canonical(added[spec.name]) - old
        assert rel(-down, up) < 1e-12, spec.name


# ------------------------------------------------------------------------------------- ai-engram


@pytest.fixture(scope="module")
def oracle_case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An untied tiny Llama, prompt/completion facts, and ai-engram's engram for them."""
    path = make_tiny_llama(tmp_path_factory.mktemp("oracle") / "llama", hidden=32, layers=2, seed=4)
    t = Tiny(path)
    facts = make_facts(90, seed=3)
    forget, retain = facts[:30], facts[30:]
    ours = (
        t.stats([Record(prompt=p, completion=c) for p, c in forget], batch_size=8),
        t.stats([Record(prompt=p, completion=c) for p, c in retain], batch_size=8),
    )
    result = engram.get_engram(t.model, t.tokenizer, forget=forget, total=forget + retain, max_length=MAX_LENGTH)
    return {"tiny": t, "ours": ours, "engram": result}


def oracle_deltas(case: dict[str, Any], scale: Any, scaling: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """layer -> (our weight delta, ai-engram's weight delta), float64, at alpha 1."""
    t: Tiny = case["tiny"]
    forget, retain = case["ours"]
    edited = engram.apply_engram(t.model, case["engram"], alpha=1.0, scale=scale)
    theirs = dict(edited.named_parameters())
    algebra = EngramAlgebra([(-1.0, forget)], [forget, retain])
    ours = edits_by_name(t.layout.layers, algebra, t.reader.layer_weights, scaling)
    out = {}
    for spec in t.layout.layers:
        old = t.reader.layer_weights(spec).weight.double()
        new = theirs[f"{spec.name}.weight"].detach().double()
        out[spec.name] = (ours[spec.name].weight.double() - old, new - old)
    return out


def test_uniform_matches_ai_engram_count_ratio(oracle_case: dict[str, Any]) -> None:
    deltas = oracle_deltas(oracle_case, None, "uniform")  # ai-engram's default scale is count_ratio(1)
    assert len(deltas) == 15, "7 projections x 2 blocks + lm_head"
    errors = {name: rel(ours, theirs) for name, (ours, theirs) in deltas.items()}
    assert max(errors.values()) < ORACLE_TOL, errors
    assert all(float(theirs.norm()) > 0 for _, theirs in deltas.values())


def test_weight_norm_matches_ai_engram_count_ratio_times_weight_norm(oracle_case: dict[str, Any]) -> None:
    scale = engram.compose(engram.count_ratio(1.0), engram.weight_norm(1.0))
    deltas = oracle_deltas(oracle_case, scale, "weight_norm")
    errors = {name: rel(ours, theirs) for name, (ours, theirs) in deltas.items()}
    assert max(errors.values()) < ORACLE_TOL, errors


def test_oracle_counts_and_covariances_agree(oracle_case: dict[str, Any]) -> None:
    """Our summed Σ is ai-engram's mean covariance times its count (the count_ratio equivalence)."""
    forget, retain = oracle_case["ours"]
    infos = oracle_case["engram"].layers
    for name, info in infos.items():
        assert info.n == forget.counts[forget.layer_group[name]]
        assert info.N == info.n + retain.counts[retain.layer_group[name]]


# ------------------------------------------------------------------------------------- rcond


def test_larger_rcond_keeps_fewer_directions() -> None:
    gen = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(16, 16, generator=gen, dtype=torch.float64))
    lam = torch.tensor([10.0**-k for k in range(8)] * 2, dtype=torch.float64)  # 1 ... 1e-7, twice
    sigma = (basis * lam) @ basis.T
    # Cuts between the decades, so no eigenvalue sits on one.
    ranks = [pinv_factors(sigma, rc).rank for rc in (0.0, 3e-7, 3e-5, 3e-3, 0.5)]
    assert ranks == [16, 14, 10, 6, 2]  # strictly fewer, and exactly the eigenvalues above the cut
    assert pinv_factors(sigma).rank == 12, "default cut 16 * eps32 = 1.9e-6 drops 1e-6 and 1e-7"
    factors = pinv_factors(sigma, 3e-5)
    kept = basis[:, lam > 3e-5]
    expected = (kept / lam[lam > 3e-5]) @ kept.T
    eye = torch.eye(16, dtype=torch.float64)
    assert rel(factors.apply_right(eye), expected) < 1e-9


def test_rcond_on_collected_statistics(
    tiny: dict[str, Tiny], forget_retain: dict[str, tuple[LayerStatistics, LayerStatistics]]
) -> None:
    t = tiny["gpt2"]
    forget, retain = forget_retain["gpt2"]
    spec = t.layout.layer("transformer.h.0.mlp.c_proj")
    ranks = [
        EngramAlgebra([(-1.0, forget)], [forget, retain], rcond=rc).factors(spec.name).rank
        for rc in (None, 1e-4, 1e-2, 1e-1)
    ]
    assert all(a > b for a, b in itertools.pairwise(ranks)), ranks
    assert ranks[0] <= spec.stat_dim


def test_zero_sigma_has_rank_zero_and_a_zero_engram() -> None:
    zero = torch.zeros(8, 8, dtype=torch.float64)
    factors = pinv_factors(zero)
    assert factors.rank == 0
    assert torch.equal(factors.apply_right(torch.ones(3, 8, dtype=torch.float64)), torch.zeros(3, 8))
    spec = LayerSpec("blocks.0.fc", 8, 3, False, False, 0)
    stats = LayerStatistics({"g": zero}, {"g": 0}, {"blocks.0.fc": "g"})
    weights = LayerWeights(torch.randn(3, 8, generator=torch.Generator().manual_seed(1)), None)
    edit = next(iter(layer_edits([spec], EngramAlgebra([(-1.0, stats)], [stats]), lambda _s: weights, {spec.name: 1.0})))
    assert torch.equal(edit.weight, weights.weight), "no data, no edit (and no NaN)"


@pytest.mark.parametrize("rcond", [-0.1, 1.0, 2.0])
def test_rcond_outside_unit_interval_is_rejected(rcond: float) -> None:
    with pytest.raises(ValueError, match="rcond"):
        pinv_factors(torch.eye(4), rcond)


# ------------------------------------------------------------------------------------- selection


def test_select_layers_by_module_suffix_and_block(tiny: dict[str, Tiny]) -> None:
    layers = tiny["llama"].layout.layers
    names = lambda specs: [s.name for s in specs]  # noqa: E731
    assert names(select_layers(layers, modules=["q_proj", "down_proj"])) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
    ]
    block1 = select_layers(layers, blocks=[1])
    assert len(block1) == 7 and all(s.block == 1 for s in block1), "lm_head has no block and is dropped"
    assert names(select_layers(layers, modules=["v_proj"], blocks=[1])) == ["model.layers.1.self_attn.v_proj"]
    assert names(select_layers(layers, modules=["lm_head"])) == ["lm_head"]
    assert names(select_layers(layers, modules=["model.layers.0.mlp.up_proj"])) == ["model.layers.0.mlp.up_proj"]
    assert select_layers(layers, modules=["proj"]) == [], "suffixes match whole name segments"
    assert select_layers(layers) == layers
    assert unmatched_suffixes(layers, ["q_proj", "qproj", "proj", "lm_head"]) == ["qproj", "proj"]


def test_edits_cover_only_the_selection(
    tiny: dict[str, Tiny], forget_retain: dict[str, tuple[LayerStatistics, LayerStatistics]]
) -> None:
    t = tiny["llama"]
    forget, retain = forget_retain["llama"]
    chosen = select_layers(t.layout.layers, modules=["o_proj", "down_proj"], blocks=[0])
    algebra = EngramAlgebra([(-1.0, forget)], [forget, retain])
    edits = edits_by_name(chosen, algebra, t.reader.layer_weights, "weight_norm")
    assert set(edits) == {"model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"}
    # The W-Norm schedule is normalised over the selection, not over the whole model.
    assert max(e.scale for e in edits.values()) == pytest.approx(1.0, rel=1e-12)


def test_a_shared_factor_cache_decomposes_each_group_once_per_universe(
    tiny: dict[str, Tiny], forget_retain: dict[str, tuple[LayerStatistics, LayerStatistics]], monkeypatch: pytest.MonkeyPatch
) -> None:
    t = tiny["llama"]
    forget, retain = forget_retain["llama"]
    calls: list[int] = []
    real = compose_module.pinv_factors

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(compose_module, "pinv_factors", counting)
    cache: dict[Any, Any] = {}
    for coefficient in (-1.0, -0.5, 2.0):  # three variants of the same universe
        algebra = EngramAlgebra([(coefficient, forget)], [forget, retain], universe_key="u1", factor_cache=cache)
        for spec in t.layout.layers:
            algebra.engram(spec, t.weights64(spec))
    assert len(calls) == len(set(forget.layer_group.values())), "one eigendecomposition per input group"
    other = EngramAlgebra([(-1.0, forget)], [forget, retain], rcond=1e-3, universe_key="u1", factor_cache=cache)
    other.engram(t.layout.layers[0], t.weights64(t.layout.layers[0]))
    assert len(calls) == len(set(forget.layer_group.values())) + 1, "another rcond is another decomposition"
