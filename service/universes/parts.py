"""A universe's parts, and one process's share in computing them.

The parts of a universe are its input groups' pseudo-inverse factors (``groups/<group>.safetensors``)
and its members' engrams (``engrams/<member>.safetensors``, its ``.json`` sidecar last). Any process
may compute a part: the job, or a helper (:func:`service.universes.build.help_build_universe`).
Each part is claimed through a lease (:mod:`service.jobs.leases`: Redis in distributed mode,
granted at once in embedded mode), and whoever computes it writes ``parts/<kind>-<name>.json``
(who, how long, from what) before publishing it. A part is computed once: a claimed part is skipped
by the others, and a worker that dies holding one stops renewing its lease, which expires, and the
part is claimed again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from service.context import Context
from service.engine.checkpoint import CheckpointReader
from service.engine.compose import GroupedStatistics
from service.engine.layers import LayerSpec
from service.engine.layout import ModelLayout
from service.engine.linalg import PinvFactors
from service.engine.stats_io import StatisticsFile
from service.engrams.build import write_member_engrams
from service.engrams.manifest import UniverseManifest
from service.errors import JobFailed
from service.jobs.leases import Leases, LocalLeases, RedisLeases, worker_name
from service.jobs.progress import Progress
from service.jobs.store import utc_now
from service.models.loaded import checked_model_files
from service.models.record import ModelRecord
from service.models.registry import get_model
from service.statistics.key import StatsKey
from service.statistics.local import statistics
from service.storage.keys import canonical_digest, engram_key, group_key, part_key, universe_prefix
from service.storage.local_copies import local_object
from service.universes.factors import (
    GroupFile,
    RowsExact,
    decompose_group,
    group_file,
    load_factors,
    member_group_keys,
    rows_groups,
    save_factors,
)
from service.universes.records import StoredPlan, find_request
from service.universes.service import member_keys
from service.universes.spec import UNIVERSE_FORMAT, UniverseSpec

log = logging.getLogger("engram.universes")

# How often a builder waiting on parts others hold looks again (one listing of the universe's folders).
POLL_S = 0.25


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

    def stored(self) -> StoredPlan:
        """What ``plan.json`` records of it: the groups and the layers' names."""
        return StoredPlan(
            groups={g: tuple(names) for g, names in self.groups.items()}, layers=tuple(s.name for s in self.layers)
        )


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


