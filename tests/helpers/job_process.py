"""The embedded job process of a live server, found, paused and measured through ``/proc`` (Linux)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engram_fixtures.live import LiveServer
from tests.helpers.app import InProcessServer
from tests.helpers.proc import children, cmdline

__all__ = ["alive", "children", "cmdline", "job_process", "own_job_process", "paused", "peak_rss_bytes"]


def job_process(server: LiveServer, timeout: float = 60.0) -> int:
    """The pid of the server's job process (multiprocessing's spawn child, not its resource tracker)."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in children(server.process.pid):
            line = cmdline(pid)
            if "spawn_main" in line and "resource_tracker" not in line:
                return pid
        if time.monotonic() > deadline:
            raise AssertionError(f"no job process under the server {server.process.pid}")
        time.sleep(0.1)


def own_job_process(server: InProcessServer, timeout: float = 60.0) -> int:
    """The job process an in-process server (``tests.helpers.app``) spawned: the child of this process
    that was not there before the server started. An earlier module's server may still be stopping its
    own job process in the same xdist worker, so "this process's only spawned child" is not enough."""
    deadline = time.monotonic() + timeout
    while True:
        found = [
            pid
            for pid in children(os.getpid())
            if pid not in server.children_before and "spawn_main" in cmdline(pid) and "resource_tracker" not in cmdline(pid)
        ]
        if len(found) == 1:
            return found[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"expected one job process started by the server, found {found}")
        time.sleep(0.1)


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (``VmHWM``) so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def template_children(pid: int) -> list[int]:
    """The chat-template render processes a job process runs now."""
    return [child for child in children(pid) if "service.engine.template_child" in cmdline(child)]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie or a reaped process does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in {"Z", "X"}


@contextmanager
def paused(pid: int) -> Iterator[None]:
    """``pid`` stopped (SIGSTOP) for the block, then continued (SIGCONT)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
