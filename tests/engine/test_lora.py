"""LoRA adapters of engram edits (``service.engine.lora``), checked against peft itself.

peft is real here: adapters are loaded with ``PeftModel.from_pretrained`` and compared with the
checkpoint variant of the same edit, and key names with what ``get_peft_model(...).save_pretrained``
writes for the same config.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from api_schemas import VLLM_LORA_RANKS
from engram_fixtures.demo import make_facts
from engram_fixtures.models import make_tiny_gpt2, make_tiny_llama, make_tokenizer
from service.engine.checkpoint import CheckpointReader, inspect_model_dir, load_model, load_tokenizer
from service.engine.checkpoint_write import write_checkpoint
from service.engine.collect import LayerStatistics, collect_statistics
from service.engine.compose import EngramAlgebra, LayerDelta, layer_deltas, layer_editor, layer_scales
from service.engine.errors import EditError
from service.engine.layers import LayerSpec
from service.engine.layout import ModelLayout
from service.engine.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, REPORT_FILE, factorize, layer_lora, layer_loras
from service.engine.lora_files import write_adapter
from service.engine.lora_rules import EXACT_RTOL, LoraTarget, vllm_bias_refusal, vllm_rank
from service.engine.records import Record, encode_record, make_batches, pad_token_id
from tests.helpers.peft import assert_same_parameters, load_adapter

HIDDEN = 32
FLOAT64_TOL = 1e-12  # a float64 SVD reproduces its matrix to ~1e-15 relative
# Float32 factors vs the float64 delta: the EXACT_RTOL cut's tail plus float32 rounding of B·A;
# measured ≤ 9e-7 on these models.
STORED_TOL = 1e-5
# Served adapter vs the checkpoint variant: measured ≤ 1.2e-6 relative on logits (merged, per
# parameter: tests.helpers.peft.MERGE_TOL).
LOGIT_TOL = 1e-5
GPT2_BLOCK_LAYERS = ("c_attn", "c_proj", "c_fc")  # every biased Conv1D; lm_head has no bias


# ------------------------------------------------------------------------------------- fixtures


class Case:
    """A tiny checkpoint and an unlearning edit of a few short answers on it."""

    def __init__(self, path: Path, forget: Sequence[Record], retain: Sequence[Record]) -> None:
        self.path = path
        self.layout: ModelLayout = inspect_model_dir(path)
        self.reader = CheckpointReader(path, self.layout)
        target, others = self._stats(forget), self._stats(retain)
        self.forget_tokens = target.tokens
        self.algebra = EngramAlgebra([(-1.0, target)], [target, others])

    def _stats(self, records: Sequence[Record]) -> LayerStatistics:
        model, tokenizer = load_model(self.path), load_tokenizer(self.path)
        examples = [encode_record(tokenizer, r, 120) for r in records]
        return collect_statistics(model, make_batches(examples, 8, pad_token_id(tokenizer)), self.layout.layers)

    def layers(self, suffixes: Sequence[str] | None = None) -> list[LayerSpec]:
        specs = self.layout.layers
        return [s for s in specs if suffixes is None or s.name.rsplit(".", 1)[-1] in suffixes]

    def deltas(self, layers: Sequence[LayerSpec]) -> list[LayerDelta]:
        scales = layer_scales(layers, self.algebra, self.reader.layer_weights, "uniform")
        return list(layer_deltas(layers, self.algebra, self.reader.layer_weights, scales))

    def checkpoint(self, layers: Sequence[LayerSpec], target: Path) -> Path:
        """The checkpoint variant of the same edit (what the adapter must reproduce)."""
        scales = layer_scales(layers, self.algebra, self.reader.layer_weights, "uniform")
        edit_layer = layer_editor(self.algebra, self.reader.layer_weights, scales)
        target.mkdir()
        write_checkpoint(self.path, target, self.layout, edit_layer, {s.name for s in layers})
        return target

    def adapter(
        self, layers: Sequence[LayerSpec], target: Path, max_rank: int | None = None, lora_target: LoraTarget = "peft"
    ) -> dict[str, Any]:
        target.mkdir()
        loras = layer_loras(self.deltas(layers), max_rank, lora_target=lora_target)
        tied = self.layout.tied_partners
        report = write_adapter(target, "org/tiny", loras, max_rank=max_rank, tied=tied, lora_target=lora_target)
        return report.model_dump(mode="json")


def qa_records(start: int, stop: int) -> list[Record]:
    """Prompt/completion records: only the short answers enter Σ, so the edit has low rank."""
    return [Record(prompt=p, completion=c) for p, c in make_facts(60, seed=3)[start:stop]]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("lora-models")
    tokenizer = make_tokenizer()
    forget, retain = qa_records(0, 3), qa_records(3, 60)
    paths = {
        "llama": make_tiny_llama(root / "llama", hidden=HIDDEN, layers=2, seed=0, tokenizer=tokenizer),
        "llama_tied": make_tiny_llama(
            root / "llama-tied", hidden=HIDDEN, layers=2, tie_word_embeddings=True, seed=1, tokenizer=tokenizer
        ),
        "gpt2": make_tiny_gpt2(root / "gpt2", hidden=HIDDEN, layers=2, seed=2, tokenizer=tokenizer),
    }
    return {name: Case(path, forget, retain) for name, path in paths.items()}


def load_peft(base_dir: Path, adapter_dir: Path) -> PeftModel:
    return load_adapter(AutoModelForCausalLM.from_pretrained(base_dir).eval(), adapter_dir)


def logits(model: torch.nn.Module, path: Path) -> torch.Tensor:
    tokenizer = load_tokenizer(path)
    ids = tokenizer([p + c for p, c in make_facts(6, seed=9)], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**ids).logits


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


# ------------------------------------------------------------------------------------- factorization


def low_rank(out: int, inp: int, rank: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, -3, rank, dtype=torch.float64)
    return (torch.randn(out, rank, generator=gen, dtype=torch.float64) * scales) @ torch.randn(
        rank, inp, generator=gen, dtype=torch.float64
    )


def test_factorize_is_exact_at_the_numerical_rank() -> None:
    delta = low_rank(40, 30, rank=5)
    factors = factorize(delta)
    assert (factors.rank, factors.numerical_rank) == (5, 5)
    assert factors.relative_error < FLOAT64_TOL
    assert float((factors.up @ factors.down - delta).norm() / delta.norm()) < FLOAT64_TOL
    assert factors.kept_energy == pytest.approx(1.0, abs=FLOAT64_TOL)
    # Symmetric split: Bᵀ B = A Aᵀ = diag(S).
    assert torch.allclose(factors.up.T @ factors.up, factors.down @ factors.down.T, atol=1e-12)


def test_truncation_error_is_the_svd_tail_energy() -> None:
    delta = low_rank(40, 30, rank=12, seed=1)
    s = torch.linalg.svdvals(delta)
    for cap in (1, 4, 8):
        factors = factorize(delta, max_rank=cap)
        tail = float(s[cap:].square().sum().sqrt() / s.norm())
        assert factors.rank == cap and factors.numerical_rank == 12
        assert factors.relative_error == pytest.approx(tail, rel=1e-9)
        assert factors.kept_energy == pytest.approx(1.0 - tail**2, rel=1e-9)
    assert factorize(delta, max_rank=64).rank == 12  # the cap never adds zero directions


def test_zero_delta_gives_rank_one_zero_factors() -> None:
    factors = factorize(torch.zeros(6, 4, dtype=torch.float64))
    assert (factors.rank, factors.numerical_rank, factors.relative_error) == (1, 0, 0.0)
    assert not factors.up.any() and not factors.down.any()


@pytest.mark.parametrize(
    ("delta", "max_rank", "message"),
    [
        (torch.ones(3), None, "matrix"),
        (torch.ones(3, 3), 0, "max_rank"),
        (torch.tensor([[1.0, math.inf]]), None, "finite"),
    ],
)
def test_factorize_rejects_bad_input(delta: torch.Tensor, max_rank: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        factorize(delta, max_rank)


# ------------------------------------------------------------------------------------- engram edits


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_layer_lora_is_exact_when_the_concept_is_narrower_than_the_layer(cases: dict[str, Case], arch: str) -> None:
    case = cases[arch]
    assert case.forget_tokens < HIDDEN, "the fixture must hold fewer answer tokens than the layers are wide"
    for item in case.deltas(case.layers()):
        lora = layer_lora(item)
        spec = item.spec
        # Singular values cut at EXACT_RTOL·σ₁ bound the dropped tail by sqrt(D)·EXACT_RTOL.
        bound = math.sqrt(min(spec.in_features, spec.out_features)) * EXACT_RTOL
        assert lora.numerical_rank <= case.forget_tokens, spec.name
        assert lora.relative_error <= bound, (spec.name, lora.relative_error)
        product = lora.lora_B.double() @ lora.lora_A.double()
        assert rel(product, item.delta[:, : spec.in_features]) <= STORED_TOL, spec.name
        assert lora.lora_A.dtype == lora.lora_B.dtype == torch.float32
        if spec.bias:
            assert lora.bias is not None
            assert torch.allclose(lora.bias.double(), item.delta[:, spec.in_features], rtol=1e-6, atol=1e-9)


def test_layer_lora_truncates_to_the_cap_with_the_tail_error(cases: dict[str, Case]) -> None:
    case = cases["llama"]
    for item in case.deltas(case.layers()):
        lora = layer_lora(item, max_rank=2)
        s = torch.linalg.svdvals(item.delta[:, : item.spec.in_features])
        tail = float(s[2:].square().sum().sqrt() / s.norm())
        assert lora.rank == 2
        assert lora.relative_error == pytest.approx(tail, rel=1e-6), item.spec.name
        assert lora.stored_relative_error == pytest.approx(tail, rel=1e-3), item.spec.name


# ------------------------------------------------------------------------------------- with peft


def test_adapter_files_load_with_peft_and_match_its_own_keys(cases: dict[str, Case], tmp_path: Path) -> None:
    """Our keys and shapes equal what get_peft_model(config).save_pretrained writes for our config."""
    for arch in ("llama", "gpt2"):
        case = cases[arch]
        ours = tmp_path / f"{arch}-ours"
        report = case.adapter(case.layers(), ours, max_rank=3)
        config = LoraConfig.from_pretrained(str(ours))
        assert (config.r, config.lora_alpha, config.lora_dropout, config.use_rslora) == (3, 3, 0.0, False)
        # GPT-2's biased Conv1Ds beside its bias-free lm_head: no adapter-wide lora_bias (peft could
        # not merge it into lm_head), the edited biases stored whole (bias "lora_only")
        assert (config.lora_bias, config.bias) == (False, "lora_only" if arch == "gpt2" else "none")
        base = AutoModelForCausalLM.from_pretrained(case.path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = get_peft_model(base, config)
            reference.save_pretrained(tmp_path / f"{arch}-peft")
        theirs = load_file(tmp_path / f"{arch}-peft" / ADAPTER_WEIGHTS)
        mine = load_file(ours / ADAPTER_WEIGHTS)
        # peft also saves lm_head's base weight ("lm_head" is on its list of embedding names, for
        # resized vocabularies); an adapter of an unresized model does not need it.
        theirs = {k: v for k, v in theirs.items() if not k.endswith(".base_layer.weight")}
        assert {k: tuple(v.shape) for k, v in mine.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
        for name, module in reference.named_modules():
            if isinstance(module, LoraLayer):
                assert module.scaling["default"] == 1.0, name
                assert module.r["default"] == report["layers"][name.removeprefix("base_model.model.")]["rank"]
        assert json.loads((ours / REPORT_FILE).read_text()) == report
        assert json.loads((ours / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == "org/tiny"


def test_merged_adapter_equals_the_checkpoint_variant_llama(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["llama"]
    layers = case.layers()
    report = case.adapter(layers, tmp_path / "adapter")
    assert report["mergeable"] and report["totals"]["truncated_layers"] == 0
    variant = AutoModelForCausalLM.from_pretrained(case.checkpoint(layers, tmp_path / "variant"))
    merged = load_peft(case.path, tmp_path / "adapter").merge_and_unload()
    assert_same_parameters(merged, variant, AutoModelForCausalLM.from_pretrained(case.path))


def test_merged_adapter_equals_the_checkpoint_variant_gpt2_biases(cases: dict[str, Case], tmp_path: Path) -> None:
    """Conv1D layers with biases (fan_in_fan_out, lora_bias) merge into the checkpoint variant's weights."""
    case = cases["gpt2"]
    layers = case.layers(GPT2_BLOCK_LAYERS)
    report = case.adapter(layers, tmp_path / "adapter")
    assert report["mergeable"], report["notes"]
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["fan_in_fan_out"] is True
    variant = AutoModelForCausalLM.from_pretrained(case.checkpoint(layers, tmp_path / "variant"))
    merged = load_peft(case.path, tmp_path / "adapter").merge_and_unload()
    changed = assert_same_parameters(merged, variant, AutoModelForCausalLM.from_pretrained(case.path))
    assert any(name.endswith("c_attn.bias") for name in changed), "the edit must move the biases"


