"""The console's variants pages against a live server: the list with its filters and pages, one
variant's detail (options, provenance, files, receipt, model card), an evaluation run from the form
with the demo's probe files, two variants side by side, a download checked against the receipt, a
delete; and a read key that sees everything but cannot evaluate or delete.

Set-up goes through the API (the demo model registered, its forget and retain concepts collected, two
unlearn variants built: α 1 by the write key, α 0.5 by the admin key); everything checked afterwards
is done in the browser, and what the browser shows is compared with what the API answers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Locator, Page, expect

from engram_fixtures.demo import read_probes
from engram_fixtures.live import LiveServer, wait_concepts_ready, wait_for_job, wait_variant_ready
from service.api.auth import key_identity
from tests.console.conftest import KEYS, screenshot
from tests.helpers.api import register_model

MODEL = "console/variants-demo"
JOB_TIMEOUT_MS = 300_000  # an evaluation with two attacks on two loaded cores
UI_TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class Built:
    strong: dict[str, Any]  # α 1, made by the write key (which may delete it)
    mild: dict[str, Any]  # α 0.5, made by the admin key (the write key may not delete it)
    demo: Path  # forget.jsonl, retain.jsonl


def _unlearn(client: httpx.Client, alpha: float, labels: dict[str, str], reason: str) -> dict[str, Any]:
    body = {"concepts": ["cv-forget"], "alpha": alpha, "labels": labels, "reason": reason}
    response = client.post(f"/models/{MODEL}/unlearn", json=body)
    assert response.status_code in (200, 202), response.text
    return wait_variant_ready(client, response.json()["variant"]["variant_id"], timeout=600)


@pytest.fixture(scope="module")
def built(console_server: LiveServer) -> Built:
    admin = console_server.client
    demo = console_server.model_root / "demo"
    register_model(admin, MODEL, f"file://{demo / 'model'}")
    for name, role, split in (("cv-forget", "target", "forget"), ("cv-retain", "reference", "retain")):
        records = [{"prompt": p.prompt, "completion": p.completion} for p in read_probes(demo / f"{split}.jsonl")]
        response = admin.post("/concepts", json={"name": name, "role": role, "models": [MODEL], "records": records})
        assert response.status_code == 202, response.text
    wait_concepts_ready(admin, ["cv-forget", "cv-retain"], MODEL, timeout=600)
    headers = {"Authorization": f"Bearer {KEYS['write']}"}
    with httpx.Client(base_url=console_server.base_url, timeout=60.0, headers=headers) as writer:
        strong = _unlearn(writer, 1.0, {"sweep": "a", "team": "nlp"}, "ticket 41: forget the demo facts")
    mild = _unlearn(admin, 0.5, {"sweep": "b", "team": "nlp"}, "a gentler edit")
    return Built(strong=strong, mild=mild, demo=demo)


def _rows(page: Page) -> Locator:
    return page.get_by_test_id("variants").locator("tbody tr")


def _filtered(page: Page, **fields: str) -> None:
    page.get_by_test_id("variant-filters").locator("a.clear").click()
    for name, value in fields.items():
        page.get_by_test_id(f"filter-{name}").fill(value)
    page.get_by_test_id("apply-filters").click()


def test_the_list_filters_by_the_routes_parameters_and_pages(
    built: Built, console_page: Callable[..., Page], screenshot_dir: Path
) -> None:
    page = console_page("write", "#/variants")
    expect(_rows(page)).to_have_count(2, timeout=UI_TIMEOUT_MS)
    strong_row = page.locator(f"[data-testid=variants] tr[data-id='{built.strong['variant_id']}']")
    expect(strong_row).to_contain_text("α 1")
    expect(strong_row).to_contain_text("cv-forget -1")
    expect(strong_row).to_contain_text("sweep:a")
    expect(strong_row).to_contain_text("ticket 41")
    expect(strong_row).to_contain_text(built.strong["created_by"])
    screenshot(page, screenshot_dir, "variants-list")

    _filtered(page, label="sweep:b")
    expect(_rows(page)).to_have_count(1)
    expect(_rows(page).first).to_have_attribute("data-id", built.mild["variant_id"])
    _filtered(page, label="team:nlp, sweep:a", model_id=MODEL, concept="cv-forget")
    expect(_rows(page)).to_have_count(1)
    expect(_rows(page).first).to_have_attribute("data-id", built.strong["variant_id"])
    _filtered(page, created_by=built.mild["created_by"])  # the admin key's
    expect(_rows(page)).to_have_count(1)
    expect(_rows(page).first).to_have_attribute("data-id", built.mild["variant_id"])
    _filtered(page, concept="cv-retain")  # a concept no variant edits
    expect(page.get_by_test_id("variants-empty")).to_be_visible()
    # Creation time: the browser's zone is the machine's; the field is local time, sent as ISO 8601.
    newest = max(datetime.fromisoformat(v["created_at"]) for v in (built.strong, built.mild))
    local = (newest + timedelta(minutes=1)).astimezone().strftime("%Y-%m-%dT%H:%M:%S")
    _filtered(page, created_after=local)
    expect(page.get_by_test_id("variants-empty")).to_be_visible()
    _filtered(page, created_before=local)
    expect(_rows(page)).to_have_count(2)

    paged = console_page("write", "#/variants?limit=1")  # one a page: the second comes with Load more
    expect(_rows(paged)).to_have_count(1, timeout=UI_TIMEOUT_MS)
    paged.get_by_test_id("load-more").click()
    expect(_rows(paged)).to_have_count(2)
    expect(paged.get_by_test_id("load-more")).to_have_count(0)
    ids = [paged.locator("[data-testid=variants] tbody tr").nth(i).get_attribute("data-id") for i in range(2)]
    assert sorted(ids) == sorted([built.strong["variant_id"], built.mild["variant_id"]])  # type: ignore[type-var]


def _cells_equal_the_result(scope: Locator, result: dict[str, Any]) -> int:
    """Every figure under ``scope`` carries the result's raw value at its path; ratios are variant / base."""
    checked = 0
    for cell in scope.locator("[data-metric]").all():
        path, raw = cell.get_attribute("data-metric") or "", cell.get_attribute("data-value")
        node: Any = result
        for part in path.split("."):
            node = node[part]
        assert raw is not None and float(raw) == node, (path, raw, node)  # the same double, printed and read back
        checked += 1
    for cell in scope.locator("[data-ratio]").all():
        parts = (cell.get_attribute("data-ratio") or "").split(".")
        where = result["attacks"][parts[1]]["summary"] if parts[0] == "attacks" else result["summary"]
        split = parts[-1]
        expected = where["variant"][split]["mean_nll"] / where["base"][split]["mean_nll"]
        assert float(cell.get_attribute("data-value") or "nan") == pytest.approx(expected, rel=1e-12), parts
        checked += 1
    return checked


