"""The universe budget capped to the store's volume is a warning only when the operator set it (issue 40:
every start warned about a budget the user never set)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from service.config import Settings
from service.context import Context
from service.jobs.store import JobStore
from service.storage.local import LocalStorage
from service.universes import holdings

pytestmark = pytest.mark.fast


def budget_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture, **settings: object) -> list[logging.LogRecord]:
    storage = LocalStorage(tmp_path / "store")
    ctx = Context(
        # A millionth of any volume is below the default budget, on whatever disk the test runs.
        settings=Settings(cache_dir=tmp_path / "cache", universe_volume_fraction=1e-6, **settings),  # type: ignore[arg-type]
        storage=storage,
        jobs=JobStore(storage),
        dispatch=lambda job: None,
        lock=threading.RLock(),
    )
    holdings._logged.clear()  # once per process and budget: each case starts from a process that said nothing
    with caplog.at_level(logging.INFO, logger="engram.universes"):
        budget = holdings.effective_budget(ctx)
    assert budget.bytes < budget.configured, "the test needs a budget above the volume's share"
    return [r for r in caplog.records if "ENGRAM_UNIVERSE_VOLUME_FRACTION" in r.getMessage()]


def test_the_default_budget_capped_to_the_volume_is_said_at_info(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    [record] = budget_logs(tmp_path, caplog)
    assert record.levelno == logging.INFO and "the default budget" in record.getMessage()


def test_a_budget_the_operator_set_above_the_volume_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    [record] = budget_logs(tmp_path, caplog, universe_bytes_budget=1 << 60)
    assert record.levelno == logging.WARNING and "lower ENGRAM_UNIVERSE_BYTES_BUDGET" in record.getMessage()