@pytest.mark.parametrize("arch", ["llama_tied", "gpt2"])
def test_tied_head_adapter_serves_like_the_checkpoint_variant(cases: dict[str, Case], arch: str, tmp_path: Path) -> None:
    """LoRA on a tied lm_head changes the head only: unmerged, it reproduces the untied variant."""
    case = cases[arch]
    layers = case.layers()
    report = case.adapter(layers, tmp_path / "adapter")
    assert "lm_head" in report["layers"] and not report["mergeable"]
    assert any("lm_head shares its weight" in note for note in report["notes"])
    variant = AutoModelForCausalLM.from_pretrained(case.checkpoint(layers, tmp_path / "variant")).eval()
    served = load_peft(case.path, tmp_path / "adapter")
    embedding = served.get_input_embeddings().weight
    assert torch.equal(embedding, AutoModelForCausalLM.from_pretrained(case.path).get_input_embeddings().weight)
    assert rel(logits(served, case.path), logits(variant, case.path)) < LOGIT_TOL


# ------------------------------------------------------------------------------------- servable by vLLM

# What vLLM's loader reads of adapter_config.json (vllm/lora/peft_helper.py: PEFTHelper fields and
# validate_legal) and which tensor names it parses (vllm/lora/utils.py: parse_fine_tuned_lora_name
# takes "<module>.lora_A.weight" / "<module>.lora_B.weight" only; a "lora_B.bias" is "unsupported").
VLLM_REQUIRED_FIELDS = ("r", "lora_alpha", "target_modules")