def test_evaluate_from_the_form_shows_the_jobs_figures(
    built: Built, console_page: Callable[..., Page], console_server: LiveServer, screenshot_dir: Path, tmp_path: Path
) -> None:
    variant_id = built.strong["variant_id"]
    page = console_page("write", f"#/variants/{variant_id}")
    expect(page.get_by_test_id("variant-status")).to_have_attribute("data-status", "ready", timeout=UI_TIMEOUT_MS)
    expect(page.get_by_test_id("variant-options")).to_contain_text("cv-forget -1")
    expect(page.get_by_test_id("variant-provenance")).to_contain_text("ticket 41: forget the demo facts")
    expect(page.get_by_test_id("variant-provenance")).to_contain_text(built.strong["created_by"])
    expect(page.get_by_test_id("stored-evaluations")).to_have_attribute("data-count", "0")
    # A file that is not JSONL is refused in the browser, naming its line; nothing is sent.
    page.get_by_test_id("evaluate").click()
    expect(page.get_by_test_id("eval-output")).to_contain_text("choose a forget or a retain probe file")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "Q: a? A:", "completion": " b"}\nnot json\n')
    page.get_by_test_id("probes-forget").set_input_files(str(tmp_path / "broken.jsonl"))
    page.get_by_test_id("evaluate").click()
    expect(page.get_by_test_id("eval-output")).to_contain_text("forget file broken.jsonl line 2: not JSON")
    every_state = ["queued", "running", "succeeded", "failed", "cancelled"]
    assert console_server.client.get("/jobs", params={"kind": "evaluate", "status": every_state}).json() == []
    page.get_by_test_id("probes-forget").set_input_files(str(built.demo / "forget.jsonl"))
    page.get_by_test_id("probes-retain").set_input_files(str(built.demo / "retain.jsonl"))
    page.get_by_test_id("attack-quantize").check()
    page.get_by_test_id("attack-bound").fill("0.5")
    page.get_by_test_id("eval-reason").fill("nightly check of ticket 41")
    page.get_by_test_id("evaluate").click()

    result_box = page.get_by_test_id("eval-result")
    expect(result_box).to_be_visible(timeout=JOB_TIMEOUT_MS)
    job_id = page.get_by_test_id("eval-job").get_attribute("data-job-id")
    job = wait_for_job(console_server.client, str(job_id))
    assert job["status"] == "succeeded", job
    result = job["result"]
    forget_n = len(read_probes(built.demo / "forget.jsonl"))
    assert result["summary"]["variant"]["forget"]["n"] == forget_n
    assert _cells_equal_the_result(result_box, result) >= 2 * 6 + 4  # both sets' figures and the attack's rows
    expect(result_box.locator("[data-testid=eval-summary] tr[data-id=forget]")).to_contain_text(
        f"{100 * result['summary']['variant']['forget']['exact_match']:.1f}%"
    )
    passed = result["attacks"]["quantize:Q4_1"]["passed"]
    expect(result_box.locator("[data-attack='quantize:Q4_1']").first).to_have_attribute("data-passed", str(passed).lower())
    # The evaluation is stored with the variant: its receipt, hence the page's stored evaluations, holds it.
    stored = page.get_by_test_id("stored-evaluations")
    expect(stored).to_have_attribute("data-count", "1", timeout=UI_TIMEOUT_MS)
    _cells_equal_the_result(stored, result)
    # When, who (the write key's fingerprint, never the key) and why, as the service stored them.
    assert result["created_by"] == key_identity(KEYS["write"]) and result["reason"] == "nightly check of ticket 41"
    shown = stored.get_by_test_id("evaluation-provenance")
    expect(shown).to_have_attribute("data-created-at", result["created_at"])
    expect(shown).to_have_attribute("data-created-by", result["created_by"])
    expect(shown).to_contain_text("reason: nightly check of ticket 41")
    expect(shown).not_to_contain_text(KEYS["write"])
    screenshot(page, screenshot_dir, "variant-detail")


