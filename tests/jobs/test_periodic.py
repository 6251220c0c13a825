"""Periodic duties of an API process (``service.jobs.periodic.PeriodicDuty``): a pass every interval
or at once when woken, a failing pass never ends the thread, and with a shared lock a pass runs
only where the lock was free."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from service.jobs.periodic import PeriodicDuty
from service.storage.base import StorageUnavailable


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_duty_runs_every_interval_until_stopped() -> None:
    passes: list[float] = []
    duty = PeriodicDuty("tick", lambda: passes.append(time.monotonic()), interval_s=0.05)
    duty.start()
    assert wait_for(lambda: len(passes) >= 3)
    duty.stop()
    count = len(passes)
    time.sleep(0.2)
    assert len(passes) == count, "no pass after stop"
    assert not any(t.name == "engram-tick" and t.is_alive() for t in threading.enumerate())


def test_waking_a_duty_runs_a_pass_now() -> None:
    passes: list[int] = []
    duty = PeriodicDuty("slow", lambda: passes.append(1), interval_s=60)
    duty.start()
    try:
        time.sleep(0.1)
        assert passes == []
        duty.wake()
        assert wait_for(lambda: passes == [1], timeout_s=2)
    finally:
        duty.stop()


def test_a_failing_pass_is_logged_and_the_next_one_runs() -> None:
    errors = [StorageUnavailable("S3 down"), OSError("disk"), RuntimeError("bug")]
    passes: list[int] = []

    def step() -> None:
        passes.append(1)
        if errors:
            raise errors.pop(0)

    duty = PeriodicDuty("flaky", step, interval_s=0.02)
    duty.start()
    try:
        assert wait_for(lambda: len(passes) >= 5), "the thread survived every kind of failure"
    finally:
        duty.stop()


def test_a_pass_runs_only_where_the_shared_lock_is_free() -> None:
    shared = threading.Lock()  # stands for the Redis lock every API process shares
    passes: list[int] = []
    duty = PeriodicDuty("locked", lambda: passes.append(1), interval_s=0.02, lock=lambda: shared)
    shared.acquire()  # another process holds it
    duty.start()
    try:
        time.sleep(0.2)
        assert passes == []
        shared.release()
        assert wait_for(lambda: len(passes) >= 2)
        assert shared.acquire(timeout=1), "each pass releases the lock"
        shared.release()
    finally:
        duty.stop()
