"""What a peft variant's files let a user do with peft alone, through the variant service's jobs:

- a tiny ResNet's adapter (bias-free convs beside a biased head) merges with ``merge_and_unload``
  into the checkpoint variant's weights and biases: no adapter-wide ``lora_bias`` (peft refuses to
  merge one into a layer without a bias), the head's edited bias stored whole (``bias="lora_only"``);
- ``adapter_base_model`` names the base the adapter's config points to, so that
  ``AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`` loads a local base offline and equals the
  checkpoint variant; without it, the service's model ID is written and the report says it is
  neither a folder nor a hub name; an ``hf://`` model names its hub name and revision;
- the option is refused, changing nothing, outside format ``peft`` or when it is not one printable line.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel
from PIL import Image
from pydantic import ValidationError
from transformers import AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageClassification

from api_schemas import UnlearnRequest, Variant
from engram_fixtures.models import make_tiny_llama, make_tokenizer
from engram_fixtures.statistics import name_digest, publish_concept_statistics
from engram_fixtures.vision import make_tiny_resnet
from service.engine.checkpoint import load_model
from service.engine.collect import PixelBatch, collect_statistics
from service.engine.layers import LayerSpec
from service.engine.lora_files import adapter_base
from service.errors import InvalidInput
from service.models.registry import get_model
from tests.helpers.peft import assert_same_parameters
from tests.helpers.store_world import StoreWorld, text_records
from tests.helpers.variants import run_variant

RESNET, LLAMA = "peft/resnet", "peft/llama"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> StoreWorld:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("peft-outputs")
    w = StoreWorld(root)
    w.register(RESNET, make_tiny_resnet(root / "models" / "resnet", seed=0))
    w.register(LLAMA, make_tiny_llama(root / "models" / "llama", hidden=32, layers=2, seed=0, tokenizer=make_tokenizer()))
    w.publish(LLAMA, "forget", text_records(0, 20))
    w.publish(LLAMA, "retain", text_records(20, 60))
    layers = get_model(w.ctx, RESNET).layout.layers
    _publish_images(w, layers, "forget", count=24, seed=7)
    _publish_images(w, layers, "retain", count=64, seed=8)
    return w


def _publish_images(w: StoreWorld, layers: Sequence[LayerSpec], name: str, count: int, seed: int) -> None:
    """A concept of random pictures on the ResNet, collected and published as a collection job would."""
    path = w.root / "models" / "resnet"
    rng = np.random.default_rng(seed)
    pictures = [Image.fromarray(rng.integers(0, 256, (20 + i % 5, 24, 3), dtype=np.uint8)) for i in range(count)]
    pixels = AutoImageProcessor.from_pretrained(str(path))(images=pictures, return_tensors="pt")["pixel_values"]
    stats = collect_statistics(load_model(path), [PixelBatch(pixels)], layers)
    digest = name_digest(RESNET, name)
    publish_concept_statistics(w.ctx, RESNET, name, stats, num_records=count, dataset_digest=digest, scratch=w.root)


def unlearn(w: StoreWorld, model_id: str, **options: Any) -> Variant:
    """Forget ``forget`` in the universe {forget, retain}; the variant once its job has run."""
    options = {"scaling": "uniform", "reference": ["forget", "retain"], **options}
    return run_variant(w, model_id, {"forget": -1.0}, 1.0, options)


def variant_dir(w: StoreWorld, variant_id: str, marker: str) -> Path:
    """The variant's files as the store holds them (a folder, as a download would give)."""
    path = w.ctx.storage.local_path(f"variants/{variant_id}/files/{marker}")
    assert path is not None
    return path.parent