def test_a_download_is_the_file_the_receipt_vouches_for(
    built: Built, console_page: Callable[..., Page], console_server: LiveServer, tmp_path: Path
) -> None:
    variant_id = built.strong["variant_id"]
    receipt = console_server.client.get(f"/variants/{variant_id}/receipt").json()
    digests = {f["path"]: f["sha256"] for f in receipt["receipt"]["files"]}
    page = console_page("read", f"#/variants/{variant_id}")
    weights = max(built.strong["files"], key=lambda f: f["size"])["path"]
    with page.expect_download(timeout=UI_TIMEOUT_MS) as download:
        page.locator(f"[data-testid=download-file][data-path='{weights}']").click()
    saved = tmp_path / weights
    download.value.save_as(saved)
    assert download.value.suggested_filename == weights
    assert hashlib.sha256(saved.read_bytes()).hexdigest() == digests[weights]

    expect(page.get_by_test_id("receipt-digest")).to_have_text(receipt["digest"])
    with page.expect_download(timeout=UI_TIMEOUT_MS) as download:
        page.get_by_test_id("download-receipt").click()
    download.value.save_as(tmp_path / "receipt.json")
    assert json.loads((tmp_path / "receipt.json").read_text()) == receipt
    page.get_by_test_id("show-model-card").click()
    card = console_server.client.get(f"/variants/{variant_id}/model-card").text
    expect(page.get_by_test_id("model-card")).to_have_text(card)


