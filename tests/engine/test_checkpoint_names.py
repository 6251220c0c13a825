"""Checkpoints whose keys are not the loaded model's parameter names, and layers a checkpoint lacks.

transformers renames keys as it loads them (old module names, the base model's prefix); a layer
stored under such a key must be edited like any other, and written back under the stored key. A
layer the checkpoint does not store at all is listed, never silently dropped; an encoder-decoder
model is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, T5Config, T5ForConditionalGeneration

from engram_fixtures.models import make_tiny_gpt_neox, make_tiny_llama, make_tokenizer
from service.config import Settings
from service.engine.checkpoint import CheckpointReader, inspect_model_dir
from service.engine.model_files import ModelSourceError
from service.models.record import ModelRecord
from service.models.registry import model_view
from service.statistics.spec import CollectionSpec


def _rewrite_keys(folder: Path, rename: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> None:
    stored = load_file(str(folder / "model.safetensors"))
    stored = {(rename or {}).get(k, k): v for k, v in stored.items() if k not in drop}
    save_file(stored, str(folder / "model.safetensors"), {"format": "pt"})


def _loaded_parameters(folder: Path) -> dict[str, torch.Tensor]:
    return dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())


def test_a_head_stored_under_its_old_name_is_an_editable_layer(tmp_path: Path) -> None:
    folder = make_tiny_gpt_neox(tmp_path / "neox")
    assert "embed_out.weight" in load_file(str(folder / "model.safetensors"))
    layout = inspect_model_dir(folder)
    assert "lm_head" in [spec.name for spec in layout.layers]
    assert layout.weight_keys["lm_head"] == "embed_out.weight"
    assert layout.renamed_layers == ["lm_head"]
    assert layout.unstored_layers == []
    # What the reader reads under the stored key is what transformers loads into the head.
    read = CheckpointReader(folder, layout).layer_weights(layout.layer("lm_head")).weight
    assert torch.equal(read, _loaded_parameters(folder)["lm_head.weight"])


def test_a_checkpoint_saved_without_the_base_model_prefix_keeps_every_layer(tmp_path: Path) -> None:
    """A ``LlamaModel``-style checkpoint (``layers.0.…``, no ``model.``) under a causal-LM config:
    transformers adds the prefix on load, and so does the layout."""
    folder = make_tiny_llama(tmp_path / "llama")
    before = inspect_model_dir(folder)
    keys = load_file(str(folder / "model.safetensors"))
    _rewrite_keys(folder, {k: k.removeprefix("model.") for k in keys})
    layout = inspect_model_dir(folder)
    assert [s.name for s in layout.layers] == [s.name for s in before.layers]
    decoder = [s.name for s in layout.layers if s.name != "lm_head"]
    assert layout.renamed_layers == decoder
    assert layout.weight_keys["model.layers.0.self_attn.q_proj"] == "layers.0.self_attn.q_proj.weight"
    reader, loaded = CheckpointReader(folder, layout), _loaded_parameters(folder)
    for name in decoder:
        assert torch.equal(reader.layer_weights(layout.layer(name)).weight, loaded[f"{name}.weight"]), name


def test_a_layer_the_checkpoint_lacks_is_listed_not_dropped(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "llama")  # untied head
    _rewrite_keys(folder, drop=("lm_head.weight",))
    layout = inspect_model_dir(folder)
    assert "lm_head" not in [spec.name for spec in layout.layers]
    assert layout.unstored_layers == ["lm_head"]
    manifest = ModelRecord.model_validate(  # the registration as the registry reads it
        {
            "model_id": "m",
            "source": "file:///m",
            "path": "/m",
            "digest": "d",
            "architecture": layout.architecture,
            "num_parameters": layout.num_parameters,
            "layout": layout.to_json(),
        }
    )
    assert model_view(manifest)["layers_not_in_checkpoint"] == ["lm_head"]


def test_an_encoder_decoder_model_is_refused_by_name(tmp_path: Path) -> None:
    tokenizer = make_tokenizer()
    config = T5Config(
        vocab_size=len(tokenizer), d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, decoder_start_token_id=0
    )
    folder = tmp_path / "t5"
    T5ForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with pytest.raises(ModelSourceError, match="T5ForConditionalGeneration is an encoder-decoder model"):
        inspect_model_dir(folder)


def test_the_collected_layers_enter_the_statistics_key_only_with_a_renamed_layer(tmp_path: Path) -> None:
    """Statistics of GPT-NeoX collected before its head was edited lack the head: a key of their own
    keeps them from being reused; every other model keeps the key it had."""
    settings = Settings()
    neox = inspect_model_dir(make_tiny_gpt_neox(tmp_path / "neox"))
    llama = inspect_model_dir(make_tiny_llama(tmp_path / "llama"))
    assert "layers" in CollectionSpec.of(settings, layout=neox).dump()
    assert "layers" not in CollectionSpec.of(settings, modules=["dense_h_to_4h"], layout=neox).dump()  # no head collected
    assert CollectionSpec.of(settings, layout=llama).dump() == CollectionSpec.of(settings).dump()
