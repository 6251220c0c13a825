"""Which job kinds exist, where each runs and which function does its work: the one table.

The table names each body by its import path instead of importing it, so the processes that only
route jobs (the API, which queues them or hands them to its job process) never import a body, nor
torch and transformers behind it: :func:`service.execution.runner.run_job` imports a body where it runs.
It is also what keeps ``service.execution`` free of the domains: a body, a kind's helper and a
periodic duty are named here as strings and imported where they run, so no module of this package
imports a domain package (``tests/test_architecture.py`` holds it so).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel

from service.jobs.records import JobKind, JobRecord
from service.jobs.results import RESULTS

# A body reads its payload with job.payload_of(<its kind's payload model>, service.jobs.records.PAYLOADS)
# and returns its kind's result model (service.jobs.results.RESULTS); a JSON object is validated as it.
Body = Callable[[Any, JobRecord], BaseModel | dict[str, Any]]
Queue = Literal["gpu", "cpu"]
Lane = Literal["collect", "variant", "inference", "map", "register"]


# A helper's body, ``(ctx, subject_id, job_id) -> Any``: its return value is only logged.
HelperBody = Callable[[Any, str, str], Any]


@dataclass(frozen=True)
class Helper:
    """Messages that help a running job of a kind with its work: not jobs (no record, and a failure
    fails nothing: whatever a helper could not do, its job does itself). They run on the kind's queue.

    Attributes:
        body_path: ``module:function`` of the domain's helper, ``(ctx, subject_id, job_id) -> Any``.
        task: the Celery task's name (stable: messages in flight name it).
        subject: the keyword naming what is helped with in a message (stable, as ``task``).
    """

    body_path: str
    task: str
    subject: str

    @property
    def body(self) -> HelperBody:
        """The helper function, imported on first use (in the process that runs it)."""
        helper: HelperBody = _import(self.body_path)
        return helper


@dataclass(frozen=True)
class Kind:
    """Where a job kind runs, and what runs it.

    Attributes:
        body_path: ``module:function`` of the domain's function that does the work, ``(ctx, job) -> result``.
        queue: distributed mode's Celery queue: ``gpu`` where the model runs or the work costs far
            more than a copy, ``cpu`` for arithmetic builds and downloads.
        task: the Celery task's name (stable: messages in flight name it).
        lane: embedded mode's thread lane in the job process (one job at a time per lane, so a
            compose never waits behind a long collection, and a quick evaluation neither).
        result: the model of the body's result (:data:`service.jobs.results.RESULTS`).
        helper: what idle workers may run to help a job of this kind, if anything.
    """

    body_path: str
    queue: Queue
    task: str
    lane: Lane
    result: type[BaseModel]
    helper: Helper | None = None

    @property
    def body(self) -> Body:
        """The body function, imported on first use (in the process that runs the job)."""
        body: Body = _import(self.body_path)
        return body


def import_bodies() -> None:
    """Import every job body now, with torch, transformers and the domains behind them.

    A process that runs jobs calls this when it starts, before its first job: importing the bodies
    costs seconds of CPU (2.4 s for the variant body alone on the project's 2-core machine), which
    the first job after a restart would otherwise wait for (issue 27: a variant should cost about a
    checkpoint copy, also right after a restart)."""
    for kind in KINDS.values():
        _import(kind.body_path)
        if kind.helper is not None:
            _import(kind.helper.body_path)


@cache
def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


KINDS: dict[JobKind, Kind] = {
    "collect": Kind("service.concepts.collection:run_collection", "gpu", "engram.collect", "collect", RESULTS["collect"]),
    "variant": Kind("service.variants.build:run_variant", "cpu", "engram.build_variant", "variant", RESULTS["variant"]),
    # A universe costs far more than a copy (float64 eigh and W·Σ_k·Σ_U⁺ products): GPU workers take it.
    # Its helpers compute parts no one holds yet, claimed by lease (service.universes.build).
    "universe": Kind(
        "service.universes.build:run_universe",
        "gpu",
        "engram.build_universe",
        "variant",
        RESULTS["universe"],
        Helper("service.universes.helper_job:help_universe", "engram.help_universe", "universe_id"),
    ),
    "evaluate": Kind("service.evaluation.run:run_evaluation", "gpu", "engram.evaluate", "inference", RESULTS["evaluate"]),
    "generate": Kind("service.evaluation.run:run_generation", "gpu", "engram.generate", "inference", RESULTS["generate"]),
    # It runs the model over probes, candidate after candidate (and its variant's job inline).
    "calibrate": Kind(
        "service.calibration.job:run_calibration_job", "gpu", "engram.calibrate", "inference", RESULTS["calibrate"]
    ),
    # A map loads weights and decomposes Σ_U, as a universe build does; its own lane in embedded
    # mode, so a map waits neither for a collection nor for a variant.
    "map": Kind("service.maps.build:run_map", "gpu", "engram.build_map", "map", RESULTS["map"]),
    # Downloading and hashing a remote checkpoint: network and disk, no accelerator.
    "register": Kind(
        "service.models.inspection:run_registration", "cpu", "engram.register_model", "register", RESULTS["register"]
    ),
}
# The kinds whose jobs may be helped, with their helpers.
HELPERS: dict[JobKind, Helper] = {name: kind.helper for name, kind in KINDS.items() if kind.helper is not None}

# What an API process runs every ENGRAM_JANITOR_INTERVAL_S (the janitor's periodic pass), each
# ``(ctx) -> what it removed``: the universes', the variants' and the audit log's retention rules.
DUTIES: tuple[str, ...] = (
    "service.universes.retention:expire_unused",
    "service.variants.retention:expire_variants",
    "service.storage.audit_retention:expire_audit",
)
Duty = Callable[[Any], list[str]]


def duties() -> list[Duty]:
    """The periodic duties, imported now (by the process that will run them, before its threads start)."""
    return [_import(path) for path in DUTIES]
