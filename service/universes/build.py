"""The universe job body: decompose each input group of ``Σ_U`` once, then store every member's engrams.

Phases (the job's progress counts steps: one per group, then one per member and layer):

1. ``plan.json``: the layers every member has statistics for and their input groups.
2. Per input group: ``Σ_U = Σ_k Σ_k`` and its pseudo-inverse factors (:func:`pinv_factors`,
   float64 ``eigh``), published as ``groups/<group>.safetensors``.
3. Per member: ``E_k,l`` of every layer (:mod:`service.engrams.build`), published as
   ``engrams/<member>.safetensors`` and its ``.json`` sidecar (norms).
4. ``manifest.json``, last.

Every part is content-addressed by the universe, so a build that was cut short (a worker killed, a
redelivered message) publishes only what is missing: groups and members already stored are read,
not computed again. A build whose manifest exists finishes at once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

from service.engine.checkpoint import CheckpointReader, ModelLayout
from service.engine.compose import GroupedStatistics, weighted_sum
from service.engine.layers import LayerSpec
from service.engine.linalg import PinvFactors, pinv_factors
from service.engrams.build import write_member_engrams
from service.errors import JobFailed
from service.jobs import utc_now
from service.local_copies import checked_model_dir, local_object, statistics
from service.progress import JobProgress, NoProgress, Progress
from service.registry import Context, get_model
from service.storage import scratch_dir
from service.universes.service import (
    UNIVERSE_FORMAT,
    UniverseSpec,
    engram_key,
    find_manifest,
    find_request,
    group_key,
    member_keys,
    universe_prefix,
)

FACTORS_FORMAT = "engram-factors/1"


def run_universe(ctx: Context, job: dict[str, Any]) -> dict[str, Any]:
    """The ``universe`` job: build it (or find it built)."""
    progress = JobProgress(ctx, job["job_id"], 0)
    manifest, reused = ensure_universe(ctx, job["payload"]["universe_id"], progress)
    return {
        "universe_id": manifest["universe_id"],
        "reused": reused,
        "bytes": manifest["bytes"]["total"],
        "seconds": manifest["seconds"],
    }


def ensure_universe(ctx: Context, universe_id: str, progress: Progress | None = None) -> tuple[dict[str, Any], bool]:
    """The universe's manifest, building whatever of it is missing first.

    Args:
        progress: told of each step; a :class:`JobProgress` is first given the number of steps.

    Returns:
        (manifest, whether it existed already).

    Raises:
        JobFailed: the universe is unknown, its model changed, or its members share no layer.
    """
    existing = find_manifest(ctx, universe_id)
    if existing is not None:
        return existing, True
    request = find_request(ctx, universe_id)
    if request is None:
        raise JobFailed(f"universe {universe_id} does not exist")
    spec = UniverseSpec.from_json(request)
    model = get_model(ctx, spec.model_id)
    if model["digest"] != spec.model_digest:
        raise JobFailed(f"model {spec.model_id} was re-registered with other weights")
    layout = ModelLayout.from_json(model["layout"])
    members = {prefix: statistics(ctx, prefix) for prefix in spec.prefixes}
    plan = plan_universe(layout, members)
    plan_key = universe_prefix(universe_id) + "plan.json"
    if not ctx.storage.exists(plan_key):
        ctx.storage.put_json(plan_key, plan.to_json())
    steps = progress or NoProgress()
    if isinstance(steps, JobProgress):
        steps.restart(len(plan.groups) + len(plan.layers) * len(members))
    reader = CheckpointReader(checked_model_dir(ctx, model), layout)
    started = time.perf_counter()
    with scratch_dir("universe") as tmp:
        groups = decompose_groups(ctx, universe_id, spec.rcond, plan, members, Path(tmp), steps)
        decomposed = time.perf_counter()
        engrams = store_engrams(ctx, universe_id, plan, members, groups, reader, Path(tmp), steps)
    finished = time.perf_counter()
    seconds = {
        "decomposition": round(decomposed - started, 3),
        "engrams": round(finished - decomposed, 3),
        "total": round(finished - started, 3),
    }
    manifest = _manifest(spec, plan, members, groups, engrams, seconds)
    ctx.storage.put_json(universe_prefix(universe_id) + "manifest.json", manifest)  # last: the universe now exists
    return manifest, False


# ---------------------------------------------------------------- plan


@dataclass(frozen=True)
class UniversePlan:
    """What a universe holds.

    Attributes:
        layers: the layers every member has statistics for, in layout order.
        groups: input group (the first member's name for it) -> its layers.
        member_groups: input group -> each member's own key for it (statistics prefix -> group key).
    """

    layers: list[LayerSpec]
    groups: dict[str, list[str]]
    member_groups: dict[str, dict[str, str]]

    def group_of(self, layer: str) -> str:
        return next(g for g, names in self.groups.items() if layer in names)

    def to_json(self) -> dict[str, Any]:
        return {"groups": self.groups, "layers": [s.name for s in self.layers]}


def plan_universe(layout: ModelLayout, members: Mapping[str, GroupedStatistics]) -> UniversePlan:
    """The layers and input groups of a universe of ``members`` (statistics prefix -> statistics).

    Raises:
        JobFailed: the members group a layer's input differently, or share no layer.
    """
    prefixes = sorted(members)
    layers = [s for s in layout.layers if all(s.name in members[p].layer_group for p in prefixes)]
    if not layers:
        raise JobFailed("the concepts of this universe have statistics for no common layer")
    groups: dict[str, list[str]] = {}
    member_groups: dict[str, dict[str, str]] = {}
    for spec in layers:
        keys = {p: members[p].layer_group[spec.name] for p in prefixes}
        group = keys[prefixes[0]]
        if member_groups.setdefault(group, keys) != keys:
            raise JobFailed(f"the concepts of this universe group the input of layer {spec.name} differently")
        groups.setdefault(group, []).append(spec.name)
    return UniversePlan(layers, groups, member_groups)


# ---------------------------------------------------------------- phase 1: factors


@dataclass(frozen=True)
class GroupFile:
    """A published group's factors as a local file, and what they are."""

    path: Path
    dim: int
    rank: int
    explicit: bool
    nbytes: int


def decompose_groups(
    ctx: Context,
    universe_id: str,
    rcond: float | None,
    plan: UniversePlan,
    members: Mapping[str, GroupedStatistics],
    scratch: Path,
    progress: Progress,
) -> dict[str, GroupFile]:
    """Decompose each input group of ``Σ_U`` once (skipping groups already published) and publish
    its factors; returns group -> its local file."""
    files = {}
    for index, (group, keys) in enumerate(plan.member_groups.items()):
        key = group_key(universe_id, group)
        if ctx.storage.exists(key):  # a build cut short decomposed it already
            files[group] = _group_file(local_object(ctx, key))
        else:
            total = weighted_sum((1.0, members[prefix].sums[g]) for prefix, g in keys.items())
            factors = pinv_factors(total, rcond)
            del total
            file = scratch / f"group-{index}.safetensors"
            save_factors(factors, file, group, rcond)
            ctx.storage.put_file(key, file)
            in_place = ctx.storage.local_path(key)
            if in_place is not None:  # file storage: read the published object, drop the scratch copy
                file.unlink()
            files[group] = _group_file(in_place or file)
        progress.advance()
    return files


def save_factors(factors: PinvFactors, path: Path, group: str, rcond: float | None) -> None:
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


def _group_file(path: Path) -> GroupFile:
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    if meta.get("format") != FACTORS_FORMAT:
        raise JobFailed(f"{path.name} is not a factors file ({meta.get('format')!r})")
    return GroupFile(path, int(meta["dim"]), int(meta["rank"]), meta["explicit"] == "true", path.stat().st_size)


class _LastGroup:
    """layer -> its group's factors, read from the group's file when the group changes (a member's
    layers come group by group, so each group is read once per member)."""

    def __init__(self, plan: UniversePlan, files: Mapping[str, GroupFile]) -> None:
        self.plan, self.files = plan, files
        self._held: tuple[str, PinvFactors] | None = None

    def __call__(self, layer: str) -> PinvFactors:
        group = self.plan.group_of(layer)
        if self._held is None or self._held[0] != group:
            self._held = None  # let the previous group's factors go before reading the next
            self._held = (group, load_factors(self.files[group].path))
        return self._held[1]


# ---------------------------------------------------------------- phase 2: engrams


def store_engrams(
    ctx: Context,
    universe_id: str,
    plan: UniversePlan,
    members: Mapping[str, GroupedStatistics],
    groups: Mapping[str, GroupFile],
    reader: CheckpointReader,
    scratch: Path,
    progress: Progress,
) -> dict[str, dict[str, Any]]:
    """Compute and publish every member's engram file (skipping members already published);
    returns member key -> its sidecar (norms, dtypes, bytes)."""
    layout = reader.layout
    stored: dict[str, dict[str, Any]] = {}
    for prefix, member in member_keys(sorted(members)).items():
        sidecar = engram_key(universe_id, member, ".json")
        found = ctx.storage.find_json(sidecar)  # written after its tensors: the member is complete
        if found is not None:
            stored[member] = found
            progress.advance(len(plan.layers))
            continue
        file = scratch / f"{member}.safetensors"
        info = write_member_engrams(
            file,
            members[prefix],
            plan.layers,
            _LastGroup(plan, groups),
            reader.layer_weights,
            lambda spec: reader.stored_dtype(layout.weight_keys[spec.name]),
            on_layer=progress.advance,
        )
        ctx.storage.put_file(engram_key(universe_id, member), file)
        file.unlink()
        stored[member] = info.to_json()
        ctx.storage.put_json(sidecar, stored[member])
    return stored


# ---------------------------------------------------------------- manifest


def _manifest(
    spec: UniverseSpec,
    plan: UniversePlan,
    members: Mapping[str, GroupedStatistics],
    groups: Mapping[str, GroupFile],
    engrams: Mapping[str, Mapping[str, Any]],
    seconds: Mapping[str, float],
) -> dict[str, Any]:
    keys = member_keys(sorted(members))
    first = next(iter(engrams.values()))
    group_bytes = sum(g.nbytes for g in groups.values())
    engram_bytes = sum(int(e["bytes"]) for e in engrams.values())
    return {
        "format": UNIVERSE_FORMAT,
        "universe_id": spec.universe_id,
        "model_id": spec.model_id,
        "model_digest": spec.model_digest,
        "rcond": spec.rcond,
        "members": [
            {
                "names": sorted(m.name for m in spec.members if m.stats == prefix),
                "stats": prefix,
                "dataset_digest": prefix.rstrip("/").split("/")[-2],
                "key": keys[prefix],
                "tokens": _tokens(members[prefix]),
            }
            for prefix in sorted(members)
        ],
        "groups": {
            name: {"layers": plan.groups[name], "dim": g.dim, "rank": g.rank, "explicit": g.explicit, "bytes": g.nbytes}
            for name, g in groups.items()
        },
        "layers": {
            s.name: {
                "group": plan.group_of(s.name),
                "dtype": first["dtypes"][s.name],
                "weight_norm": first["weight_norms"][s.name],
            }
            for s in plan.layers
        },
        "engrams": {key: {"bytes": e["bytes"], "norms": e["norms"]} for key, e in engrams.items()},
        "bytes": {"groups": group_bytes, "engrams": engram_bytes, "total": group_bytes + engram_bytes},
        "seconds": dict(seconds),
        "created_at": utc_now(),
    }


def _tokens(stats: GroupedStatistics) -> int | None:
    counts: Sequence[int] = list(getattr(stats, "counts", {}).values())
    return max(counts) if counts else None
