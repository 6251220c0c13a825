"""Statistics on disk: safetensors with JSON metadata, never pickle.

Each input group is stored once, in the smaller of two exact forms:

- ``packed``: the upper triangle of ``Σ`` (``D(D+1)/2`` values), float64 by default. Float32
  (``ENGRAM_STATS_DTYPE=float32``) halves the bytes, but the pseudo-inverse keeps directions down to
  ``D·1.2e-7·λ_max``, so a float32 rounding of Σ (6e-8 relative) can move an edit by up to ~1e-2 on
  an ill-conditioned layer; measured on a tiny BERT, 1e-4 absolute. Exactness first.
- ``rows``: the concept's activations ``X`` (``[T, D]`` float32, as the model produced them), when
  the concept has fewer tokens than the group is wide: ``Σ = XᵀX`` has rank ``T`` and ``T·D`` values
  are fewer than the triangle's bytes. Lossless, whatever ``ENGRAM_STATS_DTYPE`` says.

Reading a ``rows`` group costs a ``T·D²`` product, so workers expand such files once into a packed
local copy (:func:`expand_statistics`) and read that.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from service.engine.collect import LayerStatistics
from service.engine.linalg import gram, pack_symmetric, unpack_symmetric
from service.engine.safetensors_stream import Planned, TensorEntry, read_header, write_streaming

FORMAT = "engram-stats/2"
READABLE_FORMATS = ("engram-stats/1", FORMAT)  # /1: every group packed, no "forms" entry
STORAGE_DTYPE = torch.float64
ROWS_DTYPE = torch.float32
Form = Literal["packed", "rows"]


def rows_are_smaller(tokens: int, dim: int, dtype: torch.dtype) -> bool:
    """Whether ``tokens`` float32 rows of width ``dim`` take fewer bytes than the packed triangle."""
    packed_bytes = dim * (dim + 1) // 2 * dtype.itemsize
    return 0 < tokens and tokens * dim * ROWS_DTYPE.itemsize < packed_bytes


def save_statistics(
    stats: LayerStatistics, path: Path, extra: dict[str, str] | None = None, dtype: torch.dtype = STORAGE_DTYPE
) -> None:
    """Write ``stats`` to ``path`` (a safetensors file).

    Args:
        stats: collected statistics.
        path: destination file.
        extra: more metadata to record (model digest, dataset digest, settings).
        dtype: float64 (default, exact) or float32 (half the bytes; ``ENGRAM_STATS_DTYPE``).
    """
    if dtype not in (torch.float64, torch.float32):
        raise ValueError(f"statistics are stored as float64 or float32, not {dtype}")
    tensors: dict[str, torch.Tensor] = {}
    forms: dict[str, Form] = {}
    for group, sigma in stats.sums.items():
        factor = stats.factors.get(group)
        if factor is None and stats.counts.get(group) == 0 and not bool(sigma.any()):
            # An expert no counted token reached: its sum is zero, and no rows say so in no bytes
            # (a packed zero triangle per expert would cost a large MoE model gigabytes of zeros).
            tensors[group], forms[group] = sigma.new_zeros((0, sigma.shape[0]), dtype=ROWS_DTYPE), "rows"
            continue
        if factor is not None and rows_are_smaller(factor.shape[0], sigma.shape[0], dtype):
            tensors[group], forms[group] = factor.to(ROWS_DTYPE).contiguous(), "rows"
        else:
            tensors[group], forms[group] = pack_symmetric(sigma).to(dtype), "packed"
    dims = {g: int(s.shape[0]) for g, s in stats.sums.items()}
    metadata = _metadata(stats.layer_group, stats.counts, dims, forms, extra or {})
    if stats.unreached:  # only when there are any: other files stay byte for byte as they were
        metadata["unreached"] = json.dumps(stats.unreached)
    save_file(tensors, str(path), metadata=metadata)


def _metadata(
    layer_group: Mapping[str, str],
    counts: Mapping[str, int],
    dims: Mapping[str, int],
    forms: Mapping[str, Form],
    extra: Mapping[str, str],
) -> dict[str, str]:
    return {
        **extra,
        "format": FORMAT,
        "layer_group": json.dumps(layer_group, sort_keys=True),
        "counts": json.dumps(counts, sort_keys=True),
        "dims": json.dumps(dims, sort_keys=True),
        "forms": json.dumps(forms, sort_keys=True),
    }


class _Groups(Mapping[str, torch.Tensor]):
    """Input group -> its float64 sum (packed, or full for a ``rows`` group), read when asked for.

    The file is mapped only for the read: a mapping left open would keep every page read so far
    resident in this process (and counted in its RSS) for as long as the worker caches the file.
    """

    def __init__(self, path: Path, forms: dict[str, Form]) -> None:
        self._path, self._forms = path, forms

    def __getitem__(self, group: str) -> torch.Tensor:
        form = self._forms[group]  # KeyError for an unknown group, as a Mapping should
        with safe_open(str(self._path), framework="pt") as handle:
            stored = handle.get_tensor(group)
        return gram(stored) if form == "rows" else stored.to(torch.float64)

    def __iter__(self) -> Iterator[str]:
        return iter(self._forms)

    def __len__(self) -> int:
        return len(self._forms)


class StatisticsFile:
    """A statistics file on local disk, read one input group at a time.

    A variant needs one group of every concept at a time, so holding whole files in memory (8
    concepts of a 100M model: 2.2 GB) buys nothing: the page cache keeps hot files close anyway.
    ``sums[group]`` reads that group as float64 (the packed upper triangle, or ``XᵀX`` of stored
    rows); ``layer_group`` and ``counts`` come from the header. Duck-compatible with
    :class:`LayerStatistics` for the algebra.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
        if meta.get("format") not in READABLE_FORMATS:
            raise ValueError(f"{path} is not an {FORMAT} file (format={meta.get('format')!r})")
        self.metadata = meta
        self.dims: dict[str, int] = json.loads(meta["dims"])
        self.counts: dict[str, int] = json.loads(meta["counts"])
        self.layer_group: dict[str, str] = json.loads(meta["layer_group"])
        self.forms: dict[str, Form] = json.loads(meta.get("forms", "null")) or dict.fromkeys(self.dims, "packed")
        self.sums = _Groups(path, self.forms)
        self.nbytes = path.stat().st_size

    @property
    def tokens(self) -> int:
        return max(self.counts.values(), default=0)

    @property
    def has_rows(self) -> bool:
        """Whether some group is stored as rows (worth expanding before repeated reads)."""
        return "rows" in self.forms.values()


