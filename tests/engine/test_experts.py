"""Fused mixture-of-experts layers edited expert by expert (``service.engine.experts``).

Tiny Qwen3-MoE and Mixtral checkpoints (4 experts, top-2, 2 blocks), stored one key per expert as
hub checkpoints are (``mlp.experts.{e}.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``) or fused as the model holds them (``gate_up_proj``
[E, 2I, H], ``down_proj`` [E, H, I]).

The references are written out here, not imported: a float64 copy of the model run record by record,
each experts call's hidden states and top-k routing captured, and for every expert the rows its maps
read (the counted tokens routed to it; ``x`` for gate/up, ``silu(gate)·up`` for down, not weighted by
the routing weight) and its edit ``W − W·Σ_t·Σ_U⁺`` with the service's cut.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import engram
import pytest
import torch
from engram.moe import FusedExpertAdapter
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from engram_fixtures.demo import make_facts
from engram_fixtures.models import make_tiny_gpt_oss, make_tiny_mixtral, make_tiny_qwen3_moe, make_tokenizer
from service.engine.checkpoint import CheckpointReader, inspect_model_dir, load_model, load_tokenizer
from service.engine.checkpoint_write import write_checkpoint, write_delta
from service.engine.collect import LayerStatistics, collect_statistics
from service.engine.compose import EngramAlgebra, LayerEdit, layer_editor, layer_edits, layer_scales
from service.engine.expert_names import is_expert_layer
from service.engine.experts import find_fused_experts
from service.engine.layers import LayerSpec
from service.engine.layout import ModelLayout
from service.engine.model_files import ModelSourceError
from service.engine.records import Example, Record, encode_record, make_batches, pad_token_id
from tests.helpers.moe_reference import expert_weight, reference_pinv, reference_rows

MAX_LENGTH = 64
EXPERTS, BLOCKS = 4, 2
STATS_TOL = 1e-5  # float32 model and products against the float64 copy; measured 1.8e-7 at most
DATA_WEIGHTED_TOL = 1e-4  # the issue asks 1e-3; measured 1.9e-6 at most (the float32 cast of the result)
# ai-engram projects in float32 from running means; measured 2.1e-5 at most (median 5e-6).
ORACLE_TOL = 1e-3

FACTS = make_facts(60, seed=9)
TARGET = [Record(prompt=p, completion=c) for p, c in FACTS[:20]]
REFERENCE = [Record(prompt=p, completion=c) for p, c in FACTS[20:]]
MAKERS = {"qwen3-moe": make_tiny_qwen3_moe, "mixtral": make_tiny_mixtral}
CASES = [("qwen3-moe", False), ("mixtral", False), ("qwen3-moe", True), ("mixtral", True)]


class Moe:
    """A tiny MoE checkpoint on disk, its layout, reader, model and tokenizer, and cached references."""

    def __init__(self, path: Path, fused: bool) -> None:
        self.path, self.fused = path, fused
        self.layout: ModelLayout = inspect_model_dir(path)
        self.reader = CheckpointReader(path, self.layout)
        self.model: nn.Module = load_model(path)
        self.tokenizer: Any = load_tokenizer(path)
        self._rows: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def expert_layers(self) -> list[LayerSpec]:
        return [spec for spec in self.layout.layers if is_expert_layer(spec.name)]

    def stats(self, records: Sequence[Record]) -> LayerStatistics:
        return self.collect([encode_record(self.tokenizer, r, MAX_LENGTH) for r in records])

    def collect(self, examples: Sequence[Example]) -> LayerStatistics:
        return collect_statistics(self.model, make_batches(examples, 8, pad_token_id(self.tokenizer)), self.layout.layers)

    def rows(self, records: Sequence[Record]) -> dict[str, torch.Tensor]:
        """Expert layer -> the float64 rows it reads over ``records`` (cached per record list)."""
        key = id(records)
        if key not in self._rows:
            self._rows[key] = reference_rows(self.model, self.tokenizer, records, MAX_LENGTH)
        return self._rows[key]


def stored_shapes(path: Path) -> dict[str, list[int]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118


def unlearn_edits(moe: Moe, target: LayerStatistics, universe: Sequence[LayerStatistics]) -> Any:
    algebra = EngramAlgebra([(-1.0, target)], list(universe))
    scales = layer_scales(moe.layout.layers, algebra, moe.reader.layer_weights, "uniform")
    return layer_editor(algebra, moe.reader.layer_weights, scales)


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{'fused' if f else 'per-expert'}" for a, f in CASES])
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Moe:
    arch, fused = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{fused}")
    path = MAKERS[arch](root / "model", layers=BLOCKS, experts=EXPERTS, seed=2, fused_on_disk=fused)
    return Moe(path, fused)


# ---------------------------------------------------------------- layout


def test_layout_lists_every_expert_where_the_checkpoint_stores_it(moe: Moe) -> None:
    names = [spec.name for spec in moe.expert_layers]
    expected = [
        f"model.layers.{b}.mlp.experts.{e}.{p}"
        for b in range(BLOCKS)
        for e in range(EXPERTS)
        for p in ("gate_proj", "up_proj", "down_proj")
    ]
    assert names == expected
    assert len(moe.layout.layers) == len(expected) + 4 * BLOCKS + 1, "q/k/v/o per block, lm_head"
    assert not any(".gate." in s.name or s.name.endswith(".gate") for s in moe.layout.layers), "the router is not edited"
    hidden, inter = moe.model.config.hidden_size, moe.model.get_submodule("model.layers.0.mlp.experts").down_proj.shape[2]
    for spec in moe.expert_layers:
        key = moe.layout.weight_keys[spec.name]
        if moe.fused:
            assert key.endswith(("experts.gate_up_proj", "experts.down_proj")) and spec.name in moe.layout.expert_slices
        else:
            assert spec.name not in moe.layout.expert_slices and moe.layout.key_files[key] == "model.safetensors"
        down = spec.name.endswith("down_proj")
        assert (spec.in_features, spec.out_features) == ((inter, hidden) if down else (hidden, inter))
        assert (spec.bias, spec.transposed, spec.block) == (False, False, int(spec.name.split(".")[2]))
        assert torch.equal(moe.reader.layer_weights(spec).weight, expert_weight(moe.model, spec.name)), spec.name
    if not moe.fused and type(moe.model).__name__ == "MixtralForCausalLM":
        assert (
            moe.layout.weight_keys["model.layers.1.mlp.experts.2.up_proj"]
            == "model.layers.1.block_sparse_moe.experts.2.w3.weight"
        )
    assert json.loads(json.dumps(moe.layout.to_json())) == moe.layout.to_json()
    assert ModelLayout.from_json(moe.layout.to_json()) == moe.layout


# ---------------------------------------------------------------- statistics


def test_each_expert_has_the_statistics_of_the_tokens_routed_to_it(moe: Moe) -> None:
    stats = moe.stats(TARGET)
    rows = moe.rows(TARGET)
    assert stats.lacking == []
    worst = 0.0
    for spec in moe.expert_layers:
        group = stats.layer_group[spec.name]
        x = rows[spec.name]
        assert stats.counts[group] == x.shape[0] > 0, spec.name
        expected = x.T @ x
        worst = max(worst, float((stats.sums[group] - expected).norm() / expected.norm()))
        if spec.name.endswith("up_proj"):  # gate and up read one tensor: one input group
            assert group == spec.name.replace("up_proj", "gate_proj")
    assert worst <= STATS_TOL, worst
    routed = sum(stats.counts[stats.layer_group[f"model.layers.0.mlp.experts.{e}.gate_proj"]] for e in range(EXPERTS))
    assert routed == 2 * stats.counts[stats.layer_group["model.layers.0.self_attn.q_proj"]], "top-2: each token twice"


# ---------------------------------------------------------------- edits


def test_every_routed_expert_is_edited_like_a_float64_reference(moe: Moe, tmp_path: Path) -> None:
    target, reference = moe.stats(TARGET), moe.stats(REFERENCE)
    edit = unlearn_edits(moe, target, [target, reference])
    out = tmp_path / "variant"
    out.mkdir()
    written: list[int] = []
    write_checkpoint(
        moe.path, out, moe.layout, edit, {s.name for s in moe.layout.layers}, on_layer=lambda: written.append(1)
    )
    assert len(written) == len(moe.layout.layers), "progress once per edited layer"
    assert stored_shapes(out) == stored_shapes(moe.path), "the variant keeps the checkpoint's own layout"
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    rows_t = moe.rows(TARGET)
    rows_u = {name: torch.cat([rows_t[name], moe.rows(REFERENCE)[name]]) for name in rows_t}
    errors = {}
    for spec in moe.expert_layers:
        base = moe.reader.layer_weights(spec).weight.double()
        x_t, x_u = rows_t[spec.name], rows_u[spec.name]
        expected = base - base @ (x_t.T @ x_t) @ reference_pinv(x_u.T @ x_u)
        change = (expected - base) @ x_u.T
        assert change.norm() > 1e-3 * (base @ x_u.T).norm(), f"the reference edit moves {spec.name}"
        actual = expert_weight(loaded, spec.name).detach().double()
        errors[spec.name] = float(((actual - expected) @ x_u.T).norm() / change.norm())
    assert max(errors.values()) <= DATA_WEIGHTED_TOL, max(errors.items(), key=lambda kv: kv[1])


def test_an_expert_no_token_reached_is_listed_and_written_unchanged(moe: Moe, tmp_path: Path) -> None:
    """One counted token reaches 2 of the 4 experts of each block: the other two have zero
    statistics (count 0, not lacking), a zero edit, and keep their stored values exactly."""
    example = encode_record(moe.tokenizer, TARGET[0], MAX_LENGTH)
    first = example.counted.index(True)  # the prompt, and only the completion's first token counted
    stats = moe.collect([Example(example.input_ids[: first + 1], [False] * first + [True])])
    assert stats.tokens == 1 and stats.lacking == []
    for block in range(BLOCKS):
        counts = [stats.counts[stats.layer_group[f"model.layers.{block}.mlp.experts.{e}.down_proj"]] for e in range(EXPERTS)]
        assert sorted(counts) == [0, 0, 1, 1], counts
    unreached = [s for s in moe.expert_layers if stats.counts[stats.layer_group[s.name]] == 0]
    assert all(not stats.sum_for(s.name).any() for s in unreached)
    out = tmp_path / "variant"
    out.mkdir()
    write_checkpoint(moe.path, out, moe.layout, unlearn_edits(moe, stats, [stats]), {s.name for s in moe.layout.layers})
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    for spec in moe.expert_layers:
        same = torch.equal(expert_weight(loaded, spec.name), moe.reader.layer_weights(spec).weight)
        assert same == (spec in unreached), spec.name


def test_a_delta_holds_the_edited_experts_under_checkpoint_keys(moe: Moe, tmp_path: Path) -> None:
    target, reference = moe.stats(TARGET[:8]), moe.stats(REFERENCE[:8])
    chosen = {s.name for s in moe.expert_layers if s.name.startswith("model.layers.1.") and ".experts.1." in s.name}
    edit = unlearn_edits(moe, target, [target, reference])
    write_delta(moe.path, tmp_path / "delta.safetensors", moe.layout, edit, chosen, {"variant_id": "v"})
    delta = load_file(tmp_path / "delta.safetensors")
    assert sorted(delta) == sorted({moe.layout.weight_keys[name] for name in chosen})
    if moe.fused:  # the fused tensors, only expert 1's slices changed: loadable into the model by name
        base = copy.deepcopy(moe.model)
        missing = base.load_state_dict(delta, strict=False)
        assert not missing.unexpected_keys
        for spec in moe.expert_layers:
            changed = not torch.equal(expert_weight(base, spec.name), expert_weight(moe.model, spec.name))
            assert changed == (spec.name in chosen), spec.name


# ---------------------------------------------------------------- ai-engram


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_expert_edits_match_ai_engram_fused_expert_adapter(arch: str, tmp_path: Path) -> None:
    """ai-engram's FusedExpertAdapter (per-expert mean covariances; its default count_ratio scaling
    undoes the means) against the service's per-expert sums, uniform scaling, alpha 1."""
    moe = Moe(MAKERS[arch](tmp_path / arch, layers=BLOCKS, experts=EXPERTS, seed=4, tokenizer=make_tokenizer()), False)
    forget, retain = FACTS[:20], FACTS[20:]
    target = moe.stats([Record(prompt=p, completion=c) for p, c in forget])
    reference = moe.stats([Record(prompt=p, completion=c) for p, c in retain])
    adapters = [FusedExpertAdapter()]
    result = engram.get_engram(
        moe.model, moe.tokenizer, forget=forget, total=forget + retain, max_length=MAX_LENGTH, adapters=adapters
    )
    theirs = engram.apply_engram(moe.model, result, alpha=1.0, adapters=adapters)
    algebra = EngramAlgebra([(-1.0, target)], [target, reference])
    scales = {spec.name: 1.0 for spec in moe.expert_layers}
    ours: dict[str, LayerEdit] = {
        e.spec.name: e for e in layer_edits(moe.expert_layers, algebra, moe.reader.layer_weights, scales)
    }
    errors = {}
    for spec in moe.expert_layers:
        old = moe.reader.layer_weights(spec).weight.double()
        their_delta = expert_weight(theirs, spec.name).detach().double() - old
        our_delta = ours[spec.name].weight.double() - old
        assert their_delta.norm() > 0, spec.name
        errors[spec.name] = float((our_delta - their_delta).norm() / their_delta.norm())
    assert max(errors.values()) < ORACLE_TOL, max(errors.items(), key=lambda kv: kv[1])


