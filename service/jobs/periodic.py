"""Periodic background duties of an API process (the reconciler, the callback dispatcher)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from service.storage.base import StorageUnavailable

log = logging.getLogger("engram.background")


class PeriodicDuty:
    """Runs ``step`` on a daemon thread every ``interval_s`` seconds, or at once after :meth:`wake`.

    Args:
        name: names the thread and the log lines.
        step: one pass of the duty.
        interval_s: seconds between passes.
        lock: a factory of a lock shared by every API process (a Redis lock): a pass runs only in
            the process that acquires it without waiting, so the duty runs once per cluster.
            ``None``: every pass runs (embedded mode has one process).

    A pass that fails is logged and the next one tries again: a storage or Redis outage must not
    end the thread.
    """

    def __init__(self, name: str, step: Callable[[], Any], interval_s: float, lock: Callable[[], Any] | None = None):
        self.name, self.step, self.interval_s, self.lock = name, step, interval_s, lock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"engram-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)

    def wake(self) -> None:
        """Run a pass now rather than at the next interval."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._pass()
            except (StorageUnavailable, OSError) as exc:
                log.warning("%s pass skipped: %s", self.name, exc)
            except Exception:
                log.exception("%s pass failed", self.name)

    def _pass(self) -> None:
        if self.lock is None:
            self.step()
            return
        lock = self.lock()
        if lock.acquire(blocking=False):
            try:
                self.step()
            finally:
                lock.release()