def assert_vllm_adapter(path: Path, rank: int) -> dict[str, torch.Tensor]:
    """The adapter at ``path`` is what vLLM loads at ``--max-lora-rank rank``; returns its tensors."""
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    assert all(field in config for field in VLLM_REQUIRED_FIELDS)
    assert config["r"] == config["lora_alpha"] == rank and rank in VLLM_LORA_RANKS  # scaling lora_alpha/r = 1
    assert config["bias"] == "none" and config["lora_bias"] is False
    assert (config["use_dora"], config["use_rslora"], config["modules_to_save"]) == (False, False, None)
    assert config["rank_pattern"] == config["alpha_pattern"] == {}  # vLLM reads neither: one rank for all
    tensors = load_file(path / ADAPTER_WEIGHTS)
    for key, tensor in tensors.items():
        assert key.startswith("base_model.model.") and key.endswith((".lora_A.weight", ".lora_B.weight")), key
        assert tensor.shape[0 if key.endswith("lora_A.weight") else 1] == rank, (key, tuple(tensor.shape))
    return tensors


def test_vllm_rank_is_the_smallest_served_rank_that_holds_every_layer() -> None:
    assert [vllm_rank([n]) for n in (1, 8, 9, 33, 257, 320, 321, 512)] == [8, 8, 16, 64, 320, 320, 512, 512]
    assert vllm_rank([3, 17, 5]) == 32