def test_two_variants_side_by_side(
    built: Built, console_page: Callable[..., Page], console_server: LiveServer, screenshot_dir: Path
) -> None:
    strong, mild = built.strong["variant_id"], built.mild["variant_id"]
    # The mild variant is evaluated on the same probe files through the API: the two line up in a row.
    demo = built.demo
    body = {
        split: [{"prompt": p.prompt, "completion": p.completion} for p in read_probes(demo / f"{split}.jsonl")]
        for split in ("forget", "retain")
    }
    answer = console_server.client.post(f"/variants/{mild}/evaluate", json=body)
    assert answer.status_code in (200, 202), answer.text
    mild_result = wait_for_job(console_server.client, answer.json()["job_id"], timeout=JOB_TIMEOUT_MS / 1000)["result"]

    page = console_page("write", "#/variants")
    expect(_rows(page)).to_have_count(2, timeout=UI_TIMEOUT_MS)
    expect(page.get_by_test_id("compare-selected")).to_be_disabled()
    for variant_id in (strong, mild):
        page.locator(f"[data-testid=select-variant][value='{variant_id}']").check()
    page.get_by_test_id("compare-selected").click()
    table = page.get_by_test_id("compare-table")
    expect(table).to_be_visible(timeout=UI_TIMEOUT_MS)
    expect(table.locator("thead th[data-variant]")).to_have_count(2)

    def row(label: str) -> Locator:
        return table.locator(f"tr[data-row='{label}']")

    expect(row("alpha")).to_have_attribute("data-differs", "true")
    expect(row("alpha").locator(f"td[data-variant='{strong}']")).to_have_text("1")
    expect(row("alpha").locator(f"td[data-variant='{mild}']")).to_have_text("0.500")
    expect(row("model")).to_have_attribute("data-differs", "false")
    expect(row("concepts")).to_have_attribute("data-differs", "false")
    expect(row("terms")).to_have_attribute("data-differs", "true")  # the coefficients are −α
    expect(row("reason")).to_have_attribute("data-differs", "true")
    # Lined up by the probe sets' digests (sha256 of the probes as canonical JSON, computed here) and sizes.
    sets = " / ".join(f"{s} {len(body[s])} #{_sha256(body[s])[:12]}" for s in ("forget", "retain"))
    key = f"{sets} probes · forget exact match"
    expect(row(key).locator(f"td[data-variant='{mild}']")).to_have_text(
        f"{100 * mild_result['summary']['variant']['forget']['exact_match']:.1f}%"
    )
    expect(row(key).locator(f"td[data-variant='{strong}']")).not_to_have_text("—")
    receipts = {v: console_server.client.get(f"/variants/{v}/receipt").json()["digest"] for v in (strong, mild)}
    for variant_id, digest in receipts.items():
        expect(row("receipt digest").locator(f"td[data-variant='{variant_id}'] code")).to_have_attribute("title", digest)
    expect(table.locator("[data-testid=download-file]")).to_have_count(2)
    screenshot(page, screenshot_dir, "variants-compare")


def _sha256(probes: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(probes, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_a_read_key_sees_everything_but_cannot_act(built: Built, console_page: Callable[..., Page]) -> None:
    page = console_page("read", "#/variants")
    expect(_rows(page)).to_have_count(2, timeout=UI_TIMEOUT_MS)
    page.goto(page.url.split("#")[0] + f"#/variants/{built.strong['variant_id']}")
    expect(page.get_by_test_id("variant-options")).to_contain_text("cv-forget -1", timeout=UI_TIMEOUT_MS)
    expect(page.get_by_test_id("stored-evaluations")).not_to_have_attribute("data-count", "0")
    for action in ("evaluate", "delete-variant"):
        button = page.get_by_test_id(action)
        expect(button).to_be_disabled()
        expect(button).to_have_attribute("title", "needs a write key")
    expect(page.get_by_test_id("download-file").first).to_be_enabled()


def test_delete_removes_one_variant_and_keeps_the_other(
    built: Built, console_page: Callable[..., Page], console_server: LiveServer
) -> None:
    strong, mild = built.strong["variant_id"], built.mild["variant_id"]
    page = console_page("write", f"#/variants/{mild}")
    page.on("dialog", lambda dialog: dialog.accept())
    # The admin key made this one: the write key's DELETE is refused, and the page says why.
    page.get_by_test_id("delete-variant").click()
    expect(page.get_by_test_id("delete-problem")).to_contain_text("403", timeout=UI_TIMEOUT_MS)
    assert console_server.client.get(f"/variants/{mild}").status_code == 200

    page.goto(page.url.split("#")[0] + f"#/variants/{strong}")
    expect(page.get_by_test_id("variant-status")).to_have_attribute("data-status", "ready", timeout=UI_TIMEOUT_MS)
    page.get_by_test_id("delete-variant").click()
    expect(page.get_by_test_id("variants")).to_be_visible(timeout=UI_TIMEOUT_MS)  # back on the list
    expect(_rows(page)).to_have_count(1)
    expect(_rows(page).first).to_have_attribute("data-id", mild)
    assert console_server.client.get(f"/variants/{strong}").status_code == 404
    page.goto(page.url.split("#")[0] + f"#/variants/{mild}")
    expect(page.get_by_test_id("variant-status")).to_have_attribute("data-status", "ready", timeout=UI_TIMEOUT_MS)
    expect(page.get_by_test_id("receipt-digest")).not_to_be_empty()
