"""Start-up removal of what crashed processes left behind.

A process that dies mid-way (OOM kill, SIGKILL, power loss) leaves its temporary files: scratch
folders (``storage.scratch_dir``), LocalStorage's half-written objects (``<root>/.tmp/``), S3
multipart uploads never completed, ``.partial-*`` model downloads and ``.part``/``.download`` files
of the statistics disk cache (both under ``ENGRAM_CACHE_DIR``). Every API process and worker runs
:func:`start_janitor` once when it starts. Several processes may share the machine and the folders,
so a leftover is removed only when no live process can be using it:

- Names that carry an owner (``<pid>.<host tag>``, :func:`service.storage.base.owner_tag`: scratch
  folders and LocalStorage temporary files) and this machine's host tag: removed once the owner is
  gone: no such process, a zombie, or a process that started after the leftover was last changed
  (its pid was reused, since an owner exists before anything it writes). A live owner's are kept
  however old they are.
- Anything else (no owner in the name, another machine's, S3 multipart uploads): removed when
  nothing in it changed for ``stale_after_s``, by default the broker's visibility timeout
  (``ENGRAM_TASK_HARD_LIMIT_S`` + 10%): no task runs longer than that, and a download or an upload
  that made no progress for hours is dead.

Only names this service makes are matched; what cannot be removed (a file of another user) is
logged and left. In the API the sweep runs in a background thread, so a slow storage backend never
delays start-up; a Celery worker sweeps before its pool starts.

The API's janitor thread then runs the periodic pass its runtime hands it (the universes' retention
rule, :func:`service.universes.retention.expire_unused`: universes nobody uses are deleted, least
recently used first) at start-up and every ``ENGRAM_JANITOR_INTERVAL_S`` (0: at start-up only).
That first pass also states the universe budget in force: a ``file://`` store's budget larger than
``ENGRAM_UNIVERSE_VOLUME_FRACTION`` of its volume is capped there, with a warning
(:func:`service.universes.holdings.effective_budget`). Workers do not: one pass per API process
is enough, and each pass holds the registry lock. The pass is handed in, not imported, so that
storage depends on no domain.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from service.config import Settings
from service.storage.base import HOST_TAG, Storage
from service.storage.factory import open_storage
from service.storage.local import LocalStorage

log = logging.getLogger("engram.janitor")

# engram-<prefix>.<pid>.<host tag>.<tempfile's 8 random characters>
SCRATCH = re.compile(r"^engram-[a-z][a-z0-9-]*\.(?P<pid>\d+)\.(?P<host>[0-9a-f]{8})\.[a-z0-9_]{8}$")
# Scratch folders named before owners were: engram-<prefix>-<random> (never engram-metrics-, the live
# Prometheus folder of a worker, which carries no pid and is rewritten in place).
SCRATCH_UNOWNED = re.compile(r"^engram-(?!metrics-)[a-z][a-z-]*-[a-z0-9_]{8}$")
# LocalStorage's <root>/.tmp/<pid>.<host tag>.<uuid hex> (or a bare uuid hex from older versions).
STORAGE_TMP = re.compile(r"^(?:(?P<pid>\d+)\.(?P<host>[0-9a-f]{8})\.)?[0-9a-f]{32}$")
PARTIAL_DOWNLOAD = re.compile(r"^\.partial-")  # service.models.sources: ENGRAM_CACHE_DIR/s3/.partial-*
# service.storage.local_copies.cached_copy and service.statistics.local: ENGRAM_CACHE_DIR/stats/, universes/
STATS_PARTIAL = re.compile(r"^\..+\.(?:part|download)$")
_CLOCK_SLACK_S = 2.0  # /proc's boot time has a resolution of a second


@dataclass
class Sweep:
    """What one pass removed and what it had to leave."""

    removed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def clean_leftovers(settings: Settings, storage: Storage | None = None, *, stale_after_s: float | None = None) -> Sweep:
    """Remove every leftover of a dead process (see the module docstring); returns what it did."""
    stale_s = settings.visibility_timeout_s if stale_after_s is None else stale_after_s
    sweep = Sweep()
    cache = settings.cache_dir
    places: list[tuple[Path, re.Pattern[str]]] = [
        (Path(tempfile.gettempdir()), SCRATCH),
        (Path(tempfile.gettempdir()), SCRATCH_UNOWNED),
        (cache / "s3", PARTIAL_DOWNLOAD),
        (cache / "stats", STATS_PARTIAL),
        (cache / "universes", STATS_PARTIAL),  # service.storage.local_copies: a universe's downloaded parts
    ]
    if isinstance(storage, LocalStorage):
        places.append((storage.tmp_dir, STORAGE_TMP))
    for folder, pattern in places:
        for path, match in _matching(folder, pattern):
            if _is_leftover(path, match, stale_s):
                _remove(path, sweep)
    if storage is not None:
        try:
            aborted = storage.abort_stale_uploads(stale_s)
            sweep.removed += [f"{aborted} unfinished upload(s) in {storage!r}"] if aborted else []
        except Exception as exc:  # storage may be down at start-up: the next start tries again
            log.warning("janitor: cannot list unfinished uploads in %r: %s", storage, exc)
    if sweep.removed or sweep.failed:
        log.info("janitor: removed %d leftover(s) %s; could not remove %s", len(sweep.removed), sweep.removed, sweep.failed)
    return sweep


Pass = Callable[[], list[str]]  # one periodic pass; returns what it removed


def start_janitor(settings: Settings, storage: Storage | None = None, periodic: Pass | None = None) -> Janitor:
    """Run :func:`clean_leftovers` once in a daemon thread, then, given the API's ``periodic`` pass
    (the universes' retention rule), that pass at once and every ``ENGRAM_JANITOR_INTERVAL_S``;
    returns the thread."""
    janitor = Janitor(settings, storage, periodic)
    janitor.start()
    return janitor


class Janitor(threading.Thread):
    """The start-up sweep, then the periodic retention passes (a daemon thread; :meth:`stop` ends it)."""

    def __init__(self, settings: Settings, storage: Storage | None, periodic: Pass | None) -> None:
        super().__init__(name="engram-janitor", daemon=True)
        self.settings, self.storage, self.periodic = settings, storage, periodic
        self._stopped = threading.Event()
        self.passes = 0  # retention passes done (tests wait on it)

    def run(self) -> None:
        try:
            clean_leftovers(self.settings, self.storage)
        except Exception:  # never take the process down for a clean-up
            log.exception("janitor: the start-up sweep failed")
        log.info("janitor: start-up sweep done")
        if self.periodic is None:
            return
        interval = self.settings.janitor_interval_s
        while True:
            self.retention_pass(self.periodic)
            if interval <= 0 or self._stopped.wait(interval):
                return

    def retention_pass(self, periodic: Pass) -> list[str]:
        """One pass of the retention rule; a failure is logged and the next pass tries again."""
        try:
            evicted = periodic()
        except Exception:
            log.exception("janitor: the universe retention pass failed")
            evicted = []
        if evicted:
            log.info("janitor: evicted %d unused universe(s): %s", len(evicted), evicted)
        self.passes += 1
        return evicted

    def stop(self) -> None:
        self._stopped.set()


def worker_janitor(settings: Settings) -> Callable[..., None]:
    """A Celery ``worker_init`` receiver that sweeps the worker's machine and storage.

    It runs in the worker's main process before the pool forks its children, so it sweeps in the
    foreground: a thread running across a fork could leave a lock held in a child.
    """

    def on_worker_init(**_: object) -> None:
        try:
            clean_leftovers(settings, open_storage(settings.storage_url, settings.s3_endpoint_url))
        except Exception:  # never keep a worker from starting for a clean-up
            log.exception("janitor: the start-up sweep failed")

    return on_worker_init


# ---------------------------------------------------------------- deciding


def _matching(folder: Path, pattern: re.Pattern[str]) -> Iterator[tuple[Path, re.Match[str]]]:
    try:
        entries = list(os.scandir(folder))
    except OSError:  # no such folder yet: nothing was left there
        return
    for entry in entries:
        match = pattern.match(entry.name)
        if match is not None:
            yield Path(entry.path), match


def _is_leftover(path: Path, match: re.Match[str], stale_s: float) -> bool:
    try:
        changed = path.lstat().st_mtime
    except OSError:
        return False  # gone already
    groups = match.groupdict()
    if groups.get("pid") and groups.get("host") == HOST_TAG:
        return not _owner_alive(int(groups["pid"]), changed)
    return time.time() - _newest_change(path) > stale_s


def _owner_alive(pid: int, changed: float) -> bool:
    """Whether process ``pid`` runs and could have written something last changed at ``changed``."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    started, zombie = _process_start(pid)
    if zombie:
        return False
    return started is None or started <= changed + _CLOCK_SLACK_S


def _process_start(pid: int) -> tuple[float | None, bool]:
    """(start time as a Unix time, is a zombie) from /proc; (None, False) where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
    except (OSError, StopIteration):
        return None, False
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    state, ticks = fields[0], int(fields[19])
    return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK"), state == "Z"


def _newest_change(path: Path) -> float:
    """The latest modification time of ``path`` or of anything below it (links not followed)."""
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for folder, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    newest = max(newest, os.lstat(os.path.join(folder, name)).st_mtime)
                except OSError:
                    continue
    return newest


def _remove(path: Path, sweep: Sweep) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("janitor: cannot remove %s: %s", path, exc)
        sweep.failed.append(str(path))
        return
    sweep.removed.append(str(path))
