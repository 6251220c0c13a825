"""One input group of a universe: its pseudo-inverse factors' file, and its members' rows.

A group is decomposed (:func:`decompose_group`) from its members' rows
(:func:`~service.engine.linalg.pinv_factors_from_rows`: ``T²·D``) when every
member stored that group as rows (``service.engine.stats_io``: a concept with fewer tokens than the
group is wide) and together they hold fewer tokens than the group is wide; otherwise from
``Σ_U = Σ_k Σ_k`` (:func:`~service.engine.linalg.pinv_factors`: ``D³``). Rows are exact float32 activations and every
product on them runs in float64, so a rows group's ``Σ_U`` is the exact ``XᵀX``; its members'
engrams then use their exact ``X_kᵀX_k`` too (:class:`RowsExact`), not the float32-product sums
collection stored, so ``Σ_k`` and ``Σ_U⁺`` agree.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from service.context import Context
from service.engine.compose import GroupedStatistics, weighted_sum
from service.engine.linalg import PinvFactors, pinv_factors, pinv_factors_from_rows
from service.errors import JobFailed
from service.statistics.key import statistics_key
from service.storage.base import Storage
from service.universes.spec import FACTORS_FORMAT

_STORED_DTYPES = {"F32": torch.float32, "F64": torch.float64}


@dataclass(frozen=True)
class GroupFile:
    """A published group's factors as a local file, and what they are (``source``: ``rows`` or ``sums``)."""

    path: Path
    dim: int
    rank: int
    explicit: bool
    nbytes: int
    source: str


def group_rows(ctx: Context, members: Mapping[str, GroupedStatistics], keys: Mapping[str, str]) -> list[torch.Tensor] | None:
    """Every member's stored rows of this group, when all of them stored rows and together they
    hold fewer tokens than the group is wide (then ``T²·D`` beats ``D³``); else None.

    The token counts come from the (local) statistics headers; only then are the stored originals
    read, one tensor by its byte range (a worker's local copy has the rows expanded into sums).
    """
    counts = [getattr(members[prefix], "counts", {}).get(group) for prefix, group in keys.items()]
    dims = {getattr(members[prefix], "dims", {}).get(group) for prefix, group in keys.items()}
    if None in counts or len(dims) != 1 or None in dims:
        return None
    (dim,) = dims
    if sum(c for c in counts if c is not None) >= dim:  # both checked for None above
        return None
    rows = [stored_rows(ctx.storage, statistics_key(prefix), group) for prefix, group in keys.items()]
    present = [r for r in rows if r is not None]
    return present if len(present) == len(rows) else None


def stored_rows(storage: Storage, key: str, group: str) -> torch.Tensor | None:
    """The rows ``X`` (``[T, D]`` float32) a statistics file stores for ``group``, or None when the
    group is stored packed; read by byte range (only that tensor and the header cross the wire)."""
    (length,) = struct.unpack("<Q", _read(storage, key, 0, 8))
    header = json.loads(_read(storage, key, 8, length))
    forms = json.loads((header.get("__metadata__") or {}).get("forms", "null") or "{}")
    entry = header.get(group)
    if forms.get(group) != "rows" or entry is None:
        return None
    begin, end = entry["data_offsets"]
    data = bytearray(_read(storage, key, 8 + length + begin, end - begin))
    tensor = torch.frombuffer(data, dtype=_STORED_DTYPES[entry["dtype"]]) if data else torch.empty(0)
    return tensor.reshape(entry["shape"])


def _read(storage: Storage, key: str, start: int, length: int) -> bytes:
    data = b"".join(storage.iter_range(key, start, start + length - 1))
    if len(data) != length:
        raise JobFailed(f"{key} is cut short ({len(data)} of {length} bytes at offset {start})")
    return data


class RowsExact:
    """A member's statistics with the sums of the groups decomposed from rows as the exact
    ``X_kᵀX_k`` (float64 products of its stored rows), the rest as stored: ``Σ_k`` as the
    universe's factors saw it."""

    def __init__(self, ctx: Context, prefix: str, stats: GroupedStatistics, rows_groups: set[str]) -> None:
        self.layer_group = stats.layer_group
        self.sums = _ExactSums(ctx, prefix, stats.sums, rows_groups)


