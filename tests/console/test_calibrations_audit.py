"""The calibrations pages and the audit log in the browser.

A calibration of the README's demo model (the mini-TOFU forget facts removed, the exact-match default
goal, a small budget) is run through the API; the console lists it, draws its front with one circle
per candidate (the API's count), lets the axes change, shows a hovered candidate's scores (checked
against the API's to the shown 4 decimals), and builds a clicked candidate with one unlearn request
whose variant carries that candidate's options. The audit log (admin) lists that request under the
write key's fingerprint and never a key. A read key sees the front but its Build button is disabled,
and neither the audit link nor GET /audit is open to it. The "New calibration" form starts one, whose
page follows it live until its front shows; an admin deletes it there.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect

from engram_fixtures.live import LiveServer, wait_concepts_ready, wait_for_job
from service.api.auth import key_identity
from tests.console.conftest import KEYS, screenshot
from tests.helpers.api import register_model

MODEL = "demo/console-cal"
BUDGET = 6
JOB_TIMEOUT_MS = 300_000  # a job on two shared cores: seconds alone, minutes under load
SHOWN_DIGITS = 5e-5  # the tooltip shows each score to 4 decimals


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def demo_probes(console_server: LiveServer) -> dict[str, list[dict[str, Any]]]:
    demo = console_server.model_root / "demo"
    return {"forget": _records(demo / "forget.jsonl"), "retain": _records(demo / "retain.jsonl")}


@pytest.fixture(scope="module")
def calibration(console_server: LiveServer, demo_probes: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The demo model registered with its two concepts, and a finished calibration of it (GET /calibrations/{id})."""
    client = console_server.client
    register_model(client, MODEL, f"file://{console_server.model_root / 'demo' / 'model'}")
    for name, role in (("cal-forget", "target"), ("cal-retain", "reference")):
        records = demo_probes["forget" if name == "cal-forget" else "retain"]
        response = client.post("/concepts", json={"name": name, "role": role, "models": [MODEL], "records": records})
        assert response.status_code == 202, response.text
    wait_concepts_ready(client, ["cal-forget", "cal-retain"], MODEL, timeout=600)
    body = {
        "concepts": ["cal-forget"],
        "forget": demo_probes["forget"],
        "retain": random.Random(5).sample(demo_probes["retain"], 30),
        "budget": BUDGET,
        "module_sets": ["all", "mlp"],
        "scalings": ["uniform"],
    }
    submitted = client.post(f"/models/{MODEL}/calibrate", json=body)
    assert submitted.status_code == 202, submitted.text
    job = wait_for_job(client, submitted.json()["job"]["job_id"], timeout=900)
    assert job["status"] == "succeeded", job
    found: dict[str, Any] = client.get(f"/calibrations/{submitted.json()['calibration_id']}").json()
    assert found["result"]["recommended"] is not None, found["result"]["note"]
    return found


def _points(page: Page) -> Any:
    return page.get_by_test_id("front").get_by_test_id("plot-point")


def _switch_to_nll_ratios(page: Page) -> None:
    page.get_by_test_id("plot-x").select_option("retain_nll_ratio")
    page.get_by_test_id("plot-y").select_option("forget_nll_ratio")
    expect(page.get_by_test_id("plot-x-label")).to_contain_text("retain NLL ratio")
    expect(page.get_by_test_id("plot-y-label")).to_contain_text("forget NLL ratio")


def _uncovered_candidate(page: Page, skip: int) -> int:
    """A candidate (not ``skip``) whose circle is the topmost at its centre, so a pointer reaches it."""
    page.locator("[data-testid=front] svg").scroll_into_view_if_needed()  # elementFromPoint sees the viewport only
    found = page.evaluate(
        """(skip) => [...document.querySelectorAll('[data-testid=front] circle[data-testid=plot-point]')]
            .filter((c) => Number(c.dataset.id) !== skip)
            .map((c) => { const r = c.getBoundingClientRect(), x = r.x + r.width / 2, y = r.y + r.height / 2;
                          return [Number(c.dataset.id), document.elementFromPoint(x, y) === c]; })
            .filter(([, top]) => top).map(([id]) => id)""",
        skip,
    )
    assert found, "every candidate's circle is covered by another's"
    return int(found[0])


