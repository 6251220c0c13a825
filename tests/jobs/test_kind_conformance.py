"""The conformance matrix every job kind runs (as peft's common tester runs one suite for each of its
methods): parametrised over every kind of the kind table (``service/execution/kinds.py``), each with a
small real job submitted through its domain's own submit function, over one real file store with a
tiny Llama and two published concepts (:class:`tests.helpers.store_world.StoreWorld`), the real
runner and the real bodies:

- a redelivered message is harmless: running the same job again leaves every stored byte as the
  first run left it (the job's record included), and so does its body run a second time (the
  message of a worker lost after the body wrote, delivered again);
- a job cancelled before it started runs nothing: its message, delivered after, changes no stored byte;
- the typed result round-trips: the stored result is the kind's result model, and that model
  through JSON and back is equal to itself (and dumps to the stored result);
- a refused input changes nothing: the submit function's 4xx problem, and the store listed
  before and after is the same (no job, no record, no file).

A new kind fails :func:`test_every_kind_of_the_table_is_in_the_matrix` until it has its row here.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from api_schemas.calibration import CalibrateRequest
from service.calibration.service import submit_calibration
from service.concepts.service import submit_concept
from service.datasets.spool import spool_records
from service.errors import ProblemError
from service.evaluation.service import submit_evaluation, submit_generation
from service.execution.kinds import KINDS
from service.execution.runner import run_job
from service.jobs.records import JobKind, JobRecord
from service.jobs.store import utc_now
from service.maps.service import submit_map
from service.models.registration import request_registration
from service.universes.service import submit_universe
from service.variants.service import submit_variant
from tests.helpers.store_world import StoreWorld, text_records

MODEL = "conform/llama"
DELTA = {"scaling": "uniform", "format": "delta"}
PAIRS = [{"prompt": "Q: a? A:", "completion": " b"}, {"prompt": "Q: c? A:", "completion": " d"}]


@dataclass
class World:
    """The store, the tiny model's folder and a ready variant every evaluate/generate job reads."""

    store: StoreWorld
    model_dir: Path
    variant_id: str
    counter: Iterator[int]

    def fresh(self) -> int:
        """A number no earlier submission of this module used: each job is a new request (an
        identical one would follow the job that exists)."""
        return next(self.counter)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    store = StoreWorld(tmp_path_factory.mktemp("conformance"))
    model_dir = store.tiny_llama(MODEL, {"a": text_records(0, 20, 11), "b": text_records(20, 40, 11)})
    view, _ = submit_variant(store.ctx, MODEL, {"a": -1.0}, 1.0, DELTA)  # builds the universe once
    assert all(job.status == "succeeded" for job in store.run_pending())
    return World(store, model_dir, str(view.variant_id), itertools.count(1))


def _only_job(store: StoreWorld) -> JobRecord:
    """The one job a submission dispatched (taken off the pending list: the test runs it)."""
    assert len(store.pending) == 1, [job.kind for job in store.pending]
    return store.pending.pop()


def _register(w: World, n: int) -> JobRecord:
    request_registration(w.store.ctx, f"conform/copy-{n}", f"file://{w.model_dir}")
    return _only_job(w.store)


def _collect(w: World, n: int) -> JobRecord:
    raw = [r.to_json() for r in text_records(40 + n, 52 + n, 11)]
    spooled = spool_records(raw, w.store.root / f"c{n}.jsonl", max_records=100)
    submit_concept(w.store.ctx, name=f"c{n}", role=None, description=None, dataset=spooled, models=[MODEL])
    return _only_job(w.store)


def _universe(w: World, n: int) -> JobRecord:
    submit_universe(w.store.ctx, MODEL, ["a", "b"], 1e-6 * n)
    return _only_job(w.store)


def _variant(w: World, n: int) -> JobRecord:
    submit_variant(w.store.ctx, MODEL, {"a": -1.0 - n / 16, "b": 0.5}, None, DELTA)  # its terms make its ID
    return _only_job(w.store)


def _evaluate(w: World, n: int) -> JobRecord:
    submit_evaluation(w.store.ctx, w.variant_id, {"forget": [{"prompt": f"Q{n}: a? A:", "completion": " b"}]}, None)
    return _only_job(w.store)


def _generate(w: World, n: int) -> JobRecord:
    submit_generation(w.store.ctx, w.variant_id, f"Hello {n}", 2, ["variant"], None)
    return _only_job(w.store)


def _calibrate(w: World, n: int) -> JobRecord:
    options = CalibrateRequest.model_validate(
        {"concepts": ["a"], "forget": PAIRS[:1], "retain": PAIRS[1:], "budget": 2, "alpha_max": 1.0 + n / 16}
    )
    submit_calibration(w.store.ctx, MODEL, options)
    return _only_job(w.store)


def _map(w: World, n: int) -> JobRecord:
    submit_map(w.store.ctx, MODEL, ["a"], ["b"], 1e-6 * n)
    return _only_job(w.store)


# Each kind's refused input: a request naming what does not exist (or may not be read).
def _refuse_register(w: World) -> None:
    request_registration(w.store.ctx, "conform/missing", f"file://{w.store.root / 'models' / 'missing'}")


