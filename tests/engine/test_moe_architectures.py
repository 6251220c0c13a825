"""Per-expert statistics on the mixture-of-experts families transformers ships in its fused layout,
and GraniteMoE's experts, stored under the names its checkpoints use (``input_linear``,
``output_linear``), edited in place.

Each family routes its own way (softmax/sigmoid top-k, grouped routing, sparsemixer, shared experts
beside the routed ones), but every one hands its experts module the same call: hidden states and the
top-k expert indices. The statistics must be, expert by expert, the float64 sums of the counted
tokens routed to it (``x xᵀ`` for gate/up, ``a aᵀ`` with ``a = act(gate)·up`` for down), computed
here independently from a float64 copy run one record at a time. Bound: 1e-5 relative to the
largest entry (float32 activations; measured 2e-7 to 6e-7).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.activations import ACT2FN

from engram_fixtures.demo import make_facts
from engram_fixtures.models import MOE_FAMILIES, make_tiny_from_config
from service.engine.checkpoint import CheckpointReader, inspect_model_dir
from service.engine.checkpoint_write import write_checkpoint
from service.engine.collect import collect_statistics
from service.engine.compose import EngramAlgebra, layer_edits, layer_scales
from service.engine.experts import find_fused_experts
from service.engine.records import Record, encode_record, make_batches, pad_token_id

FAMILIES = MOE_FAMILIES
RECORDS = [Record.from_mapping({"text": p + c}, i) for i, (p, c) in enumerate(make_facts(8, seed=1))]


def _tiny(family: str, path: Path) -> Path:
    config_name, model_name, extra = FAMILIES[family]
    return make_tiny_from_config(path, config_name, model_name, extra)


def _reference_sums(model: torch.nn.Module, examples: list[Any]) -> dict[str, torch.Tensor]:
    copy64 = copy.deepcopy(model).double().eval()
    copy64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    modules = {e.name: copy64.get_submodule(e.name) for e in find_fused_experts(copy64)}
    act = ACT2FN[copy64.config.hidden_act]
    calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    handles = [
        m.register_forward_pre_hook(lambda _m, args, name=name: calls.append((name, args[0], args[1])))
        for name, m in modules.items()
    ]
    sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
    try:
        with torch.no_grad():
            for example in examples:
                counted = torch.tensor(example.counted)
                calls.clear()
                copy64(input_ids=torch.tensor([example.input_ids]))
                for name, hidden, top_k in calls:
                    fused = modules[name]
                    hidden, top_k = hidden.reshape(-1, hidden.shape[-1]), top_k.reshape(-1, top_k.shape[-1])
                    for e in range(fused.gate_up_proj.shape[0]):
                        x = hidden[(top_k == e).any(dim=-1) & counted]
                        gate, up = (x @ fused.gate_up_proj[e].T).chunk(2, dim=-1)
                        a = act(gate) * up
                        sums[f"{name}.{e}.gate_proj"] = sums[f"{name}.{e}.gate_proj"] + x.T @ x
                        sums[f"{name}.{e}.down_proj"] = sums[f"{name}.{e}.down_proj"] + a.T @ a
    finally:
        for handle in handles:
            handle.remove()
    return dict(sums)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_expert_sums_the_tokens_routed_to_it(family: str, tmp_path: Path) -> None:
    path = _tiny(family, tmp_path / family)
    layout = inspect_model_dir(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    examples = [encode_record(tokenizer, r, 64) for r in RECORDS]
    stats = collect_statistics(model, make_batches(examples, 4, pad_token_id(tokenizer)), layout.layers)
    reference = _reference_sums(model, examples)
    assert reference and all(name in stats.layer_group for name in reference)
    for layer, expected in reference.items():
        got = stats.sum_for(layer)
        scale = float(expected.abs().max()) or 1.0
        assert float((got - expected).abs().max()) <= 1e-5 * scale, layer
    assert stats.lacking == []


def test_granitemoe_experts_stored_under_their_old_names_are_edited_in_place(tmp_path: Path) -> None:
    """GraniteMoE checkpoints keep the fused experts as ``block_sparse_moe.input_linear.weight``
    [E, 2I, H] and ``output_linear.weight`` [E, H, I], which transformers renames to
    ``experts.gate_up_proj``/``down_proj`` on load. Each expert is read from, and written back into,
    its slice of the stored key; the variant loads with transformers and holds the engine's edits."""
    path = _tiny("granitemoe", tmp_path / "granite")
    layout = inspect_model_dir(path)
    experts = [spec for spec in layout.layers if ".experts." in spec.name]
    assert len(experts) == 2 * 4 * 3  # blocks x experts x (gate, up, down)
    for spec in experts:
        stored = layout.weight_keys[spec.name]
        assert stored.endswith("output_linear.weight" if spec.name.endswith("down_proj") else "input_linear.weight")
        assert spec.name in layout.expert_slices
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    reader = CheckpointReader(path, layout)
    fused = model.get_submodule("model.layers.0.block_sparse_moe.experts")
    inter = fused.down_proj.shape[2]
    assert torch.equal(
        reader.layer_weights(layout.layer("model.layers.0.block_sparse_moe.experts.1.up_proj")).weight,
        fused.gate_up_proj[1, inter:],
    )

    def stats(records: list[Record]) -> Any:
        examples = [encode_record(tokenizer, r, 64) for r in records]
        return collect_statistics(model, make_batches(examples, 4, pad_token_id(tokenizer)), layout.layers)

    target, reference = stats(RECORDS[:4]), stats(RECORDS[4:])
    algebra = EngramAlgebra([(-1.0, target)], [target, reference])
    scales = layer_scales(layout.layers, algebra, reader.layer_weights, "uniform")
    expected = {e.spec.name: e.weight for e in layer_edits(layout.layers, algebra, reader.layer_weights, scales)}
    edits = {e.spec.name: e for e in layer_edits(layout.layers, algebra, reader.layer_weights, scales)}
    out = tmp_path / "variant"
    out.mkdir()
    write_checkpoint(path, out, layout, lambda spec: edits.get(spec.name), set(edits))
    with (
        safe_open(str(path / "model.safetensors"), framework="pt") as before,
        safe_open(str(out / "model.safetensors"), framework="pt") as after,
    ):
        assert set(before.keys()) == set(after.keys())  # the checkpoint's own names and layout
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    moved = 0
    for spec in experts:
        container, _, rest = spec.name.partition(".experts.")
        expert, projection = int(rest.split(".")[0]), rest.split(".")[1]
        module = loaded.get_submodule(container + ".experts")
        if projection == "down_proj":
            weight = module.down_proj[expert]
        else:
            weight = (
                module.gate_up_proj[expert, :inter] if projection == "gate_proj" else module.gate_up_proj[expert, inter:]
            )
        assert torch.allclose(weight.detach(), expected[spec.name].to(weight.dtype), rtol=1e-5, atol=1e-6), spec.name
        moved += not torch.equal(weight.detach(), reader.layer_weights(spec).weight)
    assert moved > len(experts) // 2, "most experts were reached and edited"
