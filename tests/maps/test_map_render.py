"""The engram map PNG tells two concepts apart (issue 28): each panel has its own colour scale, so a
concept whose trace is a hundred times weaker than the other's is not drawn as one flat colour. Read
from the matplotlib figure the PNG is drawn from (its images' colour limits and colours)."""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
from PIL import Image

from service.maps.render import map_figure, panel, render_png

STRONG = [[0.5, 0.9, 0.7], [0.6, 1.0, 0.8]]
WEAK = [[0.001, 0.004, 0.002], [0.003, 0.002, 0.001]]


def two_concepts() -> dict[str, Any]:
    return {
        "model_id": "demo/m",
        "measure": "weight",
        "concepts": ["strong", "weak"],
        "blocks": [0, 1],
        "modules": ["q_proj", "k_proj", "down_proj"],
        "outside_blocks": {"strong": {}, "weak": {}},
        "maps": {"strong": {"rho": STRONG, "max": 1.0}, "weak": {"rho": WEAK, "max": 0.004}},
    }


def heatmaps(data: dict[str, Any]) -> list[Any]:
    figure = map_figure(data, 960, 300)
    return [ax.images[0] for ax in figure.axes if ax.images]


def test_each_panel_spans_its_own_range() -> None:
    data = two_concepts()
    images = heatmaps(data)
    assert len(images) == 2
    for image, grid in zip(images, (STRONG, WEAK), strict=True):
        assert image.get_clim() == (min(map(min, grid)), max(map(max, grid)))


def test_the_weak_concept_is_not_one_flat_colour() -> None:
    data = two_concepts()
    weak_image = heatmaps(data)[1]
    _, _, grid = panel(data, "weak")
    colours = weak_image.to_rgba(np.array(grid), bytes=True).reshape(-1, 4)
    assert len({tuple(c) for c in colours.tolist()}) == len({v for row in WEAK for v in row})  # one per value
    # its weakest and strongest cells differ as much as the strong panel's do (both ends of the map)
    lowest, highest = colours[np.argmin(np.array(WEAK))], colours[np.argmax(np.array(WEAK))]
    assert np.abs(lowest.astype(int) - highest.astype(int)).max() > 100


def test_a_panel_of_one_value_or_none_still_renders() -> None:
    data = two_concepts()
    data["maps"]["weak"]["rho"] = [[0.2, 0.2, None], [0.2, 0.2, 0.2]]
    data["maps"]["strong"]["rho"] = [[None] * 3, [None] * 3]
    low, high = heatmaps(data)[0].get_clim()
    assert math.isfinite(low) and math.isfinite(high) and low < high
    png = render_png(data, 960, 300)
    assert Image.open(io.BytesIO(png)).size == (960, 300)
