"""The engram map of a tiny ResNet draws its convolutions inside the layer: per output channel and per
kernel position, for both measures, against a float64 reference that reshapes the engram to
``[C_out, C_in, kh, kw]`` (and ``Σ_U`` to ``[C_in, kh, kw, C_in, kh, kw]``) by itself, independently of
the service's column arithmetic; the PNG gets the two extra rows of panels.

Statistics are collected in the test from random pictures and published as a collection job would;
the map is computed by the ``map`` job's own function (:func:`service.maps.build.engram_map`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from engram_fixtures.statistics import name_digest, publish_concept_statistics
from engram_fixtures.vision import make_tiny_resnet
from service.engine.checkpoint import CheckpointReader, load_model
from service.engine.collect import LayerStatistics, PixelBatch, collect_statistics
from service.engine.layers import LayerSpec
from service.maps.build import engram_map
from service.maps.render import default_size, render_png
from service.models.registry import get_model
from tests.helpers.algebra import reference_pinv
from tests.helpers.store_world import StoreWorld

MODEL = "map/resnet"
CONCEPTS = {"forget": (16, 7), "retain": (48, 8)}  # name: (pictures, seed)
MAP_TOL = 1e-6  # relative, on ratios of float64 quantities (the float32 sums are the same inputs)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[StoreWorld, dict[str, LayerStatistics]]:
    torch.set_num_threads(1)
    w = StoreWorld(tmp_path_factory.mktemp("conv-map"))
    path = make_tiny_resnet(w.root / "models" / "resnet", seed=0)
    w.register(MODEL, path)
    layers = get_model(w.ctx, MODEL).layout.layers
    stats = {name: _publish(w, path, layers, name, count, seed) for name, (count, seed) in CONCEPTS.items()}
    return w, stats


def _publish(w: StoreWorld, path: Path, layers: Sequence[LayerSpec], name: str, count: int, seed: int) -> LayerStatistics:
    rng = np.random.default_rng(seed)
    pictures = [Image.fromarray(rng.integers(0, 256, (20 + i % 4, 24, 3), dtype=np.uint8)) for i in range(count)]
    pixels = AutoImageProcessor.from_pretrained(str(path))(images=pictures, return_tensors="pt")["pixel_values"]
    stats = collect_statistics(load_model(path), [PixelBatch(pixels)], layers)
    publish_concept_statistics(
        w.ctx, MODEL, name, stats, num_records=count, dataset_digest=name_digest(MODEL, name), scratch=w.root
    )
    return stats


def reference_breakdown(spec: LayerSpec, w: torch.Tensor, stats: dict[str, LayerStatistics], measure: str) -> Any:
    """Per channel and per kernel position of ``E = [W|b] Σ_f Σ_U⁺``, by reshaping, in float64."""
    assert spec.kernel is not None and not spec.bias  # the ResNet's convs have no bias
    sigma_f = stats["forget"].sum_for(spec.name).double()
    sigma_u = sigma_f + stats["retain"].sum_for(spec.name).double()
    engram = w @ sigma_f @ reference_pinv(sigma_u)
    c_in, (kh, kw) = spec.kernel.in_channels, spec.kernel.kernel_size
    e4, w4 = engram.reshape(-1, c_in, kh, kw), w.reshape(-1, c_in, kh, kw)
    s6 = sigma_u.reshape(c_in, kh, kw, c_in, kh, kw)
    if measure == "weight":
        channels = e4.flatten(1).norm(dim=1) / w4.flatten(1).norm(dim=1)
        kernel = e4.square().sum((0, 1)).sqrt() / w4.square().sum((0, 1)).sqrt()
    else:
        channels = (((engram @ sigma_u) * engram).sum(1) / ((w @ sigma_u) * w).sum(1)).sqrt()
        kernel = torch.empty(kh, kw, dtype=torch.float64)
        for i in range(kh):
            for j in range(kw):
                e_k, w_k, s_kk = e4[:, :, i, j], w4[:, :, i, j], s6[:, i, j, :, i, j]
                kernel[i, j] = (((e_k @ s_kk) * e_k).sum() / ((w_k @ s_kk) * w_k).sum()).sqrt()
    return channels, kernel


@pytest.mark.parametrize("measure", ["data", "weight"])
def test_each_conv_layer_is_drawn_per_channel_and_kernel_position(
    world: tuple[StoreWorld, dict[str, LayerStatistics]], measure: str
) -> None:
    w, stats = world
    model = get_model(w.ctx, MODEL)
    result = engram_map(w.ctx, MODEL, ["forget"], ["retain"], None, measure)
    convs = [spec for spec in model.layout.layers if spec.kernel is not None]
    assert len(convs) == 6 and set(result["conv"]["forget"]) == {spec.name for spec in convs}
    assert "classifier.1" not in result["conv"]["forget"]  # a Linear layer has no kernel
    reader = CheckpointReader(Path(model.path), model.layout)
    for spec in convs:
        drawn = result["conv"]["forget"][spec.name]
        assert spec.kernel is not None
        weight = reader.layer_weights(spec).weight.double().reshape(spec.out_features, -1)
        channels, kernel = reference_breakdown(spec, weight, stats, measure)
        assert len(drawn["channels"]) == spec.out_features
        assert [len(row) for row in drawn["kernel"]] == [spec.kernel.kernel_size[1]] * spec.kernel.kernel_size[0]
        got_channels, got_kernel = torch.tensor(drawn["channels"]), torch.tensor(drawn["kernel"])
        assert float((got_channels - channels).abs().max()) <= MAP_TOL * float(channels.abs().max()), spec.name
        assert float((got_kernel - kernel).abs().max()) <= MAP_TOL * float(kernel.abs().max()), spec.name
    # the 7×7 stem's corners read zero padding more than its centre: a position-dependent drawing
    stem = torch.tensor(result["conv"]["forget"]["resnet.embedder.embedder.convolution"]["kernel"])
    assert stem.shape == (7, 7) and float(stem.std()) > 0


def test_the_png_draws_the_conv_rows(world: tuple[StoreWorld, dict[str, LayerStatistics]]) -> None:
    w, _ = world
    result = engram_map(w.ctx, MODEL, ["forget", "retain"], None, None, "data")
    width, height = default_size(result)
    without = {k: v for k, v in result.items() if k != "conv"}
    assert height > default_size(without)[1]  # room for the channel and kernel rows
    png = Image.open(io.BytesIO(render_png(result, width, height)))
    assert png.size == (width, height)
    # the conv rows are drawn: the lower part of the image is not blank
    lower = np.asarray(png.convert("L"))[height // 2 :]
    assert lower.std() > 10
    blank = np.asarray(Image.open(io.BytesIO(render_png(without, width, height))).convert("L"))[height // 2 :]
    assert lower.std() > blank.std()