def test_vllm_adapter_is_exact_at_one_served_rank_and_serves_like_the_checkpoint(
    cases: dict[str, Case], tmp_path: Path
) -> None:
    """Default rank: the smallest vLLM rank holding every layer's edit, zero-padded; peft serves and
    merges it into the checkpoint variant's weights, as the per-layer-rank adapter does."""
    case = cases["llama_tied"]
    layers = case.layers()
    report = case.adapter(layers, tmp_path / "adapter", lora_target="vllm")
    kept = [layer["kept_rank"] for layer in report["layers"].values()]
    assert report["r"] == vllm_rank(kept) and report["lora_target"] == "vllm"
    assert max(kept) > VLLM_LORA_RANKS[0] // 2, "the fixture should need more than a token rank"
    assert_vllm_adapter(tmp_path / "adapter", report["r"])
    assert report["totals"]["truncated_layers"] == 0 and report["totals"]["max_stored_relative_error"] < STORED_TOL
    assert all(layer["rank"] == report["r"] for layer in report["layers"].values())
    variant = AutoModelForCausalLM.from_pretrained(case.checkpoint(layers, tmp_path / "variant")).eval()
    served = load_peft(case.path, tmp_path / "adapter")
    for name, module in served.named_modules():
        if isinstance(module, LoraLayer):
            assert (module.r["default"], module.scaling["default"]) == (report["r"], 1.0), name
    assert rel(logits(served, case.path), logits(variant, case.path)) < LOGIT_TOL


