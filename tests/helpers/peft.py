"""A peft adapter held to the checkpoint variant of the same edit: loaded with ``PeftModel`` on its
base, merged with ``merge_and_unload``, every parameter equal to the variant's within a share of the
edit. Shared by tests/engine/test_lora.py (adapters written by the engine),
tests/variants/test_peft_adapter_outputs.py (by the variant jobs) and the e2e scenarios (downloaded
from a live server).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from peft import PeftModel

# Merged or served adapter vs the checkpoint variant (which rounds W + ΔW to float32 in another
# order): measured ≤ 8e-7 of ‖ΔW‖ per parameter (tests/engine/test_lora.py); the LoRA drops singular
# values under EXACT_RTOL · σ₁.
MERGE_TOL = 1e-5


def load_adapter(base: torch.nn.Module, adapter_dir: Path) -> PeftModel:
    """``PeftModel.from_pretrained(base, adapter_dir)`` in eval mode, without peft's and transformers'
    warnings: the ones an engram adapter raises are expected and documented in service.engine.lora
    (a tied lm_head, per-module fan_in_fan_out, a bias-free layer beside biased ones). A test that
    checks a warning is absent loads the adapter itself."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(base, adapter_dir).eval()


def assert_same_parameters(
    merged: torch.nn.Module, variant: torch.nn.Module, base: torch.nn.Module, tol: float = MERGE_TOL
) -> list[str]:
    """Every parameter of ``merged`` equal to ``variant``'s within ``tol`` of the edit (‖variant − base‖),
    and bit for bit the base's where the edit moved nothing; returns the names the edit moved."""
    base_params, variant_params = dict(base.named_parameters()), dict(variant.named_parameters())
    moved = []
    for name, param in merged.named_parameters():
        expected, original = variant_params[name].detach().double(), base_params[name].detach().double()
        edit = float((expected - original).norm())
        if edit == 0.0:
            assert torch.equal(param.detach().double(), original), name
            continue
        moved.append(name)
        assert float((param.detach().double() - expected).norm()) <= tol * edit, name
    return moved