class _ExactSums(Mapping[str, torch.Tensor]):
    def __init__(self, ctx: Context, prefix: str, stored: Mapping[str, torch.Tensor], rows_groups: set[str]) -> None:
        self._ctx, self._prefix, self._stored, self._rows_groups = ctx, prefix, stored, rows_groups

    def __getitem__(self, group: str) -> torch.Tensor:
        if group in self._rows_groups:
            rows = stored_rows(self._ctx.storage, statistics_key(self._prefix), group)
            if rows is None:
                raise JobFailed(f"statistics {self._prefix} no longer store rows for group {group}")
            x = rows.to(torch.float64)
            return x.mT @ x
        return self._stored[group]

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)


# ---------------------------------------------------------------- files


def save_factors(factors: PinvFactors, path: Path, group: str, rcond: float | None, source: str = "sums") -> None:
    """Write pseudo-inverse factors (float64, explicit ``matrix`` or ``basis``) with what they are."""
    tensors = {"inverse_eigenvalues": factors.inverse_eigenvalues.contiguous()}
    held = factors.matrix if factors.matrix is not None else factors.basis
    assert held is not None
    tensors["matrix" if factors.explicit else "basis"] = held.contiguous()
    metadata = {
        "format": FACTORS_FORMAT,
        "group": group,
        "dim": str(held.shape[0]),
        "rank": str(factors.rank),
        "explicit": str(factors.explicit).lower(),
        "rcond": "default" if rcond is None else repr(rcond),
        "source": source,
    }
    save_file(tensors, str(path), metadata=metadata)


def load_factors(path: Path) -> PinvFactors:
    """Read what :func:`save_factors` wrote."""
    with safe_open(str(path), framework="pt") as handle:
        keys = set(handle.keys())
        inverse = handle.get_tensor("inverse_eigenvalues")
        if "matrix" in keys:
            return PinvFactors(inverse, matrix=handle.get_tensor("matrix"))
        return PinvFactors(inverse, basis=handle.get_tensor("basis"))


def group_file(path: Path) -> GroupFile:
    """What a factors file holds, from its header."""
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    if meta.get("format") != FACTORS_FORMAT:
        raise JobFailed(f"{path.name} is not a factors file ({meta.get('format')!r})")
    dim, rank, explicit = int(meta["dim"]), int(meta["rank"]), meta["explicit"] == "true"
    return GroupFile(path, dim, rank, explicit, path.stat().st_size, meta.get("source", "sums"))


def rows_groups(files: Mapping[str, GroupFile]) -> set[str]:
    """The groups whose factors came from rows."""
    return {group for group, file in files.items() if file.source == "rows"}


def member_group_keys(member_groups: Mapping[str, Mapping[str, str]], prefix: str, groups: Iterable[str]) -> set[str]:
    """``prefix``'s own keys for the universe groups ``groups``."""
    return {member_groups[group][prefix] for group in groups}


def decompose_group(
    ctx: Context, members: Mapping[str, GroupedStatistics], keys: Mapping[str, str], rcond: float | None
) -> tuple[PinvFactors, str]:
    """The universe's pseudo-inverse factors of one input group (on the CPU), and what they came from.

    The float64 ``eigh`` runs on ``ctx.settings.torch_device``: a GPU when one is there (``ENGRAM_DEVICE``).

    Args:
        members: statistics prefix -> that member's statistics.
        keys: statistics prefix -> the member's own key for this group.

    Returns:
        (factors, ``"rows"``: from the members' rows, ``T²·D``; or ``"sums"``: ``eigh`` of ``Σ_U``, ``D³``).
    """
    device = ctx.settings.torch_device
    rows = group_rows(ctx, members, keys)
    if rows is not None:
        return pinv_factors_from_rows(torch.cat(rows).to(device), rcond).to("cpu"), "rows"
    total = weighted_sum((1.0, members[prefix].sums[group]) for prefix, group in keys.items())
    return pinv_factors(total.to(device), rcond).to("cpu"), "sums"