def test_a_resnet_adapter_merges_into_the_checkpoint_variant(world: StoreWorld) -> None:
    """Convs without a bias and a biased head in one adapter: ``merge_and_unload`` works (it raised
    "Impossible to merge LoRA with `lora_bias=True`" on the adapter-wide lora_bias) and gives every
    conv weight, the head's weight and the head's bias of the checkpoint variant."""
    path = world.root / "models" / "resnet"
    checkpoint = unlearn(world, RESNET, format="checkpoint")
    adapter = unlearn(world, RESNET, format="peft")
    report = adapter.lora
    assert report["bias"] == "base_bias" and report["mergeable"] is True
    assert any("classifier.1" in note and "disable_adapter" in note for note in report["notes"])
    adapter_path = variant_dir(world, adapter.variant_id, "adapter_config.json")
    variant = AutoModelForImageClassification.from_pretrained(
        str(variant_dir(world, checkpoint.variant_id, "model.safetensors"))
    )
    base = AutoModelForImageClassification.from_pretrained(str(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = PeftModel.from_pretrained(AutoModelForImageClassification.from_pretrained(str(path)), adapter_path)
    assert not [w for w in caught if "bias" in str(w.message)]  # peft warned of lora_bias on a bias-free conv
    config = served.peft_config["default"]
    assert isinstance(config, LoraConfig)
    assert (config.lora_bias, config.bias, config.task_type) == (False, "lora_only", None)
    probe = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unmerged, expected = served.eval()(pixel_values=probe).logits, variant.eval()(pixel_values=probe).logits
    assert float((unmerged - expected).norm()) < 1e-4 * float(expected.norm())
    moved = assert_same_parameters(served.merge_and_unload(), variant, base)
    assert "classifier.1.bias" in moved and "classifier.1.weight" in moved
    assert sum(name.endswith("convolution.weight") for name in moved) == 6


def test_adapter_base_model_lets_auto_peft_load_a_local_base_offline(
    world: StoreWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``adapter_base_model`` = the base's folder: the adapter alone loads with
    ``AutoPeftModelForCausalLM`` (no hub: offline), and merged equals the checkpoint variant."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = world.root / "models" / "llama"
    adapter = unlearn(world, LLAMA, format="peft", adapter_base_model=str(path))
    assert adapter.lora["base_model_name_or_path"] == str(path)
    assert not any("model ID" in note for note in adapter.lora["notes"])
    checkpoint = unlearn(world, LLAMA, format="checkpoint")
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(variant_dir(world, adapter.variant_id, "adapter_config.json")))
    assert loaded.peft_config["default"].base_model_name_or_path == str(path)
    variant = AutoModelForCausalLM.from_pretrained(str(variant_dir(world, checkpoint.variant_id, "model.safetensors")))
    moved = assert_same_parameters(loaded.merge_and_unload(), variant, AutoModelForCausalLM.from_pretrained(str(path)))
    assert moved, "the edit must move weights"


def test_without_the_option_the_adapter_names_the_model_id_and_says_so(world: StoreWorld) -> None:
    default = unlearn(world, LLAMA, format="peft")
    config = world.ctx.storage.get_json(f"variants/{default.variant_id}/files/adapter_config.json")
    assert (config["base_model_name_or_path"], config["revision"]) == (LLAMA, None)
    [note] = [note for note in default.lora["notes"] if "model ID" in note]
    assert LLAMA in note and "adapter_base_model" in note and "PeftModel.from_pretrained(base" in note
    named = unlearn(world, LLAMA, format="peft", adapter_base_model="org/tiny-llama")
    assert named.variant_id != default.variant_id  # its config differs, so it is another variant
    config = world.ctx.storage.get_json(f"variants/{named.variant_id}/files/adapter_config.json")
    assert config["base_model_name_or_path"] == "org/tiny-llama"
    assert unlearn(world, LLAMA, format="peft", adapter_base_model="org/tiny-llama").variant_id == named.variant_id


def test_the_base_a_model_names_by_default() -> None:
    hub = adapter_base("my/llama", "hf://meta-llama/Llama-3.2-1B@refs/pr/3")
    assert (hub.name, hub.revision, hub.note) == ("meta-llama/Llama-3.2-1B", "refs/pr/3", None)
    assert (adapter_base("gpt2", "hf://gpt2").name, adapter_base("gpt2", "hf://gpt2").revision) == ("gpt2", None)
    local = adapter_base("my/llama", "file:///models/llama")
    assert local.name == "my/llama" and local.note is not None and "not a folder or hub name" in local.note
    assert adapter_base("my/llama", "s3://bucket/llama/").note is not None
    given = adapter_base("my/llama", "hf://org/other", requested="/srv/llama")
    assert (given.name, given.revision, given.note) == ("/srv/llama", None, None)


@pytest.mark.parametrize(
    ("options", "mention"),
    [
        ({"format": "checkpoint", "adapter_base_model": "/srv/llama"}, 'format "peft" only'),
        ({"format": "delta", "adapter_base_model": "/srv/llama"}, 'format "peft" only'),
        ({"format": "peft", "adapter_base_model": "org/llama\nrevision: x"}, "one printable line"),
        ({"format": "peft", "adapter_base_model": "a\x00b"}, "one printable line"),
        ({"format": "peft", "adapter_base_model": ""}, "at least 1 character"),
        ({"format": "peft", "adapter_base_model": "x" * 1001}, "at most 1000 characters"),
    ],
)
def test_a_bad_adapter_base_model_is_refused_and_changes_nothing(
    world: StoreWorld, options: dict[str, Any], mention: str
) -> None:
    root = world.root / "store"
    before = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    with pytest.raises(InvalidInput, match="adapter_base_model") as refused:
        unlearn(world, LLAMA, **options)
    assert mention in refused.value.detail
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == before
    with pytest.raises(ValidationError, match=mention):  # the route's own schema says the same
        UnlearnRequest.model_validate({"concepts": ["forget"], **options})
