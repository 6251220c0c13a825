"""A universe's bytes, projected before it is built (what the storage budget checks).

Per input group of width ``D`` whose members hold ``T`` tokens in all, at most ``k = min(D, T)``
directions are kept, stored as the explicit ``[D, D]`` matrix when ``2k > D`` and as the ``[D, k]``
basis otherwise, plus ``k`` inverse eigenvalues, all float64; per member and layer, the dense
``[out, in(+1)]`` engram at its stored precision (:func:`service.engrams.format.engram_dtype`). The
files' headers are computed exactly as the writers lay them out. :mod:`service.universes.retention`
applies the budget and the retention rule with these figures.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.context import Context
from service.engine.layers import LayerSpec
from service.engine.layout import ModelLayout
from service.engrams.format import ENGRAMS_FORMAT, engram_dtype
from service.models.record import ModelRecord
from service.models.registry import find_model
from service.statistics.manifest import StatsHeader, stats_header
from service.universes.spec import FACTORS_FORMAT, UniverseSpec

_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2}
# A factors file's header is the safetensors library's JSON of the same entries (its own key order):
# room for metadata the build may add beyond what is projected here.
_FACTORS_HEADER_SLACK = 64


@dataclass(frozen=True)
class Projection:
    """A universe's bytes before it is built (an upper bound of what the build stores).

    Attributes:
        groups: its input groups' pseudo-inverse factors.
        engrams: every member's engram file.
        assumed_float64: layers whose weight dtype could not be read here (a checkpoint not on this
            machine): their engrams were counted as float64, the largest they can be.
    """

    groups: int
    engrams: int
    assumed_float64: int = 0

    @property
    def total(self) -> int:
        return self.groups + self.engrams

    def to_json(self) -> dict[str, int]:
        return {"groups": self.groups, "engrams": self.engrams, "total": self.total}


def project_universe(ctx: Context, spec: UniverseSpec) -> Projection:
    """The bytes a build of ``spec`` will store, from the model layout and the headers of its
    members' statistics and of the checkpoint (no tensor is read).

    Raises:
        ObjectNotFound: a member's statistics are gone (their manifest was checked when resolved).
    """
    model = find_model(ctx, spec.model_id)
    if model is None:
        return Projection(0, 0)
    layout = model.layout
    headers = {prefix: stats_header(ctx, prefix) for prefix in spec.prefixes}
    layers = [s for s in layout.layers if all(s.name in h.layer_group for h in headers.values())]
    if not layers:
        return Projection(0, 0)  # the build refuses it by name
    groups = _group_bytes(layers, headers, spec.rcond)
    dtypes, assumed = _engram_dtypes(model, layout, layers)
    per_member = _safetensors_size(
        [(s.name, dtypes[s.name], [s.out_features, s.stat_dim]) for s in layers], {"format": ENGRAMS_FORMAT}
    )
    return Projection(groups, per_member * len(spec.prefixes), assumed)


def _group_bytes(layers: Sequence[LayerSpec], headers: Mapping[str, StatsHeader], rcond: float | None) -> int:
    """Upper bound of every input group's factors file (see the module docstring)."""
    prefixes = sorted(headers)
    first = headers[prefixes[0]]
    total = 0
    seen: set[str] = set()
    for spec in layers:
        group = first.layer_group[spec.name]
        if group in seen:
            continue
        seen.add(group)
        dim = int(first.dims.get(group, spec.stat_dim))
        tokens = sum(int(headers[p].counts.get(headers[p].layer_group[spec.name], dim)) for p in prefixes)
        kept = min(dim, tokens)
        held = ("matrix", [dim, dim]) if 2 * kept > dim else ("basis", [dim, kept])
        metadata = {  # as service.universes.factors.save_factors writes it, with room for a longer cut
            "format": FACTORS_FORMAT,
            "group": group,
            "dim": str(dim),
            "rank": str(kept),
            "explicit": "false",
            "rcond": "default" if rcond is None else repr(rcond),
            "source": "sums",
        }
        tensors = [("inverse_eigenvalues", "F64", [kept]), (held[0], "F64", held[1])]
        total += _safetensors_size(tensors, metadata) + _FACTORS_HEADER_SLACK
    return total


def _engram_dtypes(model: ModelRecord, layout: ModelLayout, layers: Sequence[LayerSpec]) -> tuple[dict[str, str], int]:
    """layer -> its engram's stored dtype, from the checkpoint's shard headers where this machine
    has them (the API registered the model, so it usually does); float64 where it does not."""
    headers: dict[str, dict[str, Any]] = {}
    folder = Path(model.path)
    dtypes, assumed = {}, 0
    for spec in layers:
        key = layout.weight_keys.get(spec.name, "")
        shard = layout.key_files.get(key, "")
        if shard not in headers:
            headers[shard] = _shard_header(folder / shard) if shard else {}
        stored = headers[shard].get(key, {}).get("dtype")
        if stored is None:
            assumed += 1
        dtypes[spec.name] = "F64" if stored is None else engram_dtype(stored)
    return dtypes, assumed


def _shard_header(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            return dict(json.loads(handle.read(length)))
    except (OSError, ValueError, struct.error):
        return {}


def _safetensors_size(tensors: Sequence[tuple[str, str, list[int]]], metadata: Mapping[str, str]) -> int:
    """The size of a safetensors file of ``tensors`` (name, dtype, shape) laid out as
    :func:`service.engine.safetensors_stream.write_streaming` writes it (compact JSON header,
    padded to 8 bytes)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = _ITEMSIZE[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = len(json.dumps(header, separators=(",", ":")).encode())
    raw += -(8 + raw) % 8
    return 8 + raw + offset
