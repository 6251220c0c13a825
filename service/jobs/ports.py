"""What the jobs' duties read of a process's context, as a Protocol.

:class:`service.context.Context` carries a job store, so it imports :mod:`service.jobs`; the duties
here (following a repeated request, a job's template renderer) take any object with these
attributes instead of importing it, so the import goes one way: context -> jobs, never back.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from service.config import Settings
from service.jobs.records import JobRecord
from service.jobs.store import JobStore
from service.storage.base import Storage


class JobsContext(Protocol):
    """Settings, storage, the job store, the registry lock and the dispatcher of a process."""

    @property
    def settings(self) -> Settings: ...

    @property
    def storage(self) -> Storage: ...

    @property
    def jobs(self) -> JobStore: ...

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    @property
    def dispatch(self) -> Callable[[JobRecord], None]: ...
