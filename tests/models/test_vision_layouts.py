"""Image classifiers register with their convolutions as layers: a tiny ``ResNetForImageClassification``
and ``ViTForImageClassification`` (``engram_fixtures.vision``) through the registration job's own
function (no HTTP), their layouts listing every conv with its kernel (the ViT's patch embedding
among them), their statistics collected from images, and a variant with edited convs loading with
``from_pretrained``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import PeftModel
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoImageProcessor, AutoModelForImageClassification

from engram_fixtures.statistics import name_digest, publish_concept_statistics
from engram_fixtures.vision import make_tiny_resnet, make_tiny_vit
from service.engine.checkpoint import CheckpointReader, load_model
from service.engine.checkpoint_write import write_checkpoint
from service.engine.collect import LayerStatistics, PixelBatch, collect_statistics
from service.engine.compose import EngramAlgebra, layer_deltas, layer_editor
from service.engine.layers import module_type, select_layers
from service.engine.lora import layer_loras
from service.engine.lora_files import write_adapter
from service.models.registry import model_view
from service.storage.keys import model_key
from service.variants.service import submit_variant, variant_view
from tests.helpers.algebra import DELTA_TOL, WEIGHT_TOL, reference_pinv, rel
from tests.helpers.store_world import StoreWorld

RESNET_CONVS = {
    # name: (in_channels, kernel, stride, padding)
    "resnet.embedder.embedder.convolution": (3, [7, 7], [2, 2], [[3, 3], [3, 3]]),
    "resnet.encoder.stages.0.layers.0.layer.0.convolution": (8, [3, 3], [1, 1], [[1, 1], [1, 1]]),
    "resnet.encoder.stages.0.layers.0.layer.1.convolution": (8, [3, 3], [1, 1], [[1, 1], [1, 1]]),
    "resnet.encoder.stages.1.layers.0.shortcut.convolution": (8, [1, 1], [2, 2], [[0, 0], [0, 0]]),
    "resnet.encoder.stages.1.layers.0.layer.0.convolution": (8, [3, 3], [2, 2], [[1, 1], [1, 1]]),
    "resnet.encoder.stages.1.layers.0.layer.1.convolution": (16, [3, 3], [1, 1], [[1, 1], [1, 1]]),
}
PATCH_EMBEDDING = "vit.embeddings.patch_embeddings.projection"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> StoreWorld:
    torch.set_num_threads(1)
    world = StoreWorld(tmp_path_factory.mktemp("vision"))
    make_tiny_resnet(world.root / "models" / "resnet", seed=0)
    make_tiny_vit(world.root / "models" / "vit", seed=0)
    return world


@pytest.fixture(scope="module")
def registered(world: StoreWorld) -> dict[str, Any]:
    return {name: world.register(f"tiny/{name}", world.root / "models" / name) for name in ("resnet", "vit")}


def pictures(count: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (20 + i, 24, 3), dtype=np.uint8)) for i in range(count)]


def pixels(path: Path, count: int, seed: int) -> torch.Tensor:
    processor = AutoImageProcessor.from_pretrained(str(path))
    return processor(images=pictures(count, seed), return_tensors="pt")["pixel_values"]


def test_a_resnet_lists_every_conv_with_its_kernel(world: StoreWorld, registered: dict[str, Any]) -> None:
    layout = registered["resnet"].layout
    assert [s.name for s in layout.layers] == [*RESNET_CONVS, "classifier.1"]
    assert layout.refused_layers == {} and layout.unstored_layers == []
    for name, (channels, kernel, stride, padding) in RESNET_CONVS.items():
        spec = layout.layer(name)
        assert spec.kernel is not None and spec.kernel.kind == "conv2d", name
        assert (spec.kernel.in_channels, list(spec.kernel.kernel_size), list(spec.kernel.stride)) == (
            channels,
            kernel,
            stride,
        )
        assert [list(p) for p in spec.kernel.padding] == padding, name
        assert spec.in_features == channels * kernel[0] * kernel[1] and not spec.bias, name
    assert layout.layer("classifier.1").kernel is None
    stored = world.ctx.storage.get_json(model_key("tiny/resnet"))["layout"]["layers"]
    assert stored[0]["kernel"]["kernel_size"] == [7, 7] and "kernel" not in stored[-1]
    assert [layer["name"] for layer in model_view(registered["resnet"])["layers"]] == [*RESNET_CONVS, "classifier.1"]
    # residual blocks numbered across the stages (the parsed `layers.<l>` restarts in every stage),
    # so a map's grid and calibration's layer ranges see two blocks, not one twice
    assert [s.block for s in layout.layers] == [None, 0, 0, 1, 1, 1, None]
    assert {module_type(s.name) for s in layout.layers if s.block is not None} == {
        "layer.0.convolution",
        "layer.1.convolution",
        "shortcut.convolution",
    }
    # convs are chosen by their module names, as Linear layers are
    assert {s.name for s in select_layers(layout.layers, ["convolution"])} == set(RESNET_CONVS)
    assert [s.name for s in select_layers(layout.layers, ["shortcut.convolution"])] == [
        "resnet.encoder.stages.1.layers.0.shortcut.convolution"
    ]


def test_a_vit_lists_its_patch_embedding_as_a_conv(registered: dict[str, Any]) -> None:
    layout = registered["vit"].layout
    spec = layout.layer(PATCH_EMBEDDING)
    assert spec.kernel is not None
    assert list(spec.kernel.kernel_size) == list(spec.kernel.stride) == [4, 4]
    assert spec.in_features == 3 * 4 * 4 and spec.out_features == 32 and spec.bias
    assert len(layout.layers) == 1 + 2 * 6 + 1  # the patch embedding, 6 Linear per block, the head
    assert [s.name for s in select_layers(layout.layers, ["patch_embeddings.projection"])] == [PATCH_EMBEDDING]


@pytest.mark.parametrize("name", ["resnet", "vit"])
def test_images_give_every_layer_statistics(world: StoreWorld, registered: dict[str, Any], name: str) -> None:
    """Every conv counts its output positions, every ViT Linear its tokens (16 patches + [CLS])."""
    path = world.root / "models" / name
    layout = registered[name].layout
    model = load_model(path)
    images = pixels(path, 5, seed=1)
    assert images.shape == (5, 3, 16, 16)
    stats = collect_statistics(model, [PixelBatch(images[:3]), PixelBatch(images[3:])], layout.layers)
    assert stats.lacking == [] and stats.unreached == []
    counts = {spec.name: stats.counts[stats.layer_group[spec.name]] for spec in layout.layers}
    if name == "resnet":
        assert counts["resnet.embedder.embedder.convolution"] == 5 * 8 * 8
        assert counts["resnet.encoder.stages.0.layers.0.layer.0.convolution"] == 5 * 4 * 4  # after the max pool
        assert counts["resnet.encoder.stages.1.layers.0.shortcut.convolution"] == 5 * 2 * 2
        assert counts["classifier.1"] == 5
    else:
        assert counts[PATCH_EMBEDDING] == 5 * 16
        assert counts["vit.layers.0.attention.q_proj"] == 5 * 17
        assert counts["classifier"] == 5  # it reads the [CLS] row only


def test_a_variant_with_edited_convs_loads_with_from_pretrained(
    world: StoreWorld, registered: dict[str, Any], tmp_path: Path
) -> None:
    path = world.root / "models" / "resnet"
    layout = registered["resnet"].layout
    model = load_model(path)
    forget = collect_statistics(model, [PixelBatch(pixels(path, 4, seed=2))], layout.layers)
    retain = collect_statistics(model, [PixelBatch(pixels(path, 8, seed=3))], layout.layers)
    reader = CheckpointReader(path, layout)
    algebra = EngramAlgebra(terms=[(-1.0, forget)], universe=[forget, retain])
    scales = {spec.name: 1.0 for spec in layout.layers}
    edit = layer_editor(algebra, reader.layer_weights, scales)
    (tmp_path / "variant").mkdir()
    write_checkpoint(path, tmp_path / "variant", layout, edit, set(scales))
    assert (tmp_path / "variant" / "preprocessor_config.json").read_bytes() == (
        path / "preprocessor_config.json"
    ).read_bytes()
    variant = AutoModelForImageClassification.from_pretrained(str(tmp_path / "variant"))
    params = dict(variant.named_parameters())
    for spec in layout.layers:
        expected = edit(spec)
        assert expected is not None
        assert torch.equal(params[f"{spec.name}.weight"].detach(), expected.weight), spec.name
        assert not torch.equal(expected.weight, reader.layer_weights(spec).weight), spec.name


@pytest.mark.parametrize("name", ["resnet", "vit"])
def test_a_peft_adapter_of_conv_edits_serves_like_the_checkpoint_variant(
    world: StoreWorld, registered: dict[str, Any], name: str, tmp_path: Path
) -> None:
    """The conv layers' LoRA in peft's conv shapes: ``PeftModel`` loads it, its ``B·A`` per layer is
    the checkpoint variant's change, and served unmerged it gives the variant's logits."""
    path = world.root / "models" / name
    layout = registered[name].layout
    model = load_model(path)
    forget = collect_statistics(model, [PixelBatch(pixels(path, 2, seed=4))], layout.layers)
    retain = collect_statistics(model, [PixelBatch(pixels(path, 6, seed=5))], layout.layers)
    reader = CheckpointReader(path, layout)
    algebra = EngramAlgebra(terms=[(-1.0, forget)], universe=[forget, retain])
    layers = [spec for spec in layout.layers if spec.kernel is not None] + [layout.layers[-1]]  # convs, the head
    scales = {spec.name: 1.0 for spec in layers}
    (tmp_path / "adapter").mkdir()
    loras = layer_loras(layer_deltas(layers, algebra, reader.layer_weights, scales))
    report = write_adapter(tmp_path / "adapter", f"tiny/{name}", loras, task_type=None)
    assert report.totals.max_relative_error < 1e-5  # singular values under EXACT_RTOL · σ₁ dropped
    (tmp_path / "variant").mkdir()
    write_checkpoint(path, tmp_path / "variant", layout, layer_editor(algebra, reader.layer_weights, scales), set(scales))

    base = AutoModelForImageClassification.from_pretrained(str(path)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on the adapter-wide lora_bias of a bias-free layer
        served = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    variant = AutoModelForImageClassification.from_pretrained(str(tmp_path / "variant")).eval()
    probe = pixels(path, 3, seed=6)
    modules, edited = dict(served.named_modules()), dict(variant.named_parameters())
    for spec in layers:
        wrapped = modules[f"base_model.model.{spec.name}"]
        change = edited[f"{spec.name}.weight"].detach() - reader.layer_weights(spec).weight
        delta = wrapped.get_delta_weight("default").detach()
        assert delta.shape == change.shape, spec.name
        assert float((delta - change).norm()) < 1e-5 * float(change.norm()), spec.name
    with torch.no_grad():
        expected, unmerged = variant(pixel_values=probe).logits, served(pixel_values=probe).logits
    assert float((unmerged - expected).norm()) < 1e-4 * float(expected.norm())


def publish_images(world: StoreWorld, model_id: str, name: str, stats: LayerStatistics, images: int) -> None:
    """Publish a concept's image statistics, collected in the test, as a collection job would."""
    digest = name_digest(model_id, name)
    publish_concept_statistics(
        world.ctx, model_id, name, stats, num_records=images, dataset_digest=digest, scratch=world.root
    )


