"""The map document (``maps/<map_id>.json``): what the ``map`` job computes and stores, the API
answers (``api_schemas.maps.EngramMap`` is its wire form) and the PNG is drawn from.

Typed as dictionaries, not models: the document is stored and answered as the JSON it is, key for
key (a map stored by an earlier version reads back unchanged, without ``layers`` or ``left_out``),
and these types only name its keys where it crosses functions (build → storage → API → render).
"""

from __future__ import annotations

from typing import TypedDict


class ConceptGrid(TypedDict):
    """One concept's values on the blocks × module types grid (None: no layer of that type there)."""

    rho: list[list[float | None]]
    max: float
    argmax: str


class ConvBreakdown(TypedDict):
    """One conv layer's engram per output channel and per kernel position (:mod:`service.maps.conv`)."""

    channels: list[float]
    kernel: list[list[float]]


class MapLayer(TypedDict):
    name: str
    block: int | None
    module: str


class LeftOut(TypedDict):
    """Layers the map does not draw, by why (:func:`service.maps.build.compute_map`)."""

    unreached: list[str]
    without_statistics: list[str]


class _MapKeys(TypedDict):
    model_id: str
    concepts: list[str]
    reference: list[str]
    rcond: float | None
    blocks: list[int]
    modules: list[str]
    maps: dict[str, ConceptGrid]
    outside_blocks: dict[str, dict[str, float]]
    measure: str


class MapDocument(_MapKeys, total=False):
    """A map: its grid per concept, and the keys that only some maps have: ``layers`` and
    ``left_out`` (absent from maps stored before they existed), ``conv`` (only with conv layers)."""

    layers: list[MapLayer]
    conv: dict[str, dict[str, ConvBreakdown]]
    left_out: LeftOut
