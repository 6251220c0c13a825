"""Layers without statistics: never run by the forward pass ("unreached": their statistics are zero),
or bypassed (their weight used without calling them: their input exists but is unseen)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from engram_fixtures.demo import make_facts
from engram_fixtures.models import make_tiny_llava, make_tiny_mamba
from service.engine.checkpoint import inspect_model_dir
from service.engine.collect import LayerStatistics, collect_statistics
from service.engine.records import Record, encode_record, make_batches, pad_token_id

RECORDS = [{"text": p + c} for p, c in make_facts(6, seed=2)]


def _collect(model_dir: Path, loader: type) -> LayerStatistics:
    model, tokenizer = loader.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    examples = [encode_record(tokenizer, Record.from_mapping(r, i), 128) for i, r in enumerate(RECORDS)]
    layers = inspect_model_dir(model_dir).layers
    return collect_statistics(model, make_batches(examples, 4, pad_token_id(tokenizer)), layers)


def test_a_vision_tower_under_text_is_unreached(tmp_path: Path) -> None:
    stats = _collect(make_tiny_llava(tmp_path / "llava"), AutoModelForImageTextToText)
    vision = [n for n in stats.lacking if n.startswith(("model.vision_tower.", "model.multi_modal_projector."))]
    assert vision and stats.unreached == stats.lacking == sorted(vision)
    assert all(n.startswith("model.language_model.") or n == "lm_head" for n in stats.layer_group)


def test_a_layer_whose_weight_is_used_directly_is_lacking_not_unreached(tmp_path: Path) -> None:
    """Mamba's mixer runs (its in_proj, x_proj, out_proj have statistics) but computes
    ``dt_proj.weight @ x`` without calling ``dt_proj``: no statistics, and no claim that they are zero."""
    stats = _collect(make_tiny_mamba(tmp_path / "mamba"), AutoModelForCausalLM)
    assert stats.lacking == ["backbone.layers.0.mixer.dt_proj", "backbone.layers.1.mixer.dt_proj"]
    assert stats.unreached == []
    assert "backbone.layers.0.mixer.in_proj" in stats.layer_group
