"""CLI frictions a newcomer met (issue 28): ``--reference``'s help names the real default (the
model's current universe), and ``engram variants list`` shows the edit options that tell two
variants of the same terms apart (modules, layers, strengths, alpha)."""

from __future__ import annotations

import typing
from typing import Any

import pytest

from api_schemas import Variant
from engram_client.cli.options import ReferenceOpt
from engram_client.cli.output import stdout
from engram_client.cli.render import render_variants


def variant(variant_id: str, **options: Any) -> Variant:
    fields: dict[str, Any] = {
        "variant_id": variant_id,
        "model_id": "demo/m",
        "terms": {"forget": -0.8},
        "alpha": 0.8,
        "scaling": "weight_norm",
        "format": "checkpoint",
        "reference": [],
        "status": "ready",
    }
    return Variant.model_validate(fields | options)


def rendered_rows(variants: list[Variant], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Each variant's table row, rendered wide enough that no cell folds."""
    monkeypatch.setattr(stdout, "width", 300)
    with stdout.capture() as captured:
        render_variants(variants)
    lines = captured.get().splitlines()
    return {v.variant_id: next(line for line in lines if v.variant_id in line) for v in variants}


def test_reference_help_names_the_current_universe() -> None:
    option = typing.get_args(ReferenceOpt)[1]
    assert "current universe" in option.help and "every ready concept" not in option.help


def test_variants_differing_in_modules_or_layers_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    variants = [
        variant("v-all"),
        variant("v-mlp", modules=["mlp.down_proj"]),
        variant("v-layers", layers=[0, 2]),
        variant("v-strength", module_strengths={"o_proj": 0.5}),
        variant("v-alpha", alpha=0.4, terms={"forget": -0.4}),
    ]
    rows = rendered_rows(variants, monkeypatch)
    cells = {vid: row.replace(vid, "") for vid, row in rows.items()}
    assert len(set(cells.values())) == len(variants), cells  # no two rows read the same once the ID is gone
    assert "mlp.down_proj" in rows["v-mlp"] and "0, 2" in rows["v-layers"] and "o_proj=0.5" in rows["v-strength"]
    cells_without_terms = {vid: cell.replace("forget=-0.4", "").replace("forget=-0.8", "") for vid, cell in cells.items()}
    assert cells_without_terms["v-alpha"] != cells_without_terms["v-all"]  # alpha shown, not only in the terms


def test_options_the_listed_variants_share_get_no_column(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stdout, "width", 300)
    with stdout.capture() as captured:
        render_variants([variant("v-a"), variant("v-b")])
    header = [cell for cell in captured.get().splitlines()[0].split() if cell.isalpha()]
    assert header == ["variant", "model", "terms", "scaling", "format", "status", "size"]
