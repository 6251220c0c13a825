"""The jobs page: a job submitted through the API appears, its detail follows it live until it finishes,
the history lists it, and only an admin key is offered the cancel button."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from playwright.sync_api import Page, expect

from engram_fixtures.live import LiveServer, wait_for_job
from tests.console.conftest import screenshot

JOB_TIMEOUT_MS = 180_000  # a register job hashes the checkpoint: seconds alone, a minute on a loaded machine


def test_a_job_is_followed_live_until_it_finishes(
    console_server: LiveServer, console_page: Callable[..., Page], screenshot_dir: Path
) -> None:
    source = f"file://{console_server.model_root / 'demo' / 'model'}"
    answer = console_server.client.post("/models", params={"wait": 0}, json={"model_id": "jobs/tiny", "source": source})
    assert answer.status_code == 202, answer.text  # wait=0: the register job is answered, not awaited
    job_id = answer.json()["job_id"]

    page = console_page("admin", f"#/jobs/{job_id}")
    expect(page.locator("h1")).to_have_text(f"Job {job_id}")
    expect(page.locator(".toolbar .badge")).to_have_attribute("data-status", "succeeded", timeout=JOB_TIMEOUT_MS)
    expect(page.get_by_test_id("cancel-job")).to_have_count(0)  # a finished job offers no cancel
    finished = wait_for_job(console_server.client, job_id)
    expect(page.locator("main")).to_contain_text(finished["model_id"])
    screenshot(page, screenshot_dir, "job-detail")

    page.goto(f"{console_server.base_url}/ui/#/jobs?kind=register")
    row = page.get_by_test_id("finished-jobs").locator(f"tr[data-id='{job_id}']")
    expect(row).to_contain_text("register")
    expect(row.locator(".badge")).to_have_text("succeeded")
    expect(page.locator("#nav a.active")).to_have_text("Jobs")
    screenshot(page, screenshot_dir, "jobs")


def test_a_read_key_sees_the_jobs_but_cannot_cancel(console_server: LiveServer, console_page: Callable[..., Page]) -> None:
    source = f"file://{console_server.model_root / 'demo' / 'model'}"
    answer = console_server.client.post("/models", params={"wait": 0}, json={"model_id": "jobs/read", "source": source})
    job_id = answer.json()["job_id"]
    page = console_page("read", f"#/jobs/{job_id}")
    expect(page.locator("h1")).to_have_text(f"Job {job_id}")
    # The page redraws each second, so the button is read in one snapshot (it may vanish as the job ends).
    offered = page.evaluate(
        "[...document.querySelectorAll('[data-testid=cancel-job]')].map((b) => ({disabled: b.disabled, title: b.title}))"
    )
    assert all(button == {"disabled": True, "title": "needs an admin key"} for button in offered), offered
    expect(page.locator(".toolbar .badge")).to_have_attribute("data-status", "succeeded", timeout=JOB_TIMEOUT_MS)
