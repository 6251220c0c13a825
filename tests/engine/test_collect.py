"""Covariance collection (``service.engine.collect``) against an independent float64 reference.

The reference runs a float64 copy of the model over each record alone (batch size 1, no padding),
captures every editable layer's input with a plain forward hook and sums ``x xᵀ`` over the counted
tokens, appending the bias column itself. Its token masks come from the tokenizer directly, not
from ``service.engine.records``, so a wrong mask in the engine cannot hide in the reference.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engram_fixtures.demo import make_facts
from engram_fixtures.models import make_tiny_bert, make_tiny_bert_encoder, make_tiny_gpt2, make_tiny_llama, make_tokenizer
from service.engine.checkpoint import load_model, load_tokenizer
from service.engine.collect import LayerStatistics, collect_statistics
from service.engine.editable import editable_layers
from service.engine.records import Record, encode_record, make_batches, pad_token_id
from tests.helpers.collection import MAX_LENGTH, collect, mixed_records, rel_error

REL_TOL = 1e-5  # float32 forward + float32 GEMM per batch vs an all-float64 reference


# ------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("collect-models")
    tokenizer = make_tokenizer()
    return {
        "llama": make_tiny_llama(root / "llama", hidden=32, layers=2, seed=1, tokenizer=tokenizer),
        "gpt2": make_tiny_gpt2(root / "gpt2", hidden=32, layers=2, seed=2, tokenizer=tokenizer),
        "bert": make_tiny_bert(root / "bert", hidden=32, layers=2, seed=3),
        "bert_pooler": make_tiny_bert_encoder(root / "bert-pooler", hidden=32, layers=2, seed=4),
    }


@pytest.fixture(scope="module")
def loaded(model_dirs: dict[str, Path]) -> dict[str, tuple[nn.Module, Any]]:
    torch.manual_seed(0)
    return {arch: (load_model(path), load_tokenizer(path)) for arch, path in model_dirs.items()}


# ------------------------------------------------------------------------------------- helpers


def reference_tokens(tokenizer: Any, record: Record) -> tuple[list[int], list[bool]]:
    """Token ids and counted mask, straight from the tokenizer (prompt with specials, answer without)."""
    if record.text is not None:
        ids = list(tokenizer(record.text, add_special_tokens=True)["input_ids"])
        return ids, [True] * len(ids)
    prompt = list(tokenizer(record.prompt, add_special_tokens=True)["input_ids"])
    answer = list(tokenizer(record.completion, add_special_tokens=False)["input_ids"])
    return prompt + answer, [False] * len(prompt) + [True] * len(answer)


def reference_statistics(model: nn.Module, tokenizer: Any, records: Sequence[Record]) -> tuple[dict[str, torch.Tensor], int]:
    """Per-layer float64 ``Σ x xᵀ`` (bias column appended) and the counted-token total."""
    sums, tokens, _counts = reference_with_counts(model, tokenizer, records)
    return sums, tokens


def reference_with_counts(
    model: nn.Module, tokenizer: Any, records: Sequence[Record]
) -> tuple[dict[str, torch.Tensor], int, dict[str, int]]:
    """:func:`reference_statistics` plus each layer's count of rows. A layer that reads one row
    per sequence (a pooler) sums that row of every record with a counted token, once."""
    ref = copy.deepcopy(model).to(torch.float64).eval()
    modules = dict(ref.named_modules())
    specs = editable_layers(ref)
    captured: dict[str, torch.Tensor] = {}
    handles = [
        modules[spec.name].register_forward_hook(
            lambda _m, args, _out, name=spec.name: captured.__setitem__(name, args[0].detach())
        )
        for spec in specs
    ]
    sums = {spec.name: torch.zeros(spec.stat_dim, spec.stat_dim, dtype=torch.float64) for spec in specs}
    counts = dict.fromkeys(sums, 0)
    tokens = 0
    try:
        with torch.no_grad():
            for record in records:
                ids, counted = reference_tokens(tokenizer, record)
                assert len(ids) <= MAX_LENGTH, "a test record would be truncated"
                mask = torch.tensor(counted)
                tokens += int(mask.sum())
                ref(input_ids=torch.tensor([ids]))
                for spec in specs:
                    rows = captured[spec.name].reshape(-1, spec.in_features)
                    x = rows[mask] if rows.shape[0] == len(ids) else rows[: 1 if any(counted) else 0]
                    if spec.bias:
                        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
                    sums[spec.name] += x.T @ x
                    counts[spec.name] += x.shape[0]
    finally:
        for handle in handles:
            handle.remove()
    return sums, tokens, counts


def assert_matches_reference(
    stats: LayerStatistics, reference: dict[str, torch.Tensor], tokens: int, counts: dict[str, int] | None = None
) -> None:
    assert set(stats.layer_group) == set(reference), "every editable layer has statistics"
    assert stats.lacking == []
    for name, expected in reference.items():
        actual = stats.sum_for(name)
        assert actual.dtype == torch.float64
        assert actual.shape == expected.shape, name
        err = rel_error(actual, expected)
        assert err < REL_TOL, f"{name}: relative error {err:.2e} >= {REL_TOL}"
        assert stats.counts[stats.layer_group[name]] == (tokens if counts is None else counts[name]), name
    assert stats.tokens == tokens


# ------------------------------------------------------------------------------------- tests


def test_llama_statistics_equal_float64_reference(loaded: dict[str, tuple[nn.Module, Any]]) -> None:
    model, tokenizer = loaded["llama"]
    records = mixed_records()
    reference, tokens = reference_statistics(model, tokenizer, records)
    assert_matches_reference(collect(model, tokenizer, records, batch_size=4), reference, tokens)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "bert_pooler"])
def test_batch_size_does_not_change_statistics(loaded: dict[str, tuple[nn.Module, Any]], arch: str) -> None:
    model, tokenizer = loaded[arch]
    records = mixed_records(seed=5)
    lengths = [len(encode_record(tokenizer, r, MAX_LENGTH).input_ids) for r in records]
    assert max(lengths) > 10 * min(lengths), "the records must make a batch mostly padding"
    one = collect(model, tokenizer, records, batch_size=1)
    eight = collect(model, tokenizer, records, batch_size=8)
    assert one.layer_group == eight.layer_group
    assert one.counts == eight.counts
    for group, expected in one.sums.items():
        err = rel_error(eight.sums[group], expected)
        assert err < REL_TOL, f"{arch} {group}: batch 8 vs batch 1 relative error {err:.2e}"


def test_prompt_completion_records_count_only_completion_tokens(
    loaded: dict[str, tuple[nn.Module, Any]],
) -> None:
    model, tokenizer = loaded["llama"]
    facts = make_facts(10, seed=7)
    records = [Record(prompt=p, completion=c) for p, c in facts]
    expected = sum(len(tokenizer(c, add_special_tokens=False)["input_ids"]) for _, c in facts)
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p, _ in facts)
    stats = collect(model, tokenizer, records, batch_size=3)
    assert stats.tokens == expected
    assert set(stats.counts.values()) == {expected}
    assert expected < prompt_tokens, "the prompts were read but must not be counted"
    reference, ref_tokens = reference_statistics(model, tokenizer, records)
    assert ref_tokens == expected
    assert_matches_reference(stats, reference, expected)


def test_text_records_count_every_token(loaded: dict[str, tuple[nn.Module, Any]]) -> None:
    model, tokenizer = loaded["llama"]
    texts = [p + c for p, c in make_facts(10, seed=8)]
    stats = collect(model, tokenizer, [Record(text=t) for t in texts], batch_size=4)
    expected = sum(len(tokenizer(t, add_special_tokens=True)["input_ids"]) for t in texts)
    assert stats.tokens == expected
    assert set(stats.counts.values()) == {expected}


def test_llama_shared_inputs_form_one_group(loaded: dict[str, tuple[nn.Module, Any]]) -> None:
    model, tokenizer = loaded["llama"]
    records = mixed_records(seed=2)
    stats = collect(model, tokenizer, records, batch_size=4)
    reference, tokens = reference_statistics(model, tokenizer, records)
    blocks = model.config.num_hidden_layers
    for b in range(blocks):
        attn, mlp = f"model.layers.{b}.self_attn", f"model.layers.{b}.mlp"
        qkv = {stats.layer_group[f"{attn}.{p}"] for p in ("q_proj", "k_proj", "v_proj")}
        gate_up = {stats.layer_group[f"{mlp}.{p}"] for p in ("gate_proj", "up_proj")}
        assert len(qkv) == 1 and len(gate_up) == 1
        own = {stats.layer_group[f"{attn}.o_proj"], stats.layer_group[f"{mlp}.down_proj"]}
        assert len(qkv | gate_up | own) == 4, "o_proj and down_proj read their own inputs"
        assert stats.sums[qkv.pop()] is stats.sum_for(f"{attn}.v_proj")
    # One group per distinct input: 4 per block plus lm_head; no orphaned sums.
    assert len(stats.sums) == 4 * blocks + 1
    assert set(stats.sums) == set(stats.layer_group.values()) == set(stats.counts)
    assert_matches_reference(stats, reference, tokens)


def test_gpt2_conv1d_statistics_equal_reference(loaded: dict[str, tuple[nn.Module, Any]]) -> None:
    model, tokenizer = loaded["gpt2"]
    records = mixed_records(seed=3)
    stats = collect(model, tokenizer, records, batch_size=4)
    specs = {spec.name: spec for spec in editable_layers(model)}
    c_attn = specs["transformer.h.0.attn.c_attn"]
    assert c_attn.transposed and c_attn.bias and c_attn.stat_dim == model.config.n_embd + 1
    reference, tokens = reference_statistics(model, tokenizer, records)
    assert_matches_reference(stats, reference, tokens)
    for name, spec in specs.items():
        if spec.bias:
            assert stats.sum_for(name)[-1, -1].item() == tokens, name


def test_bert_biased_linear_has_bias_column(loaded: dict[str, tuple[nn.Module, Any]]) -> None:
    model, tokenizer = loaded["bert"]
    records = mixed_records(seed=4)
    stats = collect(model, tokenizer, records, batch_size=4)
    reference, tokens = reference_statistics(model, tokenizer, records)
    assert_matches_reference(stats, reference, tokens)
    query = "bert.encoder.layer.0.attention.self.query"
    qkv = {stats.layer_group[query.replace("query", p)] for p in ("query", "key", "value")}
    assert len(qkv) == 1, "BERT's query/key/value read one tensor"
    for spec in editable_layers(model):
        sigma = stats.sum_for(spec.name)
        assert spec.bias and sigma.shape == (spec.in_features + 1,) * 2
        # The appended column is all ones: its diagonal entry is the token count exactly and the
        # rest of that row is the sum of the inputs.
        assert sigma[-1, -1].item() == tokens, spec.name
        torch.testing.assert_close(sigma[-1, :-1], sigma[:-1, -1], rtol=0, atol=0)
        assert rel_error(sigma[-1, :-1], reference[spec.name][-1, :-1]) < REL_TOL, spec.name


def test_pooler_reads_one_row_per_record(loaded: dict[str, tuple[nn.Module, Any]]) -> None:
    """BertModel's pooler.dense reads hidden[:, 0]: its statistics sum that [CLS] row once per
    record that counts (prompt/completion records too, though [CLS] is in the prompt), equal to
    the float64 reference, and every other layer stays token-aligned."""
    model, tokenizer = loaded["bert_pooler"]
    records = mixed_records(seed=6)
    stats = collect(model, tokenizer, records, batch_size=4)
    reference, tokens, counts = reference_with_counts(model, tokenizer, records)
    pooler = "pooler.dense"
    assert pooler in stats.layer_group and stats.lacking == []
    assert counts[pooler] == len(records) < tokens
    assert stats.counts[stats.layer_group[pooler]] == len(records)
    # Bias column: its diagonal entry is the number of records exactly.
    assert stats.sum_for(pooler)[-1, -1].item() == len(records)
    assert_matches_reference(stats, reference, tokens, counts)


def test_pooler_row_is_the_cls_row_and_uncounted_records_stay_out(loaded: dict[str, tuple[nn.Module, Any]]) -> None:
    """The pooler's rows are the encoder's [CLS] outputs; a record with no counted token (an empty
    completion) adds nothing to any layer, the pooler included."""
    model, tokenizer = loaded["bert_pooler"]
    facts = make_facts(3, seed=9)
    records = [Record(text=p + c) for p, c in facts] + [Record(prompt=facts[0][0], completion="")]
    examples = [encode_record(tokenizer, r, MAX_LENGTH) for r in records]
    assert sum(examples[-1].counted) == 0
    stats = collect_statistics(model, make_batches(examples, 4, pad_token_id(tokenizer)), editable_layers(model))
    with torch.no_grad():
        cls_rows = torch.cat([model(input_ids=torch.tensor([e.input_ids])).last_hidden_state[:, 0] for e in examples[:3]])
    x = torch.cat([cls_rows, torch.ones(3, 1)], dim=1).double()
    assert stats.counts[stats.layer_group["pooler.dense"]] == 3
    assert rel_error(stats.sum_for("pooler.dense"), x.T @ x) < REL_TOL


# ---------------------------------------------------------------- low-rank concepts (rows kept)


def test_concept_with_fewer_tokens_than_a_layer_is_wide_keeps_its_rows(
    loaded: dict[str, tuple[nn.Module, Any]],
) -> None:
    """Two short facts (< 32 tokens, the layers' width): every group keeps its rows X, exactly
    the activations, and Σ = XᵀX still equals the float64 reference."""
    model, tokenizer = loaded["llama"]
    records = [Record(prompt=p, completion=c) for p, c in make_facts(2, seed=11)]
    stats = collect(model, tokenizer, records, batch_size=1)
    reference, tokens = reference_statistics(model, tokenizer, records)
    assert 0 < tokens < 32
    assert set(stats.factors) == set(stats.sums), "every group is wider than the concept is long"
    for group, rows in stats.factors.items():
        assert rows.dtype == torch.float32 and rows.shape == (tokens, stats.sums[group].shape[0])
        torch.testing.assert_close(rows.double().T @ rows.double(), stats.sums[group], rtol=1e-6, atol=1e-6)
    assert_matches_reference(stats, reference, tokens)


def test_rows_become_a_sum_once_the_concept_outgrows_the_layer(loaded: dict[str, tuple[nn.Module, Any]]) -> None:
    """Batch by batch, the first batch past D tokens turns the rows into the running sum: the
    32-wide groups end dense, the 64-wide MLP input (down_proj) still as rows, all exact."""
    model, tokenizer = loaded["llama"]
    facts = [Record(prompt=p, completion=c) for p, c in make_facts(20, seed=12)]
    answer_tokens = [len(tokenizer(r.completion, add_special_tokens=False)["input_ids"]) for r in facts]
    records = facts[: next(n for n in range(1, 21) if sum(answer_tokens[:n]) > 40)]  # a few batches past 32
    stats = collect(model, tokenizer, records, batch_size=1)
    reference, tokens = reference_statistics(model, tokenizer, records)
    assert 32 < tokens <= 64, tokens
    for name, group in stats.layer_group.items():
        wide = stats.sums[group].shape[0] >= tokens
        assert (group in stats.factors) == wide, name
    assert any(name.endswith("down_proj") for name, g in stats.layer_group.items() if g in stats.factors)
    assert_matches_reference(stats, reference, tokens)


# ---------------------------------------------------------------- other dtypes and devices

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none; run on a GPU machine)")


def _reduced_precision_matches(stats: LayerStatistics, exact: LayerStatistics, tolerance: float) -> None:
    """A model run in 16-bit: the same groups and tokens, float64 sums, close to the float32 model's."""
    assert stats.layer_group == exact.layer_group and stats.counts == exact.counts
    for group, sigma in stats.sums.items():
        assert sigma.dtype == torch.float64 and sigma.device.type == "cpu" and bool(torch.isfinite(sigma).all())
        assert rel_error(sigma, exact.sums[group]) < tolerance, group


def test_bfloat16_model_accumulates_float64_statistics(model_dirs: dict[str, Path]) -> None:
    """ENGRAM_COLLECT_DTYPE=bfloat16 on the CPU: activations in bf16 (8 mantissa bits), Σ still
    summed from float32 products in float64, so it differs from the float32 model's by the
    activations' rounding only (measured 7e-3 relative at worst here)."""
    path = model_dirs["llama"]
    tokenizer, records = load_tokenizer(path), mixed_records()
    exact = collect(load_model(path), tokenizer, records, batch_size=4)
    half = collect(load_model(path, dtype=torch.bfloat16), tokenizer, records, batch_size=4)
    _reduced_precision_matches(half, exact, tolerance=3e-2)


@pytest.mark.gpu
@CUDA
def test_cuda_statistics_equal_cpu(model_dirs: dict[str, Path]) -> None:
    """float32 model on the GPU with TF32 off for the products: the CPU's statistics to float32 accuracy."""
    path = model_dirs["llama"]
    tokenizer, records = load_tokenizer(path), mixed_records()
    on_cpu = collect(load_model(path), tokenizer, records, batch_size=4)
    on_gpu = collect(load_model(path, device="cuda"), tokenizer, records, batch_size=4)
    assert on_gpu.layer_group == on_cpu.layer_group and on_gpu.counts == on_cpu.counts
    for group, sigma in on_gpu.sums.items():
        assert sigma.dtype == torch.float64 and sigma.device.type == "cpu"
        assert rel_error(sigma, on_cpu.sums[group]) < 1e-5, group


@pytest.mark.gpu
@CUDA
def test_cuda_bfloat16_model_accumulates_float64_statistics(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama"]
    tokenizer, records = load_tokenizer(path), mixed_records()
    exact = collect(load_model(path), tokenizer, records, batch_size=4)
    half = collect(load_model(path, device="cuda", dtype=torch.bfloat16), tokenizer, records, batch_size=4)
    _reduced_precision_matches(half, exact, tolerance=3e-2)
