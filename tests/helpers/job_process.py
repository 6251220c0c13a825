"""The embedded job process of a live server, found, paused and measured through ``/proc`` (Linux)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engram_fixtures.live import LiveServer


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (every thread's children)."""
    found: list[int] = []
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(p) for p in listing.read_text().split()]
        except OSError:
            continue
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


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


def own_job_process() -> int:
    """The job process of an in-process server (``tests.helpers.app``): this process's spawned child."""
    found = [pid for pid in children(os.getpid()) if "spawn_main" in cmdline(pid) and "resource_tracker" not in cmdline(pid)]
    assert len(found) == 1, found
    return found[0]


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