def test_vllm_adapter_at_a_smaller_rank_keeps_the_svd_energy(cases: dict[str, Case], tmp_path: Path) -> None:
    """lora_rank 8 truncates the wider edits: each layer's kept energy is the float64 SVD's top-8 share,
    its error the tail, and the rank is 8 everywhere (padded where the edit is narrower)."""
    case = cases["llama"]
    layers = case.layers()
    report = case.adapter(layers, tmp_path / "adapter", max_rank=8, lora_target="vllm")
    tensors = assert_vllm_adapter(tmp_path / "adapter", 8)
    assert report["totals"]["truncated_layers"] > 0, "the fixture's edits should be wider than 8"
    energy = total = 0.0
    for item in case.deltas(layers):
        s = torch.linalg.svdvals(item.delta[:, : item.spec.in_features]).square()  # float64
        layer = report["layers"][item.spec.name]
        kept = min(8, layer["numerical_rank"])
        assert layer["kept_rank"] == kept, item.spec.name
        assert layer["kept_energy"] == pytest.approx(float(s[:kept].sum() / s.sum()), rel=1e-12), item.spec.name
        # Directions under the EXACT_RTOL cut hold at most D·rtol² of the energy.
        assert layer["kept_energy"] == pytest.approx(float(s[:8].sum() / s.sum()), abs=1e-10), item.spec.name
        assert layer["relative_error"] == pytest.approx(math.sqrt(1.0 - layer["kept_energy"]), rel=1e-6, abs=1e-9)
        energy, total = energy + float(s[:kept].sum()), total + float(s.sum())
        padding = tensors[f"base_model.model.{item.spec.name}.lora_A.weight"][kept:]
        assert not padding.any(), item.spec.name
    assert report["totals"]["kept_energy"] == pytest.approx(energy / total, rel=1e-12)
    assert report["totals"]["min_kept_energy"] == min(layer["kept_energy"] for layer in report["layers"].values())
    assert load_peft(case.path, tmp_path / "adapter") is not None


def test_vllm_rank_wider_than_the_layers_is_zero_padded(cases: dict[str, Case], tmp_path: Path) -> None:
    """r = 64 on 32-wide layers: B·A is the same edit, padded with zero directions; peft loads it."""
    case = cases["llama"]
    layers = case.layers(("q_proj", "down_proj"))
    exact = case.adapter(layers, tmp_path / "exact")
    padded = case.adapter(layers, tmp_path / "padded", max_rank=64, lora_target="vllm")
    assert_vllm_adapter(tmp_path / "padded", 64)
    ours, theirs = load_file(tmp_path / "padded" / ADAPTER_WEIGHTS), load_file(tmp_path / "exact" / ADAPTER_WEIGHTS)
    for name in exact["layers"]:
        key = f"base_model.model.{name}"
        product = ours[f"{key}.lora_B.weight"].double() @ ours[f"{key}.lora_A.weight"].double()
        expected = theirs[f"{key}.lora_B.weight"].double() @ theirs[f"{key}.lora_A.weight"].double()
        assert torch.equal(product, expected), name
        assert padded["layers"][name]["kept_rank"] == exact["layers"][name]["rank"]
    assert load_peft(case.path, tmp_path / "padded") is not None


def test_vllm_adapter_refuses_a_bias_edit_by_layer_name(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["gpt2"]
    with pytest.raises(EditError, match=r"transformer\.h\.0\.attn\.c_attn"):
        case.adapter(case.layers(GPT2_BLOCK_LAYERS), tmp_path / "adapter", lora_target="vllm")
    biased = [s for s in case.layers() if s.bias]
    message = vllm_bias_refusal(biased, case.layers())
    assert all(spec.name in message for spec in biased)
    assert '"modules": ["lm_head"]' in message  # the selection's bias-free layers, as a request can say it
    head = case.adapter(case.layers(("lm_head",)), tmp_path / "head", lora_target="vllm")
    assert_vllm_adapter(tmp_path / "head", head["r"])


@pytest.mark.parametrize("rank", [4, 24, 1024])
def test_vllm_adapter_refuses_a_rank_vllm_does_not_serve(cases: dict[str, Case], rank: int) -> None:
    case = cases["llama"]
    with pytest.raises(ValueError, match=rf"lora_rank {rank} .*8, 16, 32, 64, 128, 256, 320, 512"):
        next(layer_loras(iter(case.deltas(case.layers())), rank, lora_target="vllm"))