@dataclass
class UniverseBuild:
    """One process's view of a universe being built: what it holds, what is published, and the
    computation of each part (an input group's factors, a member's engrams)."""

    ctx: Context
    universe_id: str
    spec: UniverseSpec
    model: ModelRecord
    plan: UniversePlan
    members: dict[str, StatisticsFile]  # statistics prefix -> its statistics
    member_of: dict[str, str]  # member key -> statistics prefix
    leases: Leases
    # The groups this build computes (a stage: all of them, or those a request needs first) and the
    # stage's name ("" for the whole universe at once: its engram files are named as they always were).
    stage: tuple[str, ...] = ()
    stage_name: str = ""
    computed: dict[str, int] = field(default_factory=lambda: {"groups": 0, "members": 0})
    _local: dict[str, Path] = field(default_factory=dict)  # groups this process computed, as scratch files
    _reader: CheckpointReader | None = None

    @classmethod
    def open(cls, ctx: Context, universe_id: str) -> UniverseBuild:
        """Read the universe's request, its model and its members' statistics (local copies).

        Raises:
            JobFailed: the universe is unknown, its model changed, or its members share no layer.
        """
        request = find_request(ctx, universe_id)
        if request is None:
            raise JobFailed(f"universe {universe_id} does not exist")
        spec = request.spec
        model = get_model(ctx, spec.model_id)
        if model.digest != spec.model_digest:
            raise JobFailed(f"model {spec.model_id} was re-registered with other weights")
        members = {prefix: statistics(ctx, prefix) for prefix in spec.prefixes}
        plan = plan_universe(model.layout, members)
        member_of = {key: prefix for prefix, key in member_keys(sorted(members)).items()}
        build = cls(ctx, universe_id, spec, model, plan, members, member_of, _leases(ctx, universe_id))
        return build.for_stage(plan.groups)

    def for_stage(self, groups: Collection[str]) -> UniverseBuild:
        """Build only ``groups`` (and every member's engrams of their layers): one stage of the universe.

        Its name is a digest of the groups (the same groups, the same name: a stage cut short, or built
        by two requests at once, is resumed and shared, not duplicated), "" when it is every group.
        """
        unknown = sorted(set(groups) - set(self.plan.groups))
        if unknown:
            raise JobFailed(f"universe {self.universe_id} has no input group {', '.join(unknown)}")
        self.stage = tuple(g for g in self.plan.groups if g in set(groups))
        whole = len(self.stage) == len(self.plan.groups)
        self.stage_name = "" if whole else stage_name(self.stage)
        return self

    @property
    def stage_layers(self) -> list[LayerSpec]:
        """The layers of this stage's groups, in layout order."""
        held = set(self.stage)
        return [s for s in self.plan.layers if self.plan.group_of(s.name) in held]

    def member_file(self, member: str) -> str:
        """The name of a member's engram file of this stage (``engrams/<name>.safetensors``)."""
        return f"{member}~{self.stage_name}" if self.stage_name else member

    @property
    def total_steps(self) -> int:
        return len(self.stage) + len(self.stage_layers) * len(self.members)

    def group_order(self) -> list[str]:
        """The groups, widest first: the longest decompositions start first, so the last one to finish
        is a short one (the build's wall time is closest to its work divided among the builders)."""
        first = self.members[min(self.members)]  # the plan names each group by the first member's key
        return sorted(self.stage, key=lambda g: -first.dims.get(g, 0))

    def published(self) -> tuple[set[str], set[str]]:
        """The groups and members published so far (two listings)."""
        prefix = universe_prefix(self.universe_id)
        stored = set(self.ctx.storage.list(prefix + "groups/"))
        groups = {g for g in self.stage if group_key(self.universe_id, g) in stored}
        stored = set(self.ctx.storage.list(prefix + "engrams/"))
        members = {m for m in self.member_of if engram_key(self.universe_id, self.member_file(m), ".json") in stored}
        return groups, members

    def part_name(self, kind: str, name: str) -> str:
        """A part's name in its lease and record: a group's, or the member's engram file of this stage."""
        return name if kind == "group" else self.member_file(name)

    def _is_published(self, kind: str, name: str) -> bool:
        if kind == "group":
            return self.ctx.storage.exists(group_key(self.universe_id, name))
        return self.ctx.storage.exists(engram_key(self.universe_id, self.member_file(name), ".json"))

    # ------------------------------------------------------------ the loop

    def run(self, scratch: Path, progress: Progress, *, finish: bool) -> dict[str, float]:
        """Claim and compute parts until every one is published (``finish``: the job), or, for a
        helper, until only members others hold are left (what others hold is theirs; while groups
        are held elsewhere a helper waits, since the members come after them).

        Returns:
            Seconds spent: ``decomposition`` (until every group was published), ``engrams``, ``total``.
        """
        credit = _Credit(progress, len(self.stage_layers))
        order = self.group_order()
        started = time.perf_counter()
        decomposed: float | None = None
        while True:
            groups, members = self.published()
            credit.observe([("group", g) for g in groups] + [("member", m) for m in members])
            missing = [("group", g) for g in order if g not in groups]
            if not missing and decomposed is None:
                decomposed = time.perf_counter()
            todo = missing or [("member", m) for m in sorted(self.member_of) if m not in members]
            if not todo:
                break
            if self._claim_one(todo, scratch, credit):
                continue
            if not finish and not missing:
                break  # a helper: only members others hold are left
            progress.advance(0)  # waiting for parts others hold: still honour a cancellation
            time.sleep(POLL_S)
        finished = time.perf_counter()
        assert decomposed is not None or not finish
        split = decomposed or finished
        return {
            "decomposition": round(split - started, 3),
            "engrams": round(finished - split, 3),
            "total": round(finished - started, 3),
        }

    def _claim_one(self, todo: list[tuple[str, str]], scratch: Path, credit: _Credit) -> bool:
        """Compute the first part of ``todo`` no one else holds; False when others hold them all."""
        for kind, name in todo:
            with self.leases.claim(f"{kind}:{self.part_name(kind, name)}") as held:
                if not held:
                    continue
                if not self._is_published(kind, name):  # another may have published it since the listing
                    if kind == "group":
                        self.compute_group(name, scratch)
                    else:
                        self.compute_member(name, scratch, partial(credit.partial, ("member", name)))
                return True
        return False

    # ------------------------------------------------------------ groups

    def compute_group(self, group: str, scratch: Path) -> None:
        """Decompose one input group and publish its factors (its record first)."""
        started = time.perf_counter()
        factors, source = decompose_group(self.ctx, self.members, self.plan.member_groups[group], self.spec.rcond)
        file = scratch / f"group-{self.computed['groups']}.safetensors"
        save_factors(factors, file, group, self.spec.rcond, source)
        seconds = round(time.perf_counter() - started, 3)
        info = group_file(file)
        record = {
            "part": "group", "name": group, "worker": worker_name(), "seconds": seconds, "source": source,
            "dim": info.dim, "rank": info.rank, "explicit": info.explicit, "bytes": info.nbytes,
        }  # fmt: skip
        self.ctx.storage.put_json(part_key(self.universe_id, "group", group), record)
        self.ctx.storage.put_file(group_key(self.universe_id, group), file)
        if self.ctx.storage.local_path(group_key(self.universe_id, group)) is not None:
            file.unlink()  # file storage: read the published object in place
        else:
            self._local[group] = file  # kept for this process's own members: no download back
        self.computed["groups"] += 1
        log.info(
            "universe %s: group %s decomposed from %s by %s (D=%d, rank %d) in %.3fs",
            self.universe_id, group, source, worker_name(), info.dim, info.rank, seconds,
        )  # fmt: skip

    def group_files(self) -> dict[str, GroupFile]:
        """This stage's groups' factors as local files (call once they are all published)."""
        files = {}
        for group in self.stage:
            path = self._local.get(group) or local_object(self.ctx, group_key(self.universe_id, group))
            files[group] = group_file(path)
        return files

    # ------------------------------------------------------------ members

    def compute_member(self, member: str, scratch: Path, on_layer: Callable[[], None]) -> None:
        """Compute one member's engrams of every layer of this stage and publish them (the sidecar last)."""
        started = time.perf_counter()
        prefix = self.member_of[member]
        files = self.group_files()
        stats: GroupedStatistics = self.members[prefix]
        exact = rows_groups(files)
        if exact:  # groups decomposed from rows: this member's Σ_k from its rows too (as Σ_U saw them)
            stats = RowsExact(self.ctx, prefix, stats, member_group_keys(self.plan.member_groups, prefix, exact))
        reader = self.reader()
        name = self.member_file(member)
        file = scratch / f"{name}.safetensors"
        info = write_member_engrams(
            file,
            stats,
            self.stage_layers,
            _LastGroup(self.plan, files),
            reader.layer_weights,
            lambda spec: reader.stored_dtype(reader.layout.weight_keys[spec.name]),
            on_layer=on_layer,
            device=self.ctx.settings.torch_device,
        )
        seconds = round(time.perf_counter() - started, 3)
        record = {"part": "member", "name": name, "worker": worker_name(), "seconds": seconds, "bytes": info.nbytes}
        self.ctx.storage.put_json(part_key(self.universe_id, "member", name), record)
        self.ctx.storage.put_file(engram_key(self.universe_id, name), file)
        file.unlink()
        self.ctx.storage.put_json(engram_key(self.universe_id, name, ".json"), info.to_json())  # last: published
        self.computed["members"] += 1
        log.info("universe %s: engrams of member %s written by %s in %.3fs", self.universe_id, name, worker_name(), seconds)

    def reader(self) -> CheckpointReader:
        if self._reader is None:
            layout = self.model.layout
            self._reader = CheckpointReader(checked_model_files(self.ctx, self.model), layout)
        return self._reader

    # ------------------------------------------------------------ manifest

    def manifest(self, seconds: Mapping[str, float]) -> UniverseManifest:
        """This stage's manifest (every part of it published): members, its groups and layers, bytes,
        seconds; the plan's other groups deferred (none for a universe built at once: its manifest)."""
        spec, plan = self.spec, self.plan
        keys = member_keys(sorted(self.members))
        engrams = {
            m: self.ctx.storage.get_json(engram_key(self.universe_id, self.member_file(m), ".json"))
            for m in sorted(self.member_of)
        }
        groups = {g: self._group_info(g) for g in self.stage}
        layers = [s.name for s in self.stage_layers]
        files = {key: {"files": {self.member_file(key): layers}} if self.stage_name else {} for key in engrams}
        deferred = {g: names for g, names in plan.groups.items() if g not in groups}
        first = next(iter(engrams.values()))
        group_bytes = sum(int(g["bytes"]) for g in groups.values())
        engram_bytes = sum(int(e["bytes"]) for e in engrams.values())
        return UniverseManifest.model_validate(
            {
                "format": UNIVERSE_FORMAT,
                "universe_id": spec.universe_id,
                "model_id": spec.model_id,
                "model_digest": spec.model_digest,
                "rcond": spec.rcond,
                "members": [
                    {
                        "names": sorted(m.name for m in spec.members if m.stats == prefix),
                        "stats": prefix,
                        "dataset_digest": StatsKey.parse(prefix).dataset_digest,
                        "key": keys[prefix],
                        "tokens": self.members[prefix].tokens,
                    }
                    for prefix in sorted(self.members)
                ],
                "groups": {name: {"layers": plan.groups[name], **info} for name, info in groups.items()},
                "layers": {
                    s.name: {
                        "group": plan.group_of(s.name),
                        "dtype": first["dtypes"][s.name],
                        "weight_norm": first["weight_norms"][s.name],
                    }
                    for s in self.stage_layers
                },
                "engrams": {key: {"bytes": e["bytes"], "norms": e["norms"], **files[key]} for key, e in engrams.items()},
                "bytes": {"groups": group_bytes, "engrams": engram_bytes, "total": group_bytes + engram_bytes},
                "seconds": dict(seconds),
                "created_at": utc_now(),
                **({"deferred": deferred} if deferred else {}),
            }
        )

    def _group_info(self, group: str) -> dict[str, Any]:
        """A group's shape and origin: from its part record (no download), else from its file."""
        record = self.ctx.storage.find_json(part_key(self.universe_id, "group", group))
        if record is None:  # published before part records were kept
            found = group_file(self._local.get(group) or local_object(self.ctx, group_key(self.universe_id, group)))
            record = {"dim": found.dim, "rank": found.rank, "explicit": found.explicit, "bytes": found.nbytes}
            record["source"] = found.source
        fields = ("dim", "rank", "explicit", "bytes", "source", "worker", "seconds")
        return {k: record[k] for k in fields if k in record}