# ---------------------------------------------------------------- refused layouts


def test_fused_experts_in_another_layout_are_refused_by_name(tmp_path: Path) -> None:
    """gpt-oss: gate_up_proj [E, H, 2I] transposed and interleaved, with biases and a clamped gate."""
    path = make_tiny_gpt_oss(tmp_path / "gpt-oss", layers=2, experts=4)
    with pytest.raises(ModelSourceError) as caught:
        inspect_model_dir(path)
    message = str(caught.value)
    assert "model.layers.{0,1}.mlp.experts.gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias" in message
    assert "router" not in message


def test_a_checkpoint_missing_an_expert_is_refused_by_name(tmp_path: Path) -> None:
    path = make_tiny_qwen3_moe(tmp_path / "qwen", layers=2, experts=4)
    tensors = load_file(path / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if not k.startswith("model.layers.1.mlp.experts.3.")}
    save_file(kept, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelSourceError) as caught:
        inspect_model_dir(path)
    assert "the experts of model.layers.1.mlp.experts.*" in str(caught.value), str(caught.value)


def test_fused_experts_of_another_shape_are_refused_by_name(tmp_path: Path) -> None:
    path = make_tiny_mixtral(tmp_path / "mixtral", layers=2, experts=4, fused_on_disk=True)
    tensors = load_file(path / "model.safetensors")
    key = "model.layers.0.mlp.experts.down_proj"
    tensors[key] = tensors[key].transpose(1, 2).contiguous()  # [E, I, H]: another layout
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelSourceError) as caught:
        inspect_model_dir(path)
    assert "the experts of model.layers.0.mlp.experts.*" in str(caught.value), str(caught.value)


def test_collection_refuses_an_expert_layer_the_model_does_not_have(moe: Moe) -> None:
    spec = LayerSpec("model.layers.0.mlp.experts.9.gate_proj", 32, 16, False, False, 0)
    with pytest.raises(ValueError, match=r"experts\.9\.gate_proj"):
        collect_statistics(moe.model, [], [spec])
    assert [m.name for m in find_fused_experts(moe.model)] == [f"model.layers.{b}.mlp.experts" for b in range(BLOCKS)]
