"""The universe job body: decompose each input group of ``Σ_U`` once, then store every member's engrams.

Phases (the job's progress counts steps: one per group, then one per member and layer):

1. ``plan.json``: the layers every member has statistics for and their input groups.
2. Per input group: ``Σ_U = Σ_k Σ_k`` and its pseudo-inverse factors, published as
   ``groups/<group>.safetensors``: from the members' rows when all of them kept rows and together
   have fewer tokens than the group is wide (``T²·D``), else from the sums (float64 ``eigh``, ``D³``).
3. Per member: ``E_k,l`` of every layer (:mod:`service.engrams.build`), published as
   ``engrams/<member>.safetensors`` and its ``.json`` sidecar (norms).
4. ``manifest.json``, last.

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
from pathlib import Path
from typing import Any

from service.context import Context
from service.engrams.manifest import UniverseManifest
from service.jobs.progress import JobCancelled, JobProgress, NoProgress, Progress
from service.jobs.records import JobRecord, UniversePayload
from service.jobs.store import FINISHED
from service.storage.base import scratch_dir
from service.storage.keys import universe_manifest_key, universe_plan_key
from service.universes import retention
from service.universes.parts import UniverseBuild
from service.universes.records import find_manifest

log = logging.getLogger("engram.universes")


def run_universe(ctx: Context, job: JobRecord) -> dict[str, Any]:
    """The ``universe`` job: build it (or find it built), with idle workers' help where there are any."""
    progress = JobProgress(ctx, job.job_id, 0)
    universe_id = job.payload_of(UniversePayload).universe_id
    manifest, reused = ensure_universe(ctx, universe_id, progress, job_id=job.job_id)
    return {
        "universe_id": manifest.universe_id,
        "reused": reused,
        "bytes": manifest.bytes.total,
        "seconds": manifest.seconds,
    }


def ensure_universe(
    ctx: Context, universe_id: str, progress: Progress | None = None, *, job_id: str | None = None
) -> tuple[UniverseManifest, bool]:
    """The universe's manifest, building whatever of it is missing first.

    Args:
        progress: told of each step; a :class:`JobProgress` is first given the number of steps.
        job_id: the job building it; given, idle workers are asked to help (``ctx.universe_helpers``,
            distributed mode), and they stop when that job ends or is cancelled.

    Returns:
        (manifest, whether it existed already).

    Raises:
        JobFailed: the universe is unknown, its model changed, or its members share no layer.
    """
    existing = find_manifest(ctx, universe_id)
    if existing is not None:
        return existing, True
    build = UniverseBuild.open(ctx, universe_id)
    plan_key = universe_plan_key(universe_id)
    if not ctx.storage.exists(plan_key):
        ctx.storage.put_json(plan_key, build.plan.stored().to_json())
    steps = progress or NoProgress()
    if isinstance(steps, JobProgress):
        steps.restart(build.total_steps)
    helpers = _ask_for_helpers(ctx, build, job_id)
    log.info(
        "building universe %s (job %s): %d groups, %d members, %d helpers asked",
        universe_id, job_id, len(build.plan.groups), len(build.members), helpers,
    )  # fmt: skip
    with scratch_dir("universe") as tmp:
        seconds = build.run(Path(tmp), steps, finish=True)
        manifest = build.manifest(seconds)
    ctx.storage.put_json(universe_manifest_key(universe_id), manifest.to_json())  # last: the universe now exists
    retention.mark_built(ctx, universe_id)
    return manifest, False


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
    with scratch_dir("universe-helper") as tmp:
        build.run(Path(tmp), watch, finish=False)
    return dict(build.computed)


def _ask_for_helpers(ctx: Context, build: UniverseBuild, job_id: str | None) -> int:
    """Send helper tasks (at most ``ENGRAM_UNIVERSE_HELPERS``, one fewer than the parts left: the job
    computes parts too); returns how many."""
    if job_id is None or ctx.universe_helpers is None:
        return 0
    groups, members = build.published()
    missing = len(build.plan.groups) - len(groups) + len(build.member_of) - len(members)
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
