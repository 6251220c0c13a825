"""Watching a universe being built in parts (tests/universes/test_universe_parts.py and
test_universe_stages.py): which input groups were decomposed and by which thread, builders sharing
one Redis lease scope, and several builders run at once on threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from service.context import Context
from service.jobs.leases import RedisLeases
from service.jobs.progress import NoProgress
from service.universes import parts as parts_module
from service.universes.parts import UniverseBuild


@dataclass
class Decompositions:
    """Each call of ``decompose_group`` while watched: the group it decomposed and the thread it ran on."""

    groups: list[str] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)


def watch_decompositions(patch: pytest.MonkeyPatch, delay_s: float = 0.0) -> Decompositions:
    """Record every group decomposition for as long as ``patch`` holds (the real one still runs).

    ``delay_s``: each call sleeps that long first, so that builders on several threads are at work at once.
    """
    seen = Decompositions()
    real = parts_module.decompose_group

    def watched(*args: Any) -> Any:
        time.sleep(delay_s)
        seen.groups.append(args[2])
        seen.threads.append(threading.current_thread().name)
        return real(*args)

    patch.setattr(parts_module, "decompose_group", watched)
    return seen


def leased_build(ctx: Context, client: redis.Redis, universe_id: str, ttl_s: float = 2) -> UniverseBuild:
    """A builder of ``universe_id`` whose parts are leased in Redis (the scope every worker shares)."""
    build = UniverseBuild.open(ctx, universe_id)
    build.leases = RedisLeases(client, f"universe:{universe_id}", ttl_s)
    return build


def run_on_threads(builds: Sequence[UniverseBuild], scratch: Path, timeout_s: float = 120) -> None:
    """Each build's ``run(finish=True)`` on its own thread (``b0``, ``b1``, …), each with its own scratch
    folder under ``scratch``, all started before any is joined."""
    threads = []
    for i, build in enumerate(builds):
        (scratch / str(i)).mkdir()
        threads.append(
            threading.Thread(target=build.run, args=(scratch / str(i), NoProgress()), kwargs={"finish": True}, name=f"b{i}")
        )
        threads[-1].start()
    for thread in threads:
        thread.join(timeout=timeout_s)