def expand_statistics(source: Path, target: Path) -> None:
    """Write a copy of ``source`` with every ``rows`` group replaced by its packed float64 sum.

    Packed groups are copied byte for byte, and groups are produced one at a time (never the
    whole file in memory). A worker reads the copy: each read is then a copy, not a ``T·D²``
    product.
    """
    stats = StatisticsFile(source)
    entries, _ = read_header(source)
    planned = []
    for group, form in stats.forms.items():
        if form == "packed":
            planned.append(Planned(group, entries[group], source))
            continue
        length = stats.dims[group] * (stats.dims[group] + 1) // 2
        like = TensorEntry("F64", [length], 0, length * 8)
        planned.append(Planned(group, like, source, produce=partial(_packed_sum, stats, group)))
    forms: dict[str, Form] = dict.fromkeys(stats.forms, "packed")
    # _metadata writes its own keys over the source's, so the rest (digests, settings) carries over.
    write_streaming(target, planned, _metadata(stats.layer_group, stats.counts, stats.dims, forms, stats.metadata))


def _packed_sum(stats: StatisticsFile, group: str) -> torch.Tensor:
    """``group``'s sum in packed float64 form (computed from its rows when stored as rows)."""
    return pack_symmetric(stats.sums[group])


def load_statistics(path: Path) -> LayerStatistics:
    """Read a whole file written by :func:`save_statistics`; full sums, float64, on the CPU.

    Workers read files one group at a time instead (:class:`StatisticsFile`).
    """
    source = StatisticsFile(path)
    sums, factors = {}, {}
    with safe_open(str(path), framework="pt") as handle:
        for group, dim in source.dims.items():
            stored = handle.get_tensor(group)
            if source.forms[group] == "rows":
                factors[group], sums[group] = stored, gram(stored)
            else:
                sums[group] = unpack_symmetric(stored.to(torch.float64), dim)
    return LayerStatistics(sums, source.counts, source.layer_group, factors)
