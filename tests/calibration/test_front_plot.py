"""The calibration front PNG (issue 28): both NLL-ratio axes are logarithmic, so the acceptable
candidates (retain ratio just above 1) are not squeezed into a sliver next to the ones at ×10. Read
from the matplotlib figure the PNG is drawn from."""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from service.calibration.plot import DPI, HEIGHT, WIDTH, front_figure, render_front_png


def candidate(retain: float, forget: float, *, pareto: bool = False, alpha: float = 1.0) -> dict[str, Any]:
    options = {"module_set": "mlp", "scaling": "uniform", "alpha": alpha, "layers": None}
    return {"options": options, "retain": {"nll_ratio": retain}, "forget": {"nll_ratio": forget}, "pareto": pareto}


def result(candidates: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model_id": "demo/m",
        "concepts": ["forget"],
        "evaluations": len(candidates),
        "candidates": candidates,
        "constraint": {"max_retain_nll_ratio": 1.05},
        "recommended": {"retain_nll_ratio": 1.04, "forget_nll_ratio": 3.0, "options": candidates[0]["options"]}
        if candidates
        else None,
    }


def test_both_ratio_axes_are_logarithmic() -> None:
    # forget ratios within ×20 of each other: the old plot kept a linear axis for them, and always for retain
    front = result([candidate(1.01, 1.5), candidate(1.04, 3.0, pareto=True), candidate(9.0, 12.0, pareto=True)])
    ax = front_figure(front).axes[0]
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    low, high = ax.get_xlim()
    assert low <= 1.01 and high >= 9.0


def test_the_png_keeps_its_size_without_candidates() -> None:
    png = render_front_png(result([]))
    assert Image.open(io.BytesIO(png)).size == (WIDTH, HEIGHT) and DPI == 100
