"""Job records and the embedded executor.

A job is a small JSON record (kind, status, progress, error, result, timestamps) plus the IDs its
task needs (``payload``). Tasks take a job ID, re-read everything from storage and write
content-addressed outputs, so running one twice is harmless.

In embedded mode (no broker) records live in memory and are persisted to storage on every state
change; jobs that were queued or running when the process stopped are queued again at start-up.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, Literal

from service.storage import ObjectNotFound, Storage

JobKind = Literal["collect", "variant"]
FINISHED = {"succeeded", "failed", "cancelled"}


def utc_now() -> str:
    return datetime.now(UTC).isoformat()


def new_job(kind: JobKind, payload: dict[str, Any], unit: str) -> dict[str, Any]:
    """A fresh queued job record."""
    return {
        "job_id": uuid.uuid4().hex,
        "kind": kind,
        "status": "queued",
        "progress": {"done": 0, "total": 0, "unit": unit},
        "error": None,
        "result": None,
        "created_at": utc_now(),
        "started_at": None,
        "finished_at": None,
        "payload": payload,
        "cancel_requested": False,
    }


class JobStore:
    """Job records in memory, persisted to ``jobs/<id>.json`` on every state change."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._jobs: dict[str, dict[str, Any]] = {}
        self._lock = threading.RLock()

    def create(self, job: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._jobs[job["job_id"]] = job
            self._persist(job)
            return dict(job)

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                job = self._load(job_id)
            return None if job is None else _copy(job)

    def update(self, job_id: str, *, persist: bool = True, **fields: Any) -> dict[str, Any]:
        """Set fields of a job; ``persist=False`` for frequent progress ticks."""
        with self._lock:
            job = self._jobs.get(job_id) or self._load(job_id)
            if job is None:
                raise KeyError(job_id)
            job.update(fields)
            if persist:
                self._persist(job)
            return _copy(job)

    def set_progress(self, job_id: str, done: int, total: int | None = None) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            job["progress"]["done"] = done
            if total is not None:
                job["progress"]["total"] = total

    def unfinished(self) -> list[dict[str, Any]]:
        """Jobs persisted as queued or running (after a restart: interrupted ones)."""
        found = []
        for key in self.storage.list("jobs/"):
            job_id = key.removeprefix("jobs/").removesuffix(".json")
            job = self.get(job_id)
            if job is not None and job["status"] not in FINISHED:
                found.append(job)
        return found

    def _load(self, job_id: str) -> dict[str, Any] | None:
        if not job_id.isalnum():
            return None
        try:
            job = self.storage.get_json(f"jobs/{job_id}.json")
        except ObjectNotFound:
            return None
        self._jobs[job_id] = job
        return job

    def _persist(self, job: dict[str, Any]) -> None:
        self.storage.put_json(f"jobs/{job['job_id']}.json", job)


def _copy(job: dict[str, Any]) -> dict[str, Any]:
    return {**job, "progress": dict(job["progress"])}


class EmbeddedExecutor:
    """Runs jobs in background threads of the API process: one lane per job kind.

    Collection and variant building get separate single-thread lanes, so a compose does not wait
    behind a long collection, and two collections never fight over the same cores.
    """

    def __init__(self, run_job: Callable[[str], None]) -> None:
        self._run_job = run_job
        self._lanes = {
            "collect": ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-collect"),
            "variant": ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-variant"),
        }

    def submit(self, job: dict[str, Any]) -> None:
        self._lanes[job["kind"]].submit(self._run_job, job["job_id"])

    def shutdown(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
