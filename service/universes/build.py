"""The universe job body: decompose each input group of ``Σ_U`` once, then store every member's engrams.

Phases (the job's progress counts steps: one per group, then one per member and layer):

1. ``plan.json``: the layers every member has statistics for and their input groups.
2. Per input group: ``Σ_U = Σ_k Σ_k`` and its pseudo-inverse factors, published as
   ``groups/<group>.safetensors``: from the members' rows when all of them kept rows and together
   have fewer tokens than the group is wide (``T²·D``), else from the sums (float64 ``eigh``, ``D³``).
3. Per member: ``E_k,l`` of every layer (:mod:`service.engrams.build`), published as
   ``engrams/<member>.safetensors`` and its ``.json`` sidecar (norms).
4. ``manifest.json``, last.

A request that edits some layers only (a variant of ``q_proj,k_proj,gate_proj``) needs only their input
groups: :func:`ensure_universe` given ``layers`` builds a *stage* of the universe, those groups and every
member's engrams of their layers, published as ``engrams/<member>~<stage>.safetensors`` and recorded last
in ``stages/<stage>.json`` (a manifest of those groups, the others ``deferred``), and answers the union
of the stages stored so far; the other groups wait until a request needs them. ``manifest.json`` is
written once every group is built (by a stage, or by a ``universe`` job building the rest), so a
partial universe is never taken for a built one; readers refuse by name a layer of a deferred group
(:class:`~service.engrams.manifest.GroupNotBuilt`). A stage is named by a digest of its groups: a stage
cut short is resumed, and two requests that need the same missing groups share one stage's parts.
The job's progress names the groups built for it and those deferred (``progress.groups``).

The groups, then the members, are parts that any process may compute, each claimed through a lease
(:mod:`service.jobs.leases`: Redis in distributed mode, where the universe job also asks idle workers to
help, :func:`help_build_universe`; granted at once in embedded mode, where the job builds alone).
Whoever computes a part writes ``parts/<kind>-<name>.json`` (who, how long, from what) before
publishing it. A part is computed once: a claimed part is skipped by the others, and a worker that
dies holding one stops renewing its lease, which expires, and the part is claimed again.

Every part is content-addressed by the universe, so a build that was cut short (a worker killed, a
redelivered message) publishes only what is missing: groups and members already stored are read,
not computed again. A build whose manifest exists finishes at once.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from pathlib import Path

from service.context import Context
from service.engrams.manifest import UniverseManifest, merge_stages
from service.jobs.progress import JobCancelled, NoProgress, Progress, ProgressReporter
from service.jobs.records import JobRecord, UniversePayload
from service.jobs.results import UniverseResult
from service.jobs.store import FINISHED
from service.storage.base import scratch_dir
from service.storage.keys import universe_manifest_key, universe_plan_key
from service.universes import retention
from service.universes.parts import UniverseBuild, UniversePlan
from service.universes.records import build_target_key, find_manifest, find_stages, stage_key

log = logging.getLogger("engram.universes")


def run_universe(ctx: Context, job: JobRecord) -> UniverseResult:
    """The ``universe`` job: build it (or find it built), with idle workers' help where there are any."""
    progress = ProgressReporter(ctx, job.job_id, 0)
    universe_id = job.payload_of(UniversePayload).universe_id
    manifest, reused = ensure_universe(ctx, universe_id, progress, job_id=job.job_id)
    return UniverseResult(
        universe_id=manifest.universe_id, reused=reused, bytes=manifest.bytes.total, seconds=manifest.seconds
    )


def ensure_universe(
    ctx: Context,
    universe_id: str,
    progress: Progress | None = None,
    *,
    job_id: str | None = None,
    layers: Collection[str] | None = None,
) -> tuple[UniverseManifest, bool]:
    """The universe's manifest, building whatever of it is missing first (of ``layers``' groups only,
    when given).

    Args:
        progress: told of each step; a :class:`ProgressReporter` is first given the number of steps.
        job_id: the job building it; given, idle workers are asked to help (``ctx.universe_helpers``,
            distributed mode), and they stop when that job ends or is cancelled; unless it builds the
            whole universe at once, its progress names the groups built for it and those deferred.
        layers: the layers the request reads (None: every layer, the whole universe). Their input
            groups are built first, alone; the answer is then partial (``deferred`` names the groups
            not built) unless every group is built. A layer the universe does not hold is left to the
            readers, which refuse it by name.

    Returns:
        (manifest, whether it existed already: nothing was built).

    Raises:
        JobFailed: the universe is unknown, its model changed, or its members share no layer.
    """
    existing = find_manifest(ctx, universe_id)
    if existing is not None:
        return existing, True
    build = UniverseBuild.open(ctx, universe_id)
    plan = build.plan
    plan_key = universe_plan_key(universe_id)
    if not ctx.storage.exists(plan_key):
        ctx.storage.put_json(plan_key, plan.stored().to_json())
    stages = find_stages(ctx, universe_id)
    built = {g for stage in stages for g in stage.groups}
    # No layer the universe holds (the readers refuse them by name): as before stages, the whole universe.
    needed = (needed_groups(plan, layers) if layers is not None else []) or list(plan.groups)
    missing = [g for g in needed if g not in built]
    if len(missing) < len(plan.groups):  # a universe built at once says nothing more than before
        deferred = [g for g in plan.groups if g not in built and g not in missing]
        _note_groups(ctx, job_id, built=missing, deferred=deferred)
    if missing:
        stages.append(_build_stage(ctx, build.for_stage(missing), progress, job_id))
    if build.stage_name == "" and missing:  # every group at once: the stage is the universe
        manifest = stages[-1]
    else:
        manifest = merge_stages(universe_id, stages, plan.groups, [s.name for s in plan.layers])
    if manifest.partial:
        return manifest, not missing
    ctx.storage.put_json(universe_manifest_key(universe_id), manifest.to_json())  # last: the universe now exists
    retention.mark_built(ctx, universe_id)
    return manifest, not missing


