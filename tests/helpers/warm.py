"""The session's trained fixtures, built in the background while the tests before them run.

Fixtures that read a trained model from the fixture cache (engram_fixtures.cache) are listed in
:data:`WARMED_FIXTURES` with the builder of each one's entry. A session that uses any of them starts
one background process (one torch thread: on a 2-core machine it mostly takes the core the tests
leave idle) that builds those entries in the order the session first needs them (``python -m
engram_fixtures.cache warm``). It runs at the tests' priority, not niced: a fixture may wait for it,
and on a machine loaded by other work a niced process gets next to no CPU (nice 10 against eight busy
processes: 3% of a core, a one-minute training in half an hour). A
fixture that gets there first waits on the entry's lock for the build in progress, or builds an entry
not yet started itself: either way one training per entry and cache, and the tests read the same
bytes (one thread, the same code). The process is stopped at the end of the session (SIGTERM: the
build in progress removes its staging folder).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from engram_fixtures.cache import default_cache_dir

# fixture name -> the builder (module:function, no arguments) of the cache entry it reads
WARMED_FIXTURES = {
    "mini_tofu_demo": "engram_fixtures.demo:mini_tofu",  # tests/conftest.py
    "retain_model": "engram_fixtures.demo:tofu_retain_model",  # tests/e2e/test_calibrate_tofu.py
    "chat_demo": "engram_fixtures.demo:chat_tofu",  # tests/e2e/test_chat_tofu.py
    "mini_cifar": "engram_fixtures.mini_cifar:build_mini_cifar",  # tests/e2e/test_{mini_cifar,vision_api,...}.py
}
STOPPED = (0, -signal.SIGTERM, 128 + signal.SIGTERM, -signal.SIGKILL)  # done, or stopped by stop()


@dataclass
class Warming:
    process: subprocess.Popen[bytes]
    log: Path
    builders: list[str]


def builders_for(items: Iterable[object]) -> list[str]:
    """The builders of :data:`WARMED_FIXTURES` that ``items`` (pytest items) use, in order of first use."""
    builders: list[str] = []
    for item in items:
        for fixture, builder in WARMED_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()) and builder not in builders:
                builders.append(builder)
    return builders


def start(builders: list[str], cache: Path | None = None) -> list[Warming]:
    """One background process that builds ``builders`` in turn (none when there are none)."""
    if not builders:
        return []
    folder = cache or default_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f".warm-{os.getpid()}.log"
    command = [sys.executable, "-m", "engram_fixtures.cache", "warm", *builders]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ENGRAM_FIXTURE_CACHE": str(folder)}
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    return [Warming(process, log, builders)]


def stop(warming: Warming) -> None:
    """Stop the process if it still runs (the session needed less than was warmed: -x, -k)."""
    if warming.process.poll() is None:
        warming.process.terminate()
        try:
            warming.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            warming.process.kill()
            warming.process.wait()


def failure(warming: Warming) -> str | None:
    """What to say when the process failed (its log's end); None when it finished or was stopped (the
    log is then removed)."""
    if warming.process.returncode in STOPPED:
        warming.log.unlink(missing_ok=True)
        return None
    tail = warming.log.read_text(errors="replace")[-2000:] if warming.log.exists() else ""
    return f"fixture warm-up ({', '.join(warming.builders)}) exited {warming.process.returncode}, log {warming.log}:\n{tail}"
