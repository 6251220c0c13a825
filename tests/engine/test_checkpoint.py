"""Model directories (``service.engine.checkpoint``) and statistics files (``service.engine.stats_io``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

from engram_fixtures.demo import make_facts
from engram_fixtures.models import make_tiny_bert, make_tiny_gpt2, make_tiny_llama, make_tokenizer
from service.engine.checkpoint import CheckpointReader, inspect_model_dir, load_model, load_tokenizer
from service.engine.checkpoint_write import write_checkpoint, write_delta
from service.engine.collect import LayerStatistics, collect_statistics
from service.engine.compose import EngramAlgebra, LayerEdit, layer_edits, layer_scales
from service.engine.editable import editable_layers
from service.engine.layers import LayerSpec
from service.engine.layout import ModelLayout
from service.engine.model_files import ModelSourceError
from service.engine.records import Record, encode_record, make_batches, pad_token_id
from service.engine.stats_io import load_statistics, save_statistics

HIDDEN = 32
EDITED = ("lm_head", "model.layers.0.self_attn.q_proj")


# ------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoint-models")
    tokenizer = make_tokenizer()
    return {
        "llama": make_tiny_llama(root / "llama", hidden=HIDDEN, layers=2, seed=0, tokenizer=tokenizer),
        "llama_tied": make_tiny_llama(
            root / "llama-tied", hidden=HIDDEN, layers=2, tie_word_embeddings=True, seed=1, tokenizer=tokenizer
        ),
        "gpt2": make_tiny_gpt2(root / "gpt2", hidden=HIDDEN, layers=2, seed=2, tokenizer=tokenizer),
        "bert": make_tiny_bert(root / "bert", hidden=HIDDEN, layers=2, seed=3),
    }


def statistics(path: Path, n_records: int = 30) -> LayerStatistics:
    model, tokenizer = load_model(path), load_tokenizer(path)
    examples = [encode_record(tokenizer, Record(text=p + c), 120) for p, c in make_facts(n_records, seed=5)]
    return collect_statistics(model, make_batches(examples, 8, pad_token_id(tokenizer)), editable_layers(model))


class Edits:
    """Edits of the layers ``names``: all at once (``edits(specs)``, for write_delta) or one layer
    at a time (``edits.one``, with ``edits.names``, for write_checkpoint); ``produced`` keeps them."""

    def __init__(self, path: Path, layout: ModelLayout, names: tuple[str, ...]) -> None:
        stats = statistics(path)
        self.algebra = EngramAlgebra([(-1.0, stats)], [stats])
        self.reader = CheckpointReader(path, layout)
        self.names = set(names)
        chosen = [spec for spec in layout.layers if spec.name in names]
        self.scales = layer_scales(chosen, self.algebra, self.reader.layer_weights, "uniform")
        self.produced: dict[str, LayerEdit] = {}

    def __call__(self, specs: list[LayerSpec]) -> list[LayerEdit]:
        chosen = [s for s in specs if s.name in self.names]
        edits = list(layer_edits(chosen, self.algebra, self.reader.layer_weights, self.scales))
        self.produced.update({e.spec.name: e for e in edits})
        return edits

    def one(self, spec: LayerSpec) -> LayerEdit | None:
        return next(iter(self([spec])), None)


def edit_function(path: Path, layout: ModelLayout, names: tuple[str, ...]) -> tuple[Edits, dict[str, LayerEdit]]:
    """The edits of ``names`` and the dict that collects what they produced, by name."""
    edits = Edits(path, layout, names)
    return edits, edits.produced


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


# ------------------------------------------------------------------------------------- inspect


def shapes(layout: ModelLayout) -> dict[str, tuple[int, int, bool, bool]]:
    return {s.name: (s.in_features, s.out_features, s.bias, s.transposed) for s in layout.layers}


def assert_layout_matches_model(layout: ModelLayout, path: Path) -> None:
    """Every listed layer exists in the checkpoint with the shapes the real model has."""
    model = load_model(path)
    modules = dict(model.named_modules())
    assert layout.architecture == type(model).__name__
    assert layout.num_parameters == sum(p.numel() for p in model.parameters())  # tied counted once
    assert [s.name for s in layout.layers] == [s.name for s in editable_layers(model)]
    reader = CheckpointReader(path, layout)
    for spec in layout.layers:
        weights = reader.layer_weights(spec)
        assert torch.equal(weights.weight, modules[spec.name].weight.detach()), spec.name
        if spec.bias:
            assert weights.bias is not None and torch.equal(weights.bias, modules[spec.name].bias.detach())
        assert layout.key_files[layout.weight_keys[spec.name]] == "model.safetensors"


def test_inspect_llama(dirs: dict[str, Path]) -> None:
    layout = inspect_model_dir(dirs["llama"])
    vocab = json.loads((dirs["llama"] / "config.json").read_text())["vocab_size"]
    expected = {"lm_head": (HIDDEN, vocab, False, False)}
    for b in range(2):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            expected[f"model.layers.{b}.self_attn.{p}"] = (HIDDEN, HIDDEN, False, False)
        expected[f"model.layers.{b}.mlp.gate_proj"] = (HIDDEN, 2 * HIDDEN, False, False)
        expected[f"model.layers.{b}.mlp.up_proj"] = (HIDDEN, 2 * HIDDEN, False, False)
        expected[f"model.layers.{b}.mlp.down_proj"] = (2 * HIDDEN, HIDDEN, False, False)
    assert shapes(layout) == expected
    assert layout.own_keys == {} and layout.bias_keys == {}
    assert layout.weight_keys == {name: f"{name}.weight" for name in expected}
    assert [s.block for s in layout.layers] == [0] * 7 + [1] * 7 + [None]
    assert_layout_matches_model(layout, dirs["llama"])
    assert ModelLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout


def test_inspect_tied_llama_points_lm_head_at_the_embedding(dirs: dict[str, Path]) -> None:
    layout = inspect_model_dir(dirs["llama_tied"])
    assert "lm_head.weight" not in layout.key_files, "a tied head is not stored twice"
    assert layout.weight_keys["lm_head"] == "model.embed_tokens.weight"
    assert layout.own_keys == {"lm_head": "lm_head.weight"}
    assert_layout_matches_model(layout, dirs["llama_tied"])


def test_inspect_gpt2_conv1d(dirs: dict[str, Path]) -> None:
    layout = inspect_model_dir(dirs["gpt2"])
    got = shapes(layout)
    assert got["transformer.h.0.attn.c_attn"] == (HIDDEN, 3 * HIDDEN, True, True)
    assert got["transformer.h.0.attn.c_proj"] == (HIDDEN, HIDDEN, True, True)
    assert got["transformer.h.1.mlp.c_fc"] == (HIDDEN, 4 * HIDDEN, True, True)
    assert got["transformer.h.1.mlp.c_proj"] == (4 * HIDDEN, HIDDEN, True, True)
    assert got["lm_head"] == (HIDDEN, 300, False, False) and len(got) == 9
    assert layout.bias_keys["transformer.h.1.mlp.c_fc"] == "transformer.h.1.mlp.c_fc.bias"
    assert layout.weight_keys["lm_head"] == "transformer.wte.weight"
    assert layout.own_keys == {"lm_head": "lm_head.weight"}
    assert_layout_matches_model(layout, dirs["gpt2"])


def test_inspect_bert_biased_linear(dirs: dict[str, Path]) -> None:
    layout = inspect_model_dir(dirs["bert"])
    got = shapes(layout)
    for p in ("query", "key", "value"):
        assert got[f"bert.encoder.layer.0.attention.self.{p}"] == (HIDDEN, HIDDEN, True, False)
    assert got["bert.encoder.layer.0.attention.output.dense"] == (HIDDEN, HIDDEN, True, False)
    assert got["bert.encoder.layer.1.intermediate.dense"] == (HIDDEN, 2 * HIDDEN, True, False)
    assert got["bert.encoder.layer.1.output.dense"] == (2 * HIDDEN, HIDDEN, True, False)
    assert all(bias for _, _, bias, _ in got.values())
    assert layout.own_keys == {"cls.predictions.decoder": "cls.predictions.decoder.weight"}
    assert layout.weight_keys["cls.predictions.decoder"] == "bert.embeddings.word_embeddings.weight"
    assert_layout_matches_model(layout, dirs["bert"])


# ------------------------------------------------------------------------------------- refusals


@pytest.fixture
def llama_copy(dirs: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(dirs["llama"], tmp_path / "copy"))


def test_directory_without_config_is_refused(llama_copy: Path) -> None:
    (llama_copy / "config.json").unlink()
    with pytest.raises(ModelSourceError, match="config.json"):
        inspect_model_dir(llama_copy)


def test_pickle_only_weights_are_refused(llama_copy: Path) -> None:
    tensors = load_file(str(llama_copy / "model.safetensors"))
    (llama_copy / "model.safetensors").unlink()
    torch.save(tensors, llama_copy / "pytorch_model.bin")
    with pytest.raises(ModelSourceError, match=r"pickle.*pytorch_model\.bin"):
        inspect_model_dir(llama_copy)
    with pytest.raises(ModelSourceError, match="pickle"):
        load_model(llama_copy)


def test_remote_code_is_refused(llama_copy: Path) -> None:
    config = json.loads((llama_copy / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (llama_copy / "config.json").write_text(json.dumps(config))
    (llama_copy / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ModelSourceError, match="remote code"):
        inspect_model_dir(llama_copy)


def test_unreadable_safetensors_is_refused(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelSourceError, match="safetensors"):
        inspect_model_dir(llama_copy)


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="not a directory"):
        inspect_model_dir(tmp_path / "absent")


# ------------------------------------------------------------------------------------- writing


def test_write_checkpoint_unties_an_edited_tied_head(dirs: dict[str, Path], tmp_path: Path) -> None:
    source = dirs["llama_tied"]
    layout = inspect_model_dir(source)
    edits_for, produced = edit_function(source, layout, EDITED)
    target = tmp_path / "variant"
    target.mkdir()
    edited_layers: list[int] = []
    write_checkpoint(source, target, layout, edits_for.one, edits_for.names, on_layer=lambda: edited_layers.append(1))
    assert set(produced) == set(EDITED) and len(edited_layers) == 2

    config = json.loads((target / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    model, info = AutoModelForCausalLM.from_pretrained(str(target), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    head, embed = model.lm_head.weight.detach(), model.model.embed_tokens.weight.detach()
    original = load_file(str(source / "model.safetensors"))
    assert torch.equal(head, produced["lm_head"].weight)
    assert torch.equal(embed, original["model.embed_tokens.weight"]), "the embedding keeps its original values"
    assert not torch.equal(head, embed)
    q_proj = model.model.layers[0].self_attn.q_proj.weight.detach()
    assert torch.equal(q_proj, produced["model.layers.0.self_attn.q_proj"].weight)

    written = tensors_of(target)
    changed = {"lm_head.weight", "model.layers.0.self_attn.q_proj.weight"}
    assert set(written) == set(original) | {"lm_head.weight"}
    for key, value in original.items():
        if key not in changed:
            assert torch.equal(written[key], value) and written[key].dtype == value.dtype, key
    for key in changed - {"lm_head.weight"}:
        assert not torch.equal(written[key], original[key]), key
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / side).exists():
            assert (target / side).read_bytes() == (source / side).read_bytes(), side


def test_write_checkpoint_of_a_sharded_tied_model_updates_the_index(dirs: dict[str, Path], tmp_path: Path) -> None:
    source = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(str(dirs["llama_tied"]))
    model.save_pretrained(source, max_shard_size="20KB")
    load_tokenizer(dirs["llama_tied"]).save_pretrained(source)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the fixture must really be sharded"
    layout = inspect_model_dir(source)
    edits_for, produced = edit_function(source, layout, EDITED)
    target = tmp_path / "variant"
    target.mkdir()
    write_checkpoint(source, target, layout, edits_for.one, edits_for.names)
    new_index = json.loads((target / "model.safetensors.index.json").read_text())
    assert new_index["weight_map"]["lm_head.weight"] == index["weight_map"]["model.embed_tokens.weight"]
    loaded = AutoModelForCausalLM.from_pretrained(str(target))
    assert torch.equal(loaded.lm_head.weight.detach(), produced["lm_head"].weight)
    assert torch.equal(loaded.model.embed_tokens.weight.detach(), model.model.embed_tokens.weight.detach())


def test_write_checkpoint_keeps_biases_in_their_own_shards(dirs: dict[str, Path], tmp_path: Path) -> None:
    """A layer whose weight and bias lie in different shards is no reason to untie the head."""
    source = tmp_path / "sharded"
    base = AutoModelForCausalLM.from_pretrained(str(dirs["gpt2"]))
    base.save_pretrained(source, max_shard_size="20KB")
    load_tokenizer(dirs["gpt2"]).save_pretrained(source)
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    layout = inspect_model_dir(source)
    split = [s for s in layout.layers if s.bias and index[layout.weight_keys[s.name]] != index[layout.bias_keys[s.name]]]
    assert split, "the fixture must split some layer's weight and bias across shards"
    names = tuple(s.name for s in layout.layers if s.name != "lm_head")
    edits_for, produced = edit_function(source, layout, names)
    target = tmp_path / "variant"
    target.mkdir()
    write_checkpoint(source, target, layout, edits_for.one, edits_for.names)

    assert json.loads((target / "config.json").read_text()).get("tie_word_embeddings", True) is True
    assert json.loads((target / "model.safetensors.index.json").read_text())["weight_map"] == index
    model, info = AutoModelForCausalLM.from_pretrained(str(target), output_loading_info=True)
    assert not info["missing_keys"], info
    wte = base.transformer.wte.weight.detach()
    assert torch.equal(model.lm_head.weight.detach(), wte), "the head is still the (unedited) embedding"
    modules = dict(model.named_modules())
    for name in names:
        assert torch.equal(modules[name].weight.detach(), produced[name].weight), name
        assert torch.equal(modules[name].bias.detach(), produced[name].bias), name


def test_write_checkpoint_unties_a_head_stored_under_its_own_key(dirs: dict[str, Path], tmp_path: Path) -> None:
    """A tied checkpoint may store the shared tensor as ``lm_head.weight``; editing the head must
    still leave the input embedding as it was."""
    source = Path(shutil.copytree(dirs["llama_tied"], tmp_path / "head-key"))
    tensors = load_file(str(source / "model.safetensors"))
    embedding = tensors.pop("model.embed_tokens.weight")
    tensors["lm_head.weight"] = embedding
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    layout = inspect_model_dir(source)
    assert layout.weight_keys["lm_head"] == "lm_head.weight"
    edits_for, produced = edit_function(source, layout, ("lm_head",))
    target = tmp_path / "variant"
    target.mkdir()
    write_checkpoint(source, target, layout, edits_for.one, edits_for.names)
    model = AutoModelForCausalLM.from_pretrained(str(target))
    assert torch.equal(model.lm_head.weight.detach(), produced["lm_head"].weight)
    assert torch.equal(model.model.embed_tokens.weight.detach(), embedding), "the embedding was edited too"


def test_write_checkpoint_of_bert_keeps_word_embeddings(dirs: dict[str, Path], tmp_path: Path) -> None:
    source = dirs["bert"]
    layout = inspect_model_dir(source)
    names = ("cls.predictions.decoder", "bert.encoder.layer.0.attention.self.query")
    edits_for, produced = edit_function(source, layout, names)
    target = tmp_path / "variant"
    target.mkdir()
    write_checkpoint(source, target, layout, edits_for.one, edits_for.names)
    model = AutoModelForMaskedLM.from_pretrained(str(target))
    decoder = model.cls.predictions.decoder
    assert torch.equal(decoder.weight.detach(), produced["cls.predictions.decoder"].weight)
    assert torch.equal(decoder.bias.detach(), produced["cls.predictions.decoder"].bias)
    query = model.bert.encoder.layer[0].attention.self.query
    assert torch.equal(query.bias.detach(), produced["bert.encoder.layer.0.attention.self.query"].bias)
    original = load_file(str(source / "model.safetensors"))["bert.embeddings.word_embeddings.weight"]
    assert torch.equal(model.bert.embeddings.word_embeddings.weight.detach(), original)


def test_write_delta_holds_exactly_the_changed_tensors(dirs: dict[str, Path], tmp_path: Path) -> None:
    source = dirs["llama_tied"]
    layout = inspect_model_dir(source)
    edits_for, produced = edit_function(source, layout, EDITED)
    delta_file = tmp_path / "delta.safetensors"
    write_delta(source, delta_file, layout, edits_for.one, edits_for.names, {"variant_id": "v1"})
    delta = load_file(str(delta_file))
    assert set(delta) == {"lm_head.weight", "model.layers.0.self_attn.q_proj.weight"}
    assert torch.equal(delta["lm_head.weight"], produced["lm_head"].weight)
    assert torch.equal(delta["model.layers.0.self_attn.q_proj.weight"], produced[EDITED[1]].weight)
    with safe_open(str(delta_file), framework="pt") as handle:
        meta = handle.metadata()
    assert meta["variant_id"] == "v1" and json.loads(meta["untied"]) is True

    # The documented recipe rebuilds exactly the full checkpoint's weights.
    target = tmp_path / "variant"
    target.mkdir()
    write_checkpoint(source, target, layout, edits_for.one, edits_for.names)
    full = AutoModelForCausalLM.from_pretrained(str(target))
    base = AutoModelForCausalLM.from_pretrained(str(source), tie_word_embeddings=False)
    result = base.load_state_dict(delta, strict=False)
    assert not result.unexpected_keys
    expected = full.state_dict()
    for key, value in base.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_write_delta_of_an_untied_model_says_untied_false(dirs: dict[str, Path], tmp_path: Path) -> None:
    source = dirs["llama"]
    layout = inspect_model_dir(source)
    edits_for, _ = edit_function(source, layout, EDITED)
    delta_file = tmp_path / "delta.safetensors"
    write_delta(source, delta_file, layout, edits_for.one, edits_for.names, {})
    with safe_open(str(delta_file), framework="pt") as handle:
        assert json.loads(handle.metadata()["untied"]) is False
        assert set(handle.keys()) == {"lm_head.weight", "model.layers.0.self_attn.q_proj.weight"}


# ------------------------------------------------------------------------------------- stats_io


def test_statistics_roundtrip(dirs: dict[str, Path], tmp_path: Path) -> None:
    stats = statistics(dirs["gpt2"], n_records=12)
    path = tmp_path / "stats.safetensors"
    save_statistics(stats, path, extra={"model_digest": "abc123", "max_length": "120"})
    loaded = load_statistics(path)
    assert loaded.layer_group == stats.layer_group
    assert loaded.counts == stats.counts
    assert set(loaded.sums) == set(stats.sums)
    for group, sigma in stats.sums.items():
        back = loaded.sums[group]
        assert back.dtype == torch.float64 and back.shape == sigma.shape
        assert torch.equal(back, back.T)
        # At most one rounding to float32 per entry (float64 storage is exact): |error| <= 2^-24 |value|.
        assert bool(((back - sigma).abs() <= 2.0**-24 * sigma.abs()).all()), group
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
    assert meta["model_digest"] == "abc123" and meta["max_length"] == "120"
    assert meta["format"] == "engram-stats/2"


def test_float32_statistics_take_half_the_bytes_and_one_rounding(dirs: dict[str, Path], tmp_path: Path) -> None:
    stats = statistics(dirs["gpt2"], n_records=12)
    exact, half = tmp_path / "f64.safetensors", tmp_path / "f32.safetensors"
    save_statistics(stats, exact)
    save_statistics(stats, half, dtype=torch.float32)
    assert 0.49 < half.stat().st_size / exact.stat().st_size < 0.52  # metadata is the rest
    loaded = load_statistics(half)
    for group, sigma in stats.sums.items():
        back = loaded.sums[group]
        assert back.dtype == torch.float64  # the algebra always works in float64
        assert bool(((back - sigma).abs() <= 2.0**-24 * sigma.abs()).all()), group
        assert not torch.equal(back, sigma), "float32 storage must actually round"
    with pytest.raises(ValueError, match="float64 or float32"):
        save_statistics(stats, tmp_path / "x.safetensors", dtype=torch.bfloat16)


def test_loading_a_non_statistics_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(3)}, str(path))
    with pytest.raises(ValueError, match="engram-stats"):
        load_statistics(path)
