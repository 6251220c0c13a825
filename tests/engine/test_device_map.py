"""Collection of a model placed by accelerate's ``device_map`` (``ENGRAM_DEVICE_MAP=auto``).

The statistics must equal those of the whole model on one device: each layer's accumulators live on
the device its input arrives on, products stay float32 and sums float64. On the CPU, ``"auto"``
places everything on the CPU and the statistics are identical (asserted to 1e-12 relative; measured
0). On a GPU machine, the model is spread over the GPUs (two or more) or over GPU 0 and the CPU
(offloaded layers run on GPU 0), and must equal the CPU's statistics to float32 accuracy (1e-5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engram_fixtures.models import make_tiny_bert_encoder, make_tiny_llama, make_tokenizer
from service.engine.checkpoint import ModelTooLarge, load_model, load_tokenizer
from service.engine.collect import LayerStatistics
from tests.helpers.collection import collect, mixed_records, rel_error


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("device-map-models")
    return {
        "llama": make_tiny_llama(root / "llama", hidden=32, layers=4, seed=1, tokenizer=make_tokenizer()),
        "bert_pooler": make_tiny_bert_encoder(root / "bert-pooler", hidden=32, layers=2, seed=4),
    }


def assert_same_statistics(actual: LayerStatistics, expected: LayerStatistics, tolerance: float) -> None:
    assert actual.layer_group == expected.layer_group
    assert actual.counts == expected.counts
    assert actual.lacking == expected.lacking == []
    assert set(actual.factors) == set(expected.factors)
    for group, sigma in expected.sums.items():
        got = actual.sums[group]
        assert got.dtype == torch.float64 and got.device.type == "cpu", group
        err = rel_error(got, sigma)
        assert err <= tolerance, f"{group}: relative error {err:.2e} > {tolerance}"


@pytest.mark.parametrize("arch", ["llama", "bert_pooler"])
def test_auto_device_map_on_cpu_equals_single_device(model_dirs: dict[str, Path], arch: str) -> None:
    path = model_dirs[arch]
    tokenizer, records = load_tokenizer(path), mixed_records(seed=1)
    single = collect(load_model(path), tokenizer, records, batch_size=4)
    mapped_model = load_model(path, device_map="auto")
    assert {p.device.type for p in mapped_model.parameters()} == {"cpu"}
    mapped = collect(mapped_model, tokenizer, records, batch_size=4)
    assert_same_statistics(mapped, single, tolerance=1e-12)
    assert set(mapped.devices.values()) == {"cpu"}


def test_a_placement_that_needs_disk_offload_is_refused(model_dirs: dict[str, Path]) -> None:
    """accelerate would offload to disk when the CPU budget is too small; collection refuses that
    (the weights would be read later through a view that no longer exists) and says why."""
    with pytest.raises(ModelTooLarge, match="does not fit"):
        load_model(model_dirs["llama"], device_map="auto", max_memory={"cpu": "20KiB"})


# ---------------------------------------------------------------- across devices (GPU machines)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none; run on a GPU machine)")


def _spread(model_dir: Path) -> tuple[dict[str, Any], set[str]]:
    """A device map over two GPUs when there are, else GPU 0 and the CPU (offloaded, run on GPU 0);
    returns it and the devices the accumulators must end up on."""
    blocks = [f"model.layers.{i}" for i in range(4)]
    if torch.cuda.device_count() >= 2:
        first, second = 0, 1
        expected = {"cuda:0", "cuda:1"}
    else:
        first, second = 0, "cpu"
        expected = {"cuda:0"}
    placement: dict[str, Any] = {"model.embed_tokens": first, "model.rotary_emb": first}
    placement.update(dict.fromkeys(blocks[:2], first))
    placement.update(dict.fromkeys(blocks[2:], second))
    placement.update({"model.norm": second, "lm_head": second})
    return placement, expected


@pytest.mark.gpu
@CUDA
def test_collection_across_devices_equals_one_device(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama"]
    tokenizer, records = load_tokenizer(path), mixed_records(seed=2)
    on_cpu = collect(load_model(path), tokenizer, records, batch_size=4)
    placement, devices = _spread(path)
    model = load_model(path, device_map=placement)
    assert len(set(model.hf_device_map.values())) == 2, model.hf_device_map
    spread = collect(model, tokenizer, records, batch_size=4)
    assert_same_statistics(spread, on_cpu, tolerance=1e-5)
    assert set(spread.devices.values()) == devices, spread.devices


@pytest.mark.gpu
@CUDA
def test_auto_device_map_on_gpu_equals_cpu(model_dirs: dict[str, Path]) -> None:
    """``ENGRAM_DEVICE_MAP=auto`` as a worker runs it, with GPU 0 limited so that part of the model is
    placed on the next GPU or offloaded to the CPU."""
    path = model_dirs["llama"]
    tokenizer, records = load_tokenizer(path), mixed_records(seed=3)
    on_cpu = collect(load_model(path), tokenizer, records, batch_size=4)
    budget = dict.fromkeys(range(torch.cuda.device_count()), "150KiB") | {"cpu": "8GiB"}
    model: nn.Module = load_model(path, device_map="auto", max_memory=budget)
    assert len(set(model.hf_device_map.values())) >= 2, model.hf_device_map
    assert_same_statistics(collect(model, tokenizer, records, batch_size=4), on_cpu, tolerance=1e-5)
