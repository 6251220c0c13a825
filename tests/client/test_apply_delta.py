"""``engram apply-delta`` / :func:`engram_client.deltas.apply_delta` on local folders (issue 28).

The result is checked against an independent computation: the base's tensors loaded with
``safetensors.torch``, the delta's written over them in Python, compared exactly (bfloat16 too);
a sharded base keeps its layout (only the shard holding a changed tensor is rewritten, the others
byte for byte); a delta that does not fit is refused by name and leaves nothing behind. The e2e
check against the service's own checkpoint variant is in ``test_apply_delta_e2e.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engram_client.deltas import DeltaError, apply_delta
from engram_fixtures.models import make_tiny_llama
from tests.helpers.cli import failed, ok, run_cli

pytestmark = pytest.mark.fast

DOWN = "model.layers.1.mlp.down_proj.weight"
Q = "model.layers.1.self_attn.q_proj.weight"  # in another shard than DOWN when sharded at 20 KB


def all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (one file or shards), read with safetensors itself."""
    found: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def write_delta(path: Path, tensors: dict[str, torch.Tensor], untied: bool = False) -> Path:
    save_file(tensors, path, metadata={"variant_id": "v-test", "untied": json.dumps(untied)})
    return path


def changed(base: dict[str, torch.Tensor], keys: list[str], seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: torch.randn(base[k].shape, generator=generator).to(base[k].dtype) for k in keys}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("base") / "tiny", hidden=32, layers=2)


