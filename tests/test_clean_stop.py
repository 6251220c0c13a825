"""SIGTERM stops the API cleanly (issue 40: every stop ended with "resource_tracker: There appear to be 6
leaked semaphore objects to clean up at shutdown", the embedded job process's two queues): a real
``engram-service serve`` that ran a job is stopped as ``docker stop`` and ``make run``'s Ctrl-C stop it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from engram_fixtures.live import start_server, stop_server
from tests.helpers.api import register_model

pytestmark = pytest.mark.slow


def test_sigterm_after_a_job_leaves_no_leaked_semaphore(tmp_path: Path, model_root: Path, tiny_llama_dir: Path) -> None:
    server = start_server(tmp_path / "store", model_root, tmp_path / "server.log", ENGRAM_LOG_FORMAT="text")
    try:
        register_model(server.client, "stop/tiny", f"file://{tiny_llama_dir}")  # a job ran in the job process
    finally:
        stop_server(server, grace_s=30)
    log = (tmp_path / "server.log").read_text()
    # uvicorn re-raises the signal it handled once it has shut down (-15): a clean stop either way
    assert server.process.returncode in (0, -signal.SIGTERM), log[-3000:]
    assert "Finished server process" in log, log[-3000:]
    assert "leaked" not in log and "Traceback" not in log, log[-3000:]