def _shown_scores(text: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^([\w.]+): (-?[\d.]+(?:e[-+]?\d+)?)$", text, re.MULTILINE)}


def test_the_list_shows_the_calibration_and_its_recommendation(
    console_page: Callable[..., Page], calibration: dict[str, Any], screenshot_dir: Path
) -> None:
    page = console_page("write", "#/calibrations")
    row = page.get_by_test_id("calibrations").locator(f"tr[data-id='{calibration['calibration_id']}']")
    expect(row).to_contain_text(MODEL)
    expect(row.locator(".badge")).to_have_text("succeeded")
    expect(row).to_contain_text(str(calibration["result"]["evaluations"]))
    expect(row).to_contain_text(calibration["result"]["recommended"]["variant_id"][:12])
    screenshot(page, screenshot_dir, "calibrations")
    row.get_by_role("link", name=calibration["calibration_id"][:12]).click()
    expect(page.locator("h1")).to_have_text(f"Calibration {calibration['calibration_id']}")


def test_the_front_plots_every_candidate_shows_scores_on_hover_and_builds_a_clicked_one(
    console_server: LiveServer, console_page: Callable[..., Page], calibration: dict[str, Any], screenshot_dir: Path
) -> None:
    result, client = calibration["result"], console_server.client
    page = console_page("write", f"#/calibrations/{calibration['calibration_id']}")
    expect(_points(page)).to_have_count(len(result["candidates"]))  # the exact-match axes: every candidate drawn
    expect(page.get_by_test_id("plot-recommended")).to_have_count(1)
    expect(page.get_by_test_id("recommended-variant")).to_contain_text(result["recommended"]["variant_id"])
    expect(page.get_by_test_id("front-png")).to_be_visible()
    _switch_to_nll_ratios(page)
    expect(_points(page)).to_have_count(len(result["candidates"]))  # every ratio is positive: log axes drop none
    page.get_by_test_id("plot-log-x").uncheck()
    expect(_points(page)).to_have_count(len(result["candidates"]))
    expect(page.get_by_test_id("plot-front")).to_have_count(1 if len(result["pareto_front"]) > 1 else 0)
    feasible = sum(c["feasible"] for c in result["candidates"])
    expect(page.locator("[data-testid=front] circle[data-kind=feasible]")).to_have_count(feasible)

    index = _uncovered_candidate(page, skip=result["recommended"]["candidate"])
    candidate = result["candidates"][index]
    page.locator(f"[data-testid=front] circle[data-id='{index}']").hover()
    tooltip = page.get_by_test_id("plot-tooltip")
    expect(tooltip).to_be_visible()
    expect(tooltip).to_contain_text(f"candidate {index}")
    shown = _shown_scores(tooltip.inner_text())
    expected = {
        f"{split}_{field}": candidate[split][field]
        for split in ("forget", "retain")
        for field in ("nll_ratio", "exact_match")
        if candidate[split][field] is not None
    }
    expected.update({k: v for k, v in (candidate.get("metrics") or {}).items() if v is not None})
    assert shown.keys() >= expected.keys(), (shown, expected)
    for name, value in expected.items():
        assert shown[name] == pytest.approx(value, abs=SHOWN_DIGITS), name
    screenshot(page, screenshot_dir, "calibration-front")

    page.locator(f"[data-testid=front] circle[data-id='{index}']").click()
    expect(page.get_by_test_id("selected-candidate")).to_have_attribute("data-index", str(index))
    page.get_by_test_id("build-candidate").click()
    expect(page).to_have_url(re.compile(r"#/variants/[0-9a-f]+$"), timeout=60_000)
    variant_id = page.url.rsplit("/", 1)[1]
    variant = client.get(f"/variants/{variant_id}").json()
    assert variant["job_id"] is not None and variant_id != result["recommended"]["variant_id"]  # a new build
    assert wait_for_job(client, variant["job_id"], timeout=600)["status"] == "succeeded"
    variant = client.get(f"/variants/{variant_id}").json()
    options = candidate["options"]
    assert variant["status"] == "ready" and variant["model_id"] == MODEL
    assert variant["terms"] == {"cal-forget": -options["alpha"]} and variant["alpha"] == options["alpha"]
    assert (variant["scaling"], variant["modules"], variant["layers"]) == (
        options["scaling"],
        options["modules"],
        options["layers"],
    )
    assert variant["module_strengths"] == options["module_strengths"] and variant["universe_id"] == result["universe_id"]
    assert variant["created_by"] == key_identity(KEYS["write"])


def test_the_audit_log_lists_the_build_under_the_keys_fingerprint_and_never_a_key(
    console_server: LiveServer, console_page: Callable[..., Page], calibration: dict[str, Any], screenshot_dir: Path
) -> None:
    page = console_page("admin", "#/audit")
    expect(page.get_by_test_id("audit")).to_be_visible()
    page.get_by_test_id("audit-method").select_option("POST")
    page.get_by_test_id("audit-path_prefix").fill(f"/models/{MODEL}/")
    page.get_by_test_id("audit-filter").click()
    rows = page.get_by_test_id("audit").locator("tbody tr")
    expect(rows.filter(has_text=f"/models/{MODEL}/calibrate")).to_have_count(1)
    expect(rows.filter(has_text=f"/models/{MODEL}/calibrate").get_by_test_id("audit-key")).to_have_text(
        key_identity(KEYS["admin"])
    )
    built = rows.filter(has_text=f"/models/{MODEL}/unlearn")
    # the variant the front's Build sent (the previous test: a module runs whole, in order)
    expect(built.first).to_be_visible()
    expect(built.first.get_by_test_id("audit-key")).to_have_text(key_identity(KEYS["write"]))
    paths = rows.get_by_test_id("audit-path").all_inner_texts()
    assert paths and all(p.startswith(f"/models/{MODEL}/") for p in paths), paths
    text = page.locator("main").inner_text()
    assert not any(key in text for key in KEYS.values())
    screenshot(page, screenshot_dir, "audit")


def test_a_read_key_sees_the_front_but_cannot_build_or_read_the_audit_log(
    console_server: LiveServer, console_page: Callable[..., Page], calibration: dict[str, Any]
) -> None:
    page = console_page("read", f"#/calibrations/{calibration['calibration_id']}")
    expect(_points(page)).to_have_count(len(calibration["result"]["candidates"]))
    _points(page).first.click(force=True)  # the read key may select: only the build is refused
    expect(page.get_by_test_id("build-candidate")).to_be_disabled()
    expect(page.get_by_test_id("delete-calibration")).to_be_disabled()
    expect(page.locator("#nav a[data-section=audit]")).to_be_hidden()
    page.goto(f"{console_server.base_url}/ui/#/audit")
    expect(page.get_by_test_id("problem")).to_contain_text("403")
    refused = httpx.get(f"{console_server.base_url}/audit", headers={"Authorization": f"Bearer {KEYS['read']}"})
    assert refused.status_code == 403, refused.text


def test_the_new_calibration_form_starts_one_and_its_page_follows_it(
    console_server: LiveServer,
    console_page: Callable[..., Page],
    calibration: dict[str, Any],
    demo_probes: dict[str, list[dict[str, Any]]],
) -> None:
    page = console_page("write", "#/calibrations")
    page.get_by_test_id("calibrate-open").click()
    expect(page.get_by_test_id("calibrate-model").locator(f"option[value='{MODEL}']")).to_have_count(1)
    page.get_by_test_id("calibrate-model").select_option(MODEL)
    page.get_by_test_id("calibrate-concepts").select_option(["cal-forget"])
    page.get_by_test_id("calibrate-forget").fill("not json")
    page.get_by_test_id("calibrate-submit").click()
    expect(page.get_by_test_id("calibrate-outcome")).to_contain_text("forget probes, line 1: not JSON")
    page.get_by_test_id("calibrate-forget").fill("\n".join(json.dumps(p) for p in demo_probes["forget"][:4]))
    page.get_by_test_id("calibrate-retain").fill("\n".join(json.dumps(p) for p in demo_probes["retain"][:6]))
    page.get_by_test_id("calibrate-budget").fill("2")
    page.get_by_test_id("calibrate-max_retain_nll_ratio").fill("3")
    page.locator("input[name=scalings][value=weight_norm]").uncheck()
    page.locator("input[name=module_sets][value=mlp]").check()
    page.get_by_test_id("calibrate-submit").click()
    expect(page).to_have_url(re.compile(r"#/calibrations/[0-9a-f]{32}$"), timeout=60_000)
    calibration_id = page.url.rsplit("/", 1)[1]
    assert calibration_id != calibration["calibration_id"]
    expect(page.get_by_test_id("front")).to_be_visible(timeout=JOB_TIMEOUT_MS)  # the live page redrew when it finished
    expect(page.get_by_test_id("delete-calibration")).to_be_disabled()  # deleting is an admin's
    expect(page.locator("main .toolbar .badge").first).to_have_text("succeeded")
    started = console_server.client.get(f"/calibrations/{calibration_id}").json()
    assert started["status"] == "succeeded" and started["concepts"] == ["cal-forget"]
    assert started["result"]["arms"] == ["mlp/uniform"] and started["result"]["budget"] == 2
    expect(_points(page)).to_have_count(len(started["result"]["candidates"]))

    admin = console_page("admin", f"#/calibrations/{calibration_id}")
    admin.on("dialog", lambda dialog: dialog.accept())
    admin.get_by_test_id("delete-calibration").click()
    expect(admin).to_have_url(re.compile(r"#/calibrations$"))
    assert console_server.client.get(f"/calibrations/{calibration_id}").status_code == 404
    expect(admin.get_by_test_id("calibrations").locator(f"tr[data-id='{calibration_id}']")).to_have_count(0)