@pytest.fixture(scope="module")
def sharded(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sharded") / "tiny"
    AutoModelForCausalLM.from_pretrained(base).save_pretrained(folder, max_shard_size="20KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((base / name).read_bytes())
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def test_a_delta_replaces_its_tensors_and_copies_everything_else(base: Path, tmp_path: Path) -> None:
    before = all_tensors(base)
    new = changed(before, [DOWN, Q])
    report = apply_delta(base, write_delta(tmp_path / "delta.safetensors", new), tmp_path / "out")

    after = all_tensors(tmp_path / "out")
    assert after.keys() == before.keys()
    for key, value in after.items():
        assert torch.equal(value, new.get(key, before[key])), key
    assert report.replaced == {DOWN: "model.safetensors", Q: "model.safetensors"} and not report.untied
    others = {p.name for p in base.iterdir()} - {"model.safetensors"}
    assert others and all((tmp_path / "out" / n).read_bytes() == (base / n).read_bytes() for n in others)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as handle:
        assert handle.metadata() == load_metadata(base / "model.safetensors")  # the base's, not the delta's

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(model.state_dict()[DOWN], new[DOWN])


def load_metadata(path: Path) -> dict[str, str] | None:
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata()


def test_bfloat16_tensors_are_replaced_exactly(tmp_path: Path) -> None:
    folder = tmp_path / "bf16"
    folder.mkdir()
    tensors = {"a": torch.randn(3, 5).bfloat16(), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2).half()}
    save_file(tensors, folder / "model.safetensors")
    new = {"a": torch.randn(3, 5).bfloat16(), "c": torch.tensor([1.5, -2.0]).half()}
    apply_delta(folder, write_delta(tmp_path / "d.safetensors", new), tmp_path / "out")
    result = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(result["a"], new["a"]) and torch.equal(result["c"], new["c"])
    assert torch.equal(result["b"], tensors["b"])


def test_a_sharded_base_gets_the_tensors_in_their_own_shards(sharded: Path, tmp_path: Path) -> None:
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert index[DOWN] != index[Q], "the test wants two tensors in two shards"
    before = all_tensors(sharded)
    new = changed(before, [DOWN, Q], seed=2)
    report = apply_delta(sharded, write_delta(tmp_path / "delta.safetensors", new), tmp_path / "out")

    out = tmp_path / "out"
    assert sorted(report.shards_rewritten) == sorted({index[DOWN], index[Q]})
    for shard in {p.name for p in sharded.glob("*.safetensors")}:
        same = (out / shard).read_bytes() == (sharded / shard).read_bytes()
        assert same is (shard not in report.shards_rewritten), shard
        written = load_file(out / shard)
        assert written.keys() == load_file(sharded / shard).keys()  # each tensor stays in its shard
    assert (out / "model.safetensors.index.json").read_bytes() == (sharded / "model.safetensors.index.json").read_bytes()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    expected = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    expected.update(new)
    assert all(torch.equal(after[k], expected[k]) for k in expected)


def test_an_untied_head_joins_the_checkpoint_and_unties_the_config(tmp_path: Path) -> None:
    tied = make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    before = all_tensors(tied)
    assert "lm_head.weight" not in before  # stored once, under the embedding's key
    embedding = before["model.embed_tokens.weight"]
    head = torch.randn(embedding.shape).to(embedding.dtype)
    report = apply_delta(
        tied, write_delta(tmp_path / "d.safetensors", {"lm_head.weight": head}, untied=True), tmp_path / "out"
    )

    assert report.untied and report.added == {"lm_head.weight": "model.safetensors"}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(model.lm_head.weight, head)
    assert torch.equal(model.model.embed_tokens.weight, embedding)  # the embedding never changes

    with pytest.raises(DeltaError, match="lm_head.weight"):  # the same key without untied: refused
        apply_delta(tied, write_delta(tmp_path / "e.safetensors", {"lm_head.weight": head}), tmp_path / "out2")


@pytest.mark.parametrize(
    ("tensors", "mentions"),
    [
        ({"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}, ("model.layers.9.mlp.up_proj.weight", "another model")),
        ({DOWN: torch.zeros(3, 3)}, (DOWN, "[3, 3]", "[32, 64]")),
        ({DOWN: torch.zeros(32, 64, dtype=torch.float16)}, (DOWN, "F16", "F32")),
    ],
    ids=["missing-key", "shape", "dtype"],
)
def test_a_delta_that_does_not_fit_is_refused_by_name_and_writes_nothing(
    sharded: Path, tmp_path: Path, tensors: dict[str, torch.Tensor], mentions: tuple[str, ...]
) -> None:
    delta = write_delta(tmp_path / "bad.safetensors", {**tensors, Q: all_tensors(sharded)[Q]})
    with pytest.raises(DeltaError) as refused:
        apply_delta(sharded, delta, tmp_path / "out")
    for mention in mentions:
        assert mention in str(refused.value)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_a_failure_while_writing_leaves_no_out_dir(base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import engram_client.deltas as deltas

    def broken(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(deltas, "_write_shard", broken)
    delta = write_delta(tmp_path / "d.safetensors", changed(all_tensors(base), [DOWN]))
    with pytest.raises(OSError, match="disk full"):
        apply_delta(base, delta, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_an_existing_out_dir_or_a_folder_without_weights_is_refused(base: Path, tmp_path: Path) -> None:
    delta = write_delta(tmp_path / "d.safetensors", changed(all_tensors(base), [DOWN]))
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="taken"):
        apply_delta(base, delta, tmp_path / "taken")
    with pytest.raises(DeltaError, match="inside the base folder"):
        apply_delta(base, delta, base / "edited")
    assert not (base / "edited").exists() and leftovers(base) == []
    (tmp_path / "empty").mkdir()
    with pytest.raises(DeltaError, match="not a safetensors checkpoint folder"):
        apply_delta(tmp_path / "empty", delta, tmp_path / "out")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(DeltaError, match="not a safetensors file"):
        apply_delta(base, tmp_path / "junk.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_cli_applies_a_delta_and_names_a_refusal(base: Path, tmp_path: Path) -> None:
    new = changed(all_tensors(base), [DOWN])
    delta = write_delta(tmp_path / "d.safetensors", new)
    result = ok(run_cli("http://127.0.0.1:9", "apply-delta", base, delta, tmp_path / "out"))  # no service needed
    assert "1 tensor(s) replaced in model.safetensors" in result.stdout
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")[DOWN], new[DOWN])

    bad = write_delta(tmp_path / "bad.safetensors", {DOWN: torch.zeros(3, 3)})
    failed(run_cli("http://127.0.0.1:9", "apply-delta", base, bad, tmp_path / "out2"), DOWN, "[3, 3]")
    failed(run_cli("http://127.0.0.1:9", "apply-delta", base, delta, tmp_path / "out"), "exists")