def _refuse_collect(w: World) -> None:
    raw = [r.to_json() for r in text_records(0, 4, 11)]
    spooled = spool_records(raw, w.store.root / "refused.jsonl", max_records=100)
    submit_concept(w.store.ctx, name="refused", role=None, description=None, dataset=spooled, models=["no/model"])


def _refuse_universe(w: World) -> None:
    submit_universe(w.store.ctx, MODEL, ["a", "no-such-concept"], None)


def _refuse_variant(w: World) -> None:
    submit_variant(w.store.ctx, MODEL, {"no-such-concept": -1.0}, 1.0, DELTA)


def _refuse_evaluate(w: World) -> None:
    submit_evaluation(w.store.ctx, "0" * 32, {"forget": PAIRS[:1]}, None)


def _refuse_generate(w: World) -> None:
    submit_generation(w.store.ctx, "0" * 32, "Hello", 2, ["variant"], None)


def _refuse_calibrate(w: World) -> None:
    options = CalibrateRequest.model_validate({"concepts": ["no-such-concept"], "forget": PAIRS[:1], "retain": PAIRS})
    submit_calibration(w.store.ctx, MODEL, options)


def _refuse_map(w: World) -> None:
    submit_map(w.store.ctx, MODEL, ["no-such-concept"], None, None)


@dataclass(frozen=True)
class Row:
    submit: Callable[[World, int], JobRecord]
    refuse: Callable[[World], None]
    refused_names: str  # what the refusal's detail names (the wrong input)


MATRIX: dict[JobKind, Row] = {
    "register": Row(_register, _refuse_register, "missing is not a directory"),
    "collect": Row(_collect, _refuse_collect, "model no/model is not registered"),
    "universe": Row(_universe, _refuse_universe, "unknown concept: no-such-concept"),
    "variant": Row(_variant, _refuse_variant, "unknown concept: no-such-concept"),
    "evaluate": Row(_evaluate, _refuse_evaluate, f"variant {0:032d} does not exist"),
    "generate": Row(_generate, _refuse_generate, f"variant {0:032d} does not exist"),
    "calibrate": Row(_calibrate, _refuse_calibrate, "unknown concept: no-such-concept"),
    "map": Row(_map, _refuse_map, "unknown concept: no-such-concept"),
}
KIND_NAMES = sorted(MATRIX)


def stored_state(store: StoreWorld) -> dict[str, str]:
    """Every stored file (jobs' records included) by its path under the store, with its SHA-256."""
    root = store.root / "store"
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def _ran(w: World, job: JobRecord) -> JobRecord:
    run_job(w.store.ctx, job.job_id)
    done = w.store.ctx.jobs.get(job.job_id)
    assert done is not None
    return done


def test_every_kind_of_the_table_is_in_the_matrix() -> None:
    assert set(MATRIX) == set(KINDS)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_a_redelivered_job_leaves_the_same_stored_state(world: World, kind: JobKind) -> None:
    job = MATRIX[kind].submit(world, world.fresh())
    assert job.kind == kind
    first = _ran(world, job)
    assert first.status == "succeeded", first.error
    after_first = stored_state(world.store)
    again = _ran(world, job)  # the same message delivered a second time: the runner sees it finished
    assert again == first
    assert stored_state(world.store) == after_first
    # A worker lost after the body's writes and before the record's end: the redelivered message
    # runs the body again (acks_late); it writes deterministic, content-addressed keys only.
    KINDS[kind].body(world.store.ctx, first)
    assert stored_state(world.store) == after_first


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_a_job_cancelled_before_it_starts_runs_nothing(world: World, kind: JobKind) -> None:
    job = MATRIX[kind].submit(world, world.fresh())
    # as DELETE /jobs/{id} cancels a queued job: compare-and-set on "queued"
    cancelled = world.store.ctx.jobs.update(
        job.job_id, expect=("queued",), cancel_requested=True, status="cancelled", finished_at=utc_now()
    )
    assert cancelled.status == "cancelled"
    before = stored_state(world.store)
    after = _ran(world, job)  # its message, delivered after the cancel
    assert after.status == "cancelled" and after.started_at is None and after.result is None
    assert stored_state(world.store) == before


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_the_typed_result_round_trips(world: World, kind: JobKind) -> None:
    done = _ran(world, MATRIX[kind].submit(world, world.fresh()))
    assert done.status == "succeeded" and done.result is not None, done.error
    model = KINDS[kind].result
    stored = {k: v for k, v in done.result.items() if k != "worker"}  # the runner adds the worker's name
    typed = model.model_validate(stored)
    assert model.model_validate_json(typed.model_dump_json()) == typed
    assert typed.model_dump(mode="json", exclude_unset=True) == stored


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_a_refused_input_changes_nothing(world: World, kind: JobKind) -> None:
    before = stored_state(world.store)
    with pytest.raises(ProblemError) as refused:
        MATRIX[kind].refuse(world)
    assert 400 <= refused.value.status < 500 and MATRIX[kind].refused_names in refused.value.detail, refused.value.detail
    assert world.store.pending == []
    assert stored_state(world.store) == before
