"""Engram maps: ``GET /models/{model_id}/engram-map``, where each concept's engram lives."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from api_schemas.common import DictReadable


class ConceptMap(DictReadable):
    """One concept's values on the blocks × module types grid."""

    rho: list[list[float | None]] = Field(
        description="rows: the blocks, columns: the module types (null: no layer of that type in the block)"
    )
    max: float = Field(description="the largest value over every drawn layer")
    argmax: str = Field(description="the layer holding it")


class ConvMap(DictReadable):
    """One conv layer's engram inside the layer, with the map's measure."""

    channels: list[float] = Field(description="per output channel: the filter's share of the engram")
    kernel: list[list[float]] = Field(
        description="per kernel position (rows × columns; a Conv1d's one row), over every input channel"
    )


class MapLayer(DictReadable):
    name: str
    block: int | None = Field(description="its block index (null: outside the blocks, e.g. an embedding)")
    module: str = Field(description="its module type (the name's last part, e.g. q_proj)")


class MapLeftOut(DictReadable):
    """Layers the map does not draw, and why."""

    unreached: list[str] = Field(
        default_factory=list, description="no concept's forward pass ran them (a vision tower under text concepts)"
    )
    without_statistics: list[str] = Field(
        default_factory=list,
        description="a concept of the universe was collected with modules that leave them out",
    )


class EngramMap(DictReadable):
    """Where each concept's engram lives, by block and module type (the paper's Fig. 4 as data)."""

    model_id: str
    concepts: list[str]
    reference: list[str] = Field(description="the universe's other concepts")
    rcond: float | None = Field(description="the pseudo-inverse cut (null: the default D·eps32)")
    measure: Literal["data", "weight"] = Field(
        description="data: ‖W⁺X‖F / ‖WX‖F over the universe's inputs; weight: ‖W⁺‖F / ‖W‖F"
    )
    blocks: list[int] = Field(description="the grid's rows: block indices")
    modules: list[str] = Field(description="the grid's columns: module types")
    maps: dict[str, ConceptMap] = Field(description="per concept, its grid")
    outside_blocks: dict[str, dict[str, float]] = Field(
        description="per concept, the value of each drawn layer outside the blocks"
    )
    layers: list[MapLayer] = Field(default_factory=list, description="every drawn layer")
    conv: dict[str, dict[str, ConvMap]] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="per concept and conv layer, its engram per output channel and per kernel position "
        "(absent without conv layers)",
    )
    left_out: MapLeftOut | None = Field(
        default=None, description="layers not drawn (null: a map stored before maps named them)"
    )
