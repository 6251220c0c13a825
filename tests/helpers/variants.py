"""Variants built through the real job bodies on a store world, and the float64 edit they must equal.

:func:`world` (a module-scoped fixture: import it into the module that uses it) registers a tiny
Llama, its float64 copy and a GPT-2, each with concepts forget / retain / other published
(:func:`edit_world`, which tests/universes/test_universe_build.py builds with a bfloat16 copy too);
:func:`build` submits a variant and runs its job; :func:`reference_edit` is ``Σ_k c_k W Σ_k Σ_U⁺``
per layer in float64 with the layers' ``f_l``; :func:`assert_matches` holds a written checkpoint to
base + that edit. Shared by the variants' and calibration's tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from api_schemas import Variant
from engram_fixtures.models import make_tiny_gpt2, make_tiny_llama, make_tokenizer
from service.engine.collect import LayerStatistics
from service.engine.layers import LayerSpec
from service.engine.layout import ModelLayout
from service.variants.service import submit_variant, variant_view
from tests.helpers.algebra import DELTA_TOL, WEIGHT_TOL, augmented, reference_engram, rel
from tests.helpers.store_world import StoreWorld, float64_copy, text_records

ALPHA = 0.8


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return edit_world(tmp_path_factory.mktemp("variant-build"), "v")


def edit_world(root: Path, prefix: str, *, bfloat16: bool = False) -> dict[str, Any]:
    """A store world under ``root`` with ``{prefix}/llama`` (a tiny Llama), ``{prefix}/llama64`` (its
    float64 copy), ``{prefix}/llama16`` (its bfloat16 copy, when asked) and ``{prefix}/gpt2``, each with
    concepts forget / retain / other published.

    Returns:
        ``world`` (the StoreWorld), ``paths`` (model ID -> folder), ``stats`` (model ID -> name -> sums).
    """
    w = StoreWorld(root)
    tokenizer = make_tokenizer()
    llama = make_tiny_llama(root / "models" / "llama", hidden=32, layers=2, seed=0, tokenizer=tokenizer)
    paths = {f"{prefix}/llama": llama, f"{prefix}/llama64": float64_copy(llama, root / "models" / "llama64")}
    if bfloat16:
        paths[f"{prefix}/llama16"] = float64_copy(llama, root / "models" / "llama16", torch.bfloat16)
    paths[f"{prefix}/gpt2"] = make_tiny_gpt2(root / "models" / "gpt2", hidden=32, layers=2, seed=0, tokenizer=tokenizer)
    stats: dict[str, dict[str, LayerStatistics]] = {}
    for model_id, path in paths.items():
        w.register(model_id, path)
        stats[model_id] = {
            "forget": w.publish(model_id, "forget", text_records(0, 40)),
            "retain": w.publish(model_id, "retain", text_records(40, 120)),
            "other": w.publish(model_id, "other", text_records(0, 30, seed=5)),
        }
    return {"world": w, "paths": paths, "stats": stats}


def run_variant(
    w: StoreWorld, model_id: str, terms: dict[str, float], alpha: float | None, options: dict[str, Any]
) -> Variant:
    """Submit a variant and run its build job, when the submission made one (not when the variant
    existed); the variant's view then. The job must succeed."""
    view, job = submit_variant(w.ctx, model_id, terms, alpha, options)
    if job is not None:
        [done] = w.run_pending()
        assert done.status == "succeeded", done
    return variant_view(w.ctx, view.variant_id)


def build(w: StoreWorld, model_id: str, terms: dict[str, float], **options: Any) -> Variant:
    """Submit a variant and run its job; returns the variant (its stored manifest: :func:`manifest_of`)."""
    return run_variant(w, model_id, terms, None, {"scaling": "uniform", "format": "checkpoint", **options})


def manifest_of(w: StoreWorld, variant: Variant) -> dict[str, Any]:
    """The variant's stored manifest, as written."""
    stored: dict[str, Any] = w.ctx.storage.get_json(f"variants/{variant.variant_id}/manifest.json")
    return stored


def checkpoint_of(w: StoreWorld, variant: Variant) -> dict[str, torch.Tensor]:
    return load_file(str(w.ctx.storage.local_path(f"variants/{variant.variant_id}/files/model.safetensors")))


def layout_of(w: StoreWorld, model_id: str) -> ModelLayout:
    return ModelLayout.from_json(w.ctx.storage.get_json(f"models/{model_id.replace('/', '%2F')}.json")["layout"])


def new_weights(spec: LayerSpec, layout: ModelLayout, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A written layer's ``[W | b]`` as ``[out, in(+1)]`` float64 (its own key when the edit untied it)."""
    key = layout.own_keys.get(spec.name, layout.weight_keys[spec.name])
    w = tensors[key].double()
    w = w.T if spec.transposed else w
    if spec.bias:
        w = torch.cat([w, tensors[layout.bias_keys[spec.name]].double()[:, None]], dim=1)
    return w


def reference_edit(
    world: dict[str, Any], model_id: str, terms: dict[str, float], universe: list[str], scaling: str
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``Σ_k c_k W Σ_k Σ_U⁺`` per layer (float64) and the layers' ``f_l``."""
    from service.engine.checkpoint import CheckpointReader

    stats = world["stats"][model_id]
    layout = layout_of(world["world"], model_id)
    reader = CheckpointReader(world["paths"][model_id], layout)
    engrams, rho = {}, {}
    for spec in layout.layers:
        weights = reader.layer_weights(spec)
        total = sum(stats[n].sum_for(spec.name) for n in universe)
        engrams[spec.name] = sum(
            c * reference_engram(spec, weights, stats[n].sum_for(spec.name), total) for n, c in terms.items()
        )
        rho[spec.name] = float(engrams[spec.name][:, : spec.in_features].norm() / weights.weight.double().norm())
    top = max(rho.values())
    return engrams, {n: (1.0 if scaling == "uniform" else rho[n] / top) for n in engrams}


def assert_matches(
    world: dict[str, Any],
    model_id: str,
    variant: Variant,
    expected: dict[str, torch.Tensor],
    tol: float = WEIGHT_TOL,
    modules: Sequence[str] | None = None,
) -> float:
    """The written checkpoint equals base + expected delta; returns the worst relative delta error.

    ``modules``: only the layers of those modules (``q_proj``, …) are edited; every other layer must be
    the base's, bit for bit, and at least one layer must be edited.
    """
    from service.engine.checkpoint import CheckpointReader

    w: StoreWorld = world["world"]
    layout = layout_of(w, model_id)
    reader = CheckpointReader(world["paths"][model_id], layout)
    written = checkpoint_of(w, variant)
    worst, edited = 0.0, 0
    for spec in layout.layers:
        old = augmented(spec, reader.layer_weights(spec))
        new = new_weights(spec, layout, written)
        if modules is not None and spec.name.rsplit(".", 1)[-1] not in modules:
            assert torch.equal(new, old), spec.name
            continue
        edited += 1
        assert rel(new, old + expected[spec.name]) < tol, spec.name
        error = rel(new - old, expected[spec.name])
        assert error < max(DELTA_TOL, tol), (spec.name, error)
        worst = max(worst, error)
    assert edited > 0, "no layer edited"
    return worst