def stage_name(groups: Collection[str]) -> str:
    """A stage's name: a digest of its groups (16 hex digits)."""
    return canonical_digest(sorted(groups))[:16]


def _leases(ctx: Context, universe_id: str) -> Leases:
    """Redis leases where the job store is Redis (distributed mode); else every claim is granted."""
    client = getattr(ctx.jobs, "redis", None)
    if client is None:
        return LocalLeases()
    return RedisLeases(client, f"universe:{universe_id}", ctx.settings.heartbeat_ttl_s)


class _Credit:
    """The job's progress per part: a group is one step, a member one per layer. A part this process
    computes is credited as it goes; one another worker published, when it is seen."""

    def __init__(self, progress: Progress, member_steps: int) -> None:
        self.progress, self.member_steps = progress, member_steps
        self.given: dict[tuple[str, str], int] = {}

    def partial(self, part: tuple[str, str]) -> None:
        self.given[part] = self.given.get(part, 0) + 1
        self.progress.advance()

    def observe(self, parts: list[tuple[str, str]]) -> None:
        owed = 0
        for part in parts:
            weight = 1 if part[0] == "group" else self.member_steps
            owed += max(0, weight - self.given.get(part, 0))
            self.given[part] = max(weight, self.given.get(part, 0))
        if owed:
            self.progress.advance(owed)


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