def needed_groups(plan: UniversePlan, layers: Collection[str]) -> list[str]:
    """The input groups of ``layers`` that the universe holds, in plan order."""
    wanted = set(layers)
    return [g for g, names in plan.groups.items() if wanted.intersection(names)]


def _build_stage(ctx: Context, build: UniverseBuild, progress: Progress | None, job_id: str | None) -> UniverseManifest:
    """Compute and publish a stage's parts, then its record (a partial stage's ``stages/<name>.json``)."""
    universe_id = build.universe_id
    steps = progress or NoProgress()
    if isinstance(steps, ProgressReporter):
        steps.restart(build.total_steps)
    if job_id is not None and build.stage_name:  # what helpers of this job build: this stage, not the rest
        ctx.storage.put_json(build_target_key(universe_id, job_id), {"groups": list(build.stage)})
    helpers = _ask_for_helpers(ctx, build, job_id)
    log.info(
        "building universe %s (job %s): %d of %d groups (stage %r), %d members, %d helpers asked",
        universe_id, job_id, len(build.stage), len(build.plan.groups), build.stage_name, len(build.members), helpers,
    )  # fmt: skip
    with scratch_dir("universe") as tmp:
        seconds = build.run(Path(tmp), steps, finish=True)
        manifest = build.manifest(seconds)
    if build.stage_name:
        ctx.storage.put_json(stage_key(universe_id, build.stage_name), manifest.to_json())  # last: the stage exists
    return manifest


def _note_groups(ctx: Context, job_id: str | None, *, built: Sequence[str], deferred: Sequence[str]) -> None:
    """Say in the job's progress which groups it builds (those its layers need, not built yet) and
    which it leaves for later."""
    job = ctx.jobs.get(job_id) if job_id is not None else None
    if job is None:
        return
    counts = {**job.progress.model_dump(), "groups": {"built": list(built), "deferred": list(deferred)}}
    ctx.jobs.update(job.job_id, progress=counts)


def help_build_universe(ctx: Context, universe_id: str, job_id: str) -> dict[str, int]:
    """A helper's share of a universe that job ``job_id`` builds: claim and compute parts until none
    is left to claim (what others hold is theirs: if they die, the job itself takes it over).

    Returns:
        How many groups and members this helper computed.

    Raises:
        JobCancelled: the job ended or was cancelled (checked between parts and layers).
    """
    watch = _JobWatch(ctx, job_id)
    watch.advance(0)
    if find_manifest(ctx, universe_id) is not None:
        return {"groups": 0, "members": 0}
    build = UniverseBuild.open(ctx, universe_id)
    target = ctx.storage.find_json(build_target_key(universe_id, job_id))
    if target is not None:  # the job builds one stage: help with it, not with the groups it defers
        build.for_stage(target["groups"])
    with scratch_dir("universe-helper") as tmp:
        build.run(Path(tmp), watch, finish=False)
    return dict(build.computed)


def _ask_for_helpers(ctx: Context, build: UniverseBuild, job_id: str | None) -> int:
    """Send helper tasks (at most ``ENGRAM_UNIVERSE_HELPERS``, one fewer than the parts left: the job
    computes parts too); returns how many."""
    if job_id is None or ctx.universe_helpers is None:
        return 0
    groups, members = build.published()
    missing = len(build.stage) - len(groups) + len(build.member_of) - len(members)
    count = min(ctx.settings.universe_helpers, missing - 1)
    if count > 0:
        ctx.universe_helpers(build.universe_id, job_id, count)
    return max(count, 0)


class _JobWatch:
    """A helper's progress: counts nothing, stops when the job it helps has ended or is cancelled."""

    def __init__(self, ctx: Context, job_id: str) -> None:
        self.ctx, self.job_id = ctx, job_id

    def advance(self, amount: int = 1) -> None:
        job = self.ctx.jobs.get(self.job_id)
        if job is None or job.status in FINISHED or job.cancel_requested:
            raise JobCancelled()
