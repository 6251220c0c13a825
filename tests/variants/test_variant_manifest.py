"""The variant manifest as a record: stored keys round-trip, 0.1.0's shape is read, others are refused by name."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from service.variants.manifest import MalformedVariantManifest, VariantFile, VariantManifest, read_variant_manifest
from service.variants.service import variant_manifest, variant_view
from tests.helpers.variants import build, manifest_of, world

__all__ = ["world"]

VARIANT = "ab12" * 8


def stored_manifest(**extra: Any) -> dict[str, Any]:
    """A manifest as the variant job stores it (a checkpoint variant whose selection the universe reached)."""
    return {
        "variant_id": VARIANT,
        "files": [
            {"path": "config.json", "size": 612, "sha256": "c" * 64},
            {"path": "model.safetensors", "size": 40960, "sha256": "d" * 64},
        ],
        "scales": {"model.layers.0.mlp.down_proj": 1.0, "model.layers.1.mlp.down_proj": 0.5},
        "seconds": 0.731,
        "universe_id": "e" * 32,
        **extra,
    }


LORA_REPORT = {
    "lora_target": "peft",
    "max_rank": None,
    "rtol": 1e-10,
    "r": 4,
    "dtype": "float32",
    "layers": {"model.layers.0.mlp.down_proj": {"rank": 4, "relative_error": 1.5e-7}},
    "totals": {"layers": 1, "truncated_layers": 0, "relative_error": 1.5e-7, "parameters": 256},
    "merge": {"safe": True, "notes": []},
}


@pytest.mark.parametrize(
    "stored",
    [
        stored_manifest(),
        stored_manifest(unreached_layers=["model.layers.1.self_attn.q_proj"]),
        stored_manifest(lora=LORA_REPORT),
        {k: v for k, v in stored_manifest().items() if k != "universe_id"},  # 0.1.0: before universes
    ],
    ids=["checkpoint", "unreached", "peft", "0.1.0"],
)
def test_a_stored_manifest_round_trips_key_for_key(stored: dict[str, Any]) -> None:
    before = copy.deepcopy(stored)
    manifest = read_variant_manifest(VARIANT, stored)
    assert manifest.to_json() == stored
    assert stored == before, "reading leaves the stored document as it was"
    assert VariantManifest.model_validate(manifest.model_dump()) == manifest


def test_the_record_answers_what_readers_asked_by_key() -> None:
    manifest = read_variant_manifest(VARIANT, stored_manifest(lora=LORA_REPORT))
    assert manifest.file("model.safetensors") == VariantFile(path="model.safetensors", size=40960, sha256="d" * 64)
    assert manifest.file("../model.safetensors") is None and manifest.file("lora_report.json") is None
    assert manifest.file_views == stored_manifest()["files"]
    assert manifest.lora == LORA_REPORT and manifest.unreached_layers == ()
    old = read_variant_manifest(VARIANT, {k: v for k, v in stored_manifest().items() if k != "universe_id"})
    assert old.universe_id is None and old.lora is None
    with pytest.raises(ValueError, match="frozen"):
        manifest.seconds = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("stored", "named"),
    [
        ({k: v for k, v in stored_manifest().items() if k != "files"}, "files: Field required"),
        (stored_manifest(files=[{"path": "model.safetensors", "size": "big", "sha256": "d"}]), "files.0.size"),
        (stored_manifest(checksum="x"), "checksum: Extra inputs are not permitted"),
        (stored_manifest(variant_id="ff" * 16), f"it names variant {'ff' * 16}"),
    ],
    ids=["no files", "bad size", "unknown key", "another variant's"],
)
def test_what_is_no_manifest_of_this_variant_is_refused_by_name(stored: dict[str, Any], named: str) -> None:
    with pytest.raises(MalformedVariantManifest) as refused:
        read_variant_manifest(VARIANT, stored)
    assert f"the manifest of variant {VARIANT} cannot be read" in str(refused.value)
    assert named in str(refused.value) and f"remove variants/{VARIANT}/" in str(refused.value)
    assert refused.value.status == 503


@pytest.mark.parametrize("fmt", ["checkpoint", "peft"])
def test_a_built_variant_stores_the_keys_it_always_had(world: dict[str, Any], fmt: str) -> None:
    """The variant job writes the record; the stored keys and the view are those written before it."""
    w = world["world"]
    variant = build(w, "v/llama", {"forget": -0.8}, format=fmt, modules=["mlp.down_proj"])
    stored = manifest_of(w, variant)
    expected = {"variant_id", "files", "scales", "seconds", "universe_id"} | ({"lora"} if fmt == "peft" else set())
    assert set(stored) == expected
    manifest = variant_manifest(w.ctx, variant.variant_id)
    assert manifest is not None and manifest.to_json() == stored
    assert all(set(f) == {"path", "size", "sha256"} for f in stored["files"])
    view = variant_view(w.ctx, variant.variant_id)
    assert view.status == "ready" and view.model_dump()["files"] == stored["files"]
    assert view.lora == stored.get("lora") and view.unreached_layers == []


def test_a_broken_stored_manifest_is_refused_by_name_on_the_view(world: dict[str, Any]) -> None:
    w = world["world"]
    variant = build(w, "v/gpt2", {"other": -0.5})
    variant_id = variant.variant_id
    broken = {k: v for k, v in manifest_of(w, variant).items() if k != "scales"}
    w.ctx.storage.put_json(f"variants/{variant_id}/manifest.json", broken)
    w.ctx.reads.forget(f"variants/{variant_id}/manifest.json")
    with pytest.raises(MalformedVariantManifest, match=f"variant {variant_id} cannot be read \\(scales: Field required"):
        variant_view(w.ctx, variant_id)