def test_a_resnet_variant_from_a_built_universe_equals_the_float64_formula(
    world: StoreWorld, registered: dict[str, Any]
) -> None:
    """Through the real job bodies (universe build, stored float32 engrams, the checkpoint written
    by arithmetic): every conv and the head within WEIGHT_TOL of ``W − W·Σ_f·(Σ_f + Σ_r)⁺`` on the
    published sums (measured ≤ 4e-8). Enough images that every layer sees more output positions
    than its patch is wide (with fewer, the universe is rank-deficient and its conditioning, not the
    unfold, sets the error)."""
    path = world.root / "models" / "resnet"
    layout = registered["resnet"].layout
    model = load_model(path)
    stats = {}
    for name, (count, seed) in {"forget": (24, 7), "retain": (64, 8)}.items():
        stats[name] = collect_statistics(model, [PixelBatch(pixels(path, count, seed))], layout.layers)
        publish_images(world, "tiny/resnet", name, stats[name], count)
    options = {"scaling": "uniform", "format": "checkpoint", "reference": ["forget", "retain"]}
    view, job = submit_variant(world.ctx, "tiny/resnet", {"forget": -1.0}, None, options)
    assert job is not None
    world.run_pending()
    assert variant_view(world.ctx, view.variant_id).status == "ready"
    files = world.ctx.storage.local_path(f"variants/{view.variant_id}/files/model.safetensors")
    tensors = load_file(str(files))
    reader = CheckpointReader(path, layout)
    for spec in layout.layers:
        base = reader.layer_weights(spec)
        old = base.weight.double().reshape(spec.out_features, -1)
        new = tensors[layout.weight_keys[spec.name]].double().reshape(spec.out_features, -1)
        if spec.bias:
            assert base.bias is not None
            old = torch.cat([old, base.bias.double()[:, None]], dim=1)
            new = torch.cat([new, tensors[layout.bias_keys[spec.name]].double()[:, None]], dim=1)
        sigma_f, sigma_r = stats["forget"].sum_for(spec.name).double(), stats["retain"].sum_for(spec.name).double()
        expected = old - old @ sigma_f @ reference_pinv(sigma_f + sigma_r)
        assert rel(new, expected) < WEIGHT_TOL, spec.name
        assert rel(new - old, expected - old) < DELTA_TOL, spec.name
