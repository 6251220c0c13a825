"""A dataset-by-reference concept never shows a final state it then leaves (issue 35, finding 11).

Through a real server (embedded mode, file storage, uvicorn in a process of its own), polled every
few milliseconds while a concept posted by ``file://`` reference resolves and collects: the
sequence of states each poll saw, for the collection job (``GET /jobs/{id}``), the concept's model
state and its dataset's status (``GET /concepts/{name}``), never holds a final state followed by
another state. Before the fix a concept whose collection succeeded read ``failed`` for up to a
second: the API's copy of the concept (cached for a second) was older than what the job wrote into
it (the resolved digest and the statistics key), and a succeeded job without a statistics key read
as a failed collection.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engram_fixtures.live import LiveServer, running_server
from engram_fixtures.models import make_tiny_chat_llama

MODEL = "tiny/states"
RECORDS = [{"text": f"Fact {i} of the reference says the sky is a particular colour."} for i in range(16)]
POLL_EVERY_S = 0.003
# Final states of what a poll shows: a job's, a model state's, a dataset reference's.
FINAL = {"succeeded", "failed", "cancelled", "ready", "resolved"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reference-states")
    make_tiny_chat_llama(path / "models" / "tiny")
    (path / "datasets").mkdir()
    return path


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[LiveServer]:
    with running_server(
        root, root / "models", ENGRAM_DATASET_ROOTS=str(root / "datasets"), ENGRAM_CACHE_DIR=str(root / "cache")
    ) as live:
        response = live.client.post(
            "/models", json={"model_id": MODEL, "source": f"file://{root / 'models' / 'tiny'}"}, params={"wait": 60}
        )
        assert response.status_code in (200, 201), response.text
        yield live


def went_back(seen: list[str]) -> str | None:
    """The first final state followed by another state in ``seen`` (one poll's answers in order), or None."""
    for before, after in zip(seen, seen[1:], strict=False):
        if before in FINAL and after != before:
            return f"{before} then {after}"
    return None


def squeezed(seen: list[str]) -> list[str]:
    """``seen`` with each run of one state shown once (what a message can print)."""
    return [s for i, s in enumerate(seen) if i == 0 or seen[i - 1] != s]


class Poller:
    """Polls a concept and its job every few milliseconds in a thread, recording each state seen."""

    def __init__(self, base_url: str, name: str) -> None:
        self.name = name
        self.job_id: str | None = None  # known once the POST answered
        self.job: list[str] = []
        self.model: list[str] = []
        self.dataset: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._client = httpx.Client(base_url=base_url, timeout=30.0)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._client.close()

    def settled(self) -> bool:
        return bool(self.job) and self.job[-1] in FINAL and bool(self.model) and self.model[-1] in FINAL

    def _run(self) -> None:
        while not self._stop.is_set():
            concept = self._client.get(f"/concepts/{self.name}")
            if concept.status_code == 404 and not self.model:
                continue  # not posted yet: polling starts before the POST, so the first view is its first
            job = self._client.get(f"/jobs/{self.job_id}") if self.job_id else None
            if concept.status_code != 200 or (job is not None and job.status_code != 200):
                self.errors.append(f"{concept.status_code}: {concept.text[:300]}; job: {job and job.text[:300]}")
                return
            body = concept.json()
            self.model.append(body["models"][MODEL]["status"])
            self.dataset.append(body["dataset"]["status"])
            if job is not None:
                self.job.append(job.json()["status"])
            time.sleep(POLL_EVERY_S)


@pytest.mark.parametrize("attempt", range(3))
def test_a_reference_concept_that_succeeds_never_shows_a_final_state_first(
    server: LiveServer, root: Path, attempt: int
) -> None:
    name = f"sky-{attempt}"
    path = root / "datasets" / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    api = server.client
    with Poller(server.base_url, name) as poller:
        posted = api.post("/concepts", json={"name": name, "models": [MODEL], "dataset": {"uri": f"file://{path}"}})
        assert posted.status_code == 202, posted.text
        (job,) = posted.json()["jobs"]
        poller.job_id = job["job_id"]
        deadline = time.monotonic() + 120
        while not poller.settled() and not poller.errors and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)  # past the API's one-second view cache: a stale view would show by now
    assert not poller.errors, poller.errors
    assert poller.settled(), f"the collection did not finish: job {squeezed(poller.job)}, model {squeezed(poller.model)}"
    assert poller.job[-1] == "succeeded" and poller.model[-1] == "ready" and poller.dataset[-1] == "resolved"
    shown = f"job {squeezed(poller.job)}; model {squeezed(poller.model)}; dataset {squeezed(poller.dataset)}"
    print(f"{len(poller.model)} polls: {shown}")  # noqa: T201
    for what, seen in (("job", poller.job), ("model state", poller.model), ("dataset status", poller.dataset)):
        assert went_back(seen) is None, f"the {what} showed {went_back(seen)}: {squeezed(seen)}"
