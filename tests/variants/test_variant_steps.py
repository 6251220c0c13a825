"""A variant job's result splits its time into named steps (issue 27: what a user waits for, by part).

``bench.e2e`` reads ``result.steps`` to show where the seconds between POST and ready go; each step
must be there, measured (not zero by construction), and together no more than the job's own
``seconds`` (the steps are disjoint parts of it, plus the request read before its clock starts).
"""

from __future__ import annotations

from typing import Any

from tests.helpers.store_world import StoreWorld
from tests.helpers.variants import build
from tests.helpers.variants import world as world  # noqa: PLC0414  (the shared module-scoped fixture)

STEPS = ["request", "model", "universe", "model_files", "scales", "write", "upload", "manifest"]


def test_a_built_variant_reports_each_step_once_within_its_seconds(world: dict[str, Any]) -> None:
    w: StoreWorld = world["world"]
    variant = build(w, "v/llama", {"forget": -0.9}, reference=["forget", "retain"])
    job = w.ctx.jobs.get(variant.job_id)
    assert job is not None and job.result is not None
    steps = job.result["steps"]
    assert list(steps) == STEPS, steps
    assert all(seconds >= 0 for seconds in steps.values())
    assert steps["write"] > 0 and steps["upload"] > 0, "the steps that move bytes take measurable time"
    inside = sum(seconds for name, seconds in steps.items() if name != "request")
    assert inside <= job.result["seconds"] + 0.01, (steps, job.result["seconds"])
    # The universe this variant needed was built in its job: that time is part of its universe step.
    assert job.result["universe_built_s"] is None or steps["universe"] >= job.result["universe_built_s"] - 0.01
