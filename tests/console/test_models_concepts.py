"""The models and concepts pages: the README's walk-through from the console (register the demo
model, add the forget and retain concepts by uploading their JSONL files, watch both collections
reach ready, unlearn ``forget`` at alpha 1 from the model's page, evaluate the variant on both sets
from its page), every figure the pages show read
against the API's own answer, and a read key that sees these pages with every action disabled."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from playwright.sync_api import FilePayload, Page, expect

from engram_fixtures.live import LiveServer, wait_concepts_ready, wait_for_job, wait_variant_ready
from tests.console.conftest import screenshot
from tests.helpers.api import register_model

MODEL_ID = "demo/tiny-llama"
MODEL_HASH = "#/models/demo%2Ftiny-llama"
CONCEPTS = ("forget", "retain")
JOB_MS = 240_000  # a collection or a build on two shared cores: generous, the tests wait on visible state
PAGE_MS = 20_000
SCRATCH = b"".join(b'{"text": "%s"}\n' % word for word in (b"alpha", b"beta", b"gamma"))
BROKEN = b'{"text": "fine"}\nnot json\n'  # its second line is no JSON record


def demo(server: LiveServer) -> Path:
    return server.model_root / "demo"


def records_in(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def register_from_the_form(page: Page, server: LiveServer) -> dict[str, Any]:
    page.get_by_test_id("register-id").fill(MODEL_ID)
    page.get_by_test_id("register-source").fill(f"file://{demo(server) / 'model'}")
    page.get_by_test_id("register-labels").fill("team=console, ticket=T-41")
    page.get_by_test_id("register-reason").fill("the README walk-through")
    page.get_by_test_id("register-submit").click()
    expect(page).to_have_url(re.compile(re.escape(MODEL_HASH) + "$"), timeout=JOB_MS)
    model: dict[str, Any] = server.client.get(f"/models/{MODEL_ID}").json()
    assert model["labels"] == {"team": "console", "ticket": "T-41"}, model
    assert model["reason"] == "the README walk-through", model
    return model


def check_model_page(page: Page, model: dict[str, Any]) -> None:
    expect(page.get_by_test_id("model-id")).to_have_text(MODEL_ID, timeout=PAGE_MS)
    expect(page.get_by_test_id("model-digest")).to_have_text(model["digest"])
    expect(page.locator("[data-testid=layers] tbody tr")).to_have_count(len(model["layers"]))
    page.get_by_test_id("layer-filter").fill("down_proj")
    downs = [layer["name"] for layer in model["layers"] if "down_proj" in layer["name"]]
    assert downs, model["layers"]
    expect(page.locator("[data-testid=layers] tbody tr")).to_have_count(len(downs))
    page.get_by_test_id("layer-filter").fill("")


def refuse_a_bad_file(page: Page, server: LiveServer) -> None:
    """A file that is not JSONL: the service's 4xx problem on the form, and no concept made."""
    page.get_by_test_id("concept-name").fill("broken")
    page.get_by_test_id("concept-models").select_option(MODEL_ID)
    broken: FilePayload = {"name": "broken.jsonl", "mimeType": "application/jsonl", "buffer": BROKEN}
    page.get_by_test_id("concept-dataset").set_input_files(files=[broken])
    page.get_by_test_id("concept-submit").click()
    problem = page.get_by_test_id("concept-outcome").get_by_test_id("problem")
    expect(problem).to_contain_text(re.compile(r"^4\d\d: "), timeout=PAGE_MS)
    shown = problem.inner_text()
    answered = server.client.post(
        "/concepts",
        data={"name": "broken", "models": MODEL_ID},
        files={"dataset": ("broken.jsonl", BROKEN, "application/jsonl")},
    )
    assert 400 <= answered.status_code < 500 and answered.json()["detail"] in shown, (shown, answered.text)
    assert server.client.get("/concepts/broken").status_code == 404


def add_from_the_form(page: Page, server: LiveServer, name: str) -> None:
    page.get_by_test_id("concept-name").fill(name)
    page.get_by_test_id("concept-models").select_option(MODEL_ID)
    page.get_by_test_id("concept-dataset").set_input_files(demo(server) / f"{name}.jsonl")
    page.get_by_test_id("concept-submit").click()
    # The submission's collection job, followed live on the form.
    expect(page.get_by_test_id("concept-outcome").get_by_test_id("job-line")).to_have_count(1, timeout=PAGE_MS)


def state_badge(page: Page, name: str) -> Any:
    return page.locator(f'[data-testid=concepts] tr[data-id="{name}"] [data-model="{MODEL_ID}"] .badge')


def check_concept_page(page: Page, server: LiveServer, name: str) -> None:
    concept = server.client.get(f"/concepts/{name}").json()
    expect(page.get_by_test_id("concept-name-shown")).to_have_text(name, timeout=PAGE_MS)
    expect(page.get_by_test_id("concept-digest")).to_have_text(concept["dataset_digest"])
    expect(page.get_by_test_id("concept-records")).to_have_text(str(records_in(demo(server) / f"{name}.jsonl")))
    row = page.locator(f'[data-testid=concept-statistics] tr[data-id="{MODEL_ID}"]')
    expect(row.locator(".badge")).to_have_text("ready")
    tokens = concept["models"][MODEL_ID]["tokens"]
    expect(row).to_contain_text(f"{tokens} tokens")


def unlearn_from_the_form(page: Page, server: LiveServer) -> str:
    expect(page.locator("[data-testid=unlearn-concepts] option")).to_have_count(2, timeout=PAGE_MS)
    page.get_by_test_id("unlearn-concepts").select_option("forget")
    page.get_by_test_id("unlearn-alpha").fill("1")
    page.get_by_test_id("unlearn-reason").fill("the README walk-through")
    page.get_by_test_id("unlearn-submit").click()
    expect(page).to_have_url(re.compile(r"#/variants/[A-Za-z0-9]+$"), timeout=PAGE_MS)
    variant_id = page.url.rsplit("/", 1)[1]
    variant = wait_variant_ready(server.client, variant_id, timeout=JOB_MS / 1000)
    assert variant["model_id"] == MODEL_ID and variant["terms"] == {"forget": -1.0}, variant
    assert variant["alpha"] == 1.0 and variant["scaling"] == "uniform" and variant["format"] == "checkpoint", variant
    # The same request from a client names the same variant (its ID is a content hash), with the
    # warnings the console showed beside it (the demo's universe has no general-text reference) and
    # perhaps more of its own (the variant was made by an earlier request).
    again = server.client.post(f"/models/{MODEL_ID}/unlearn", json={"concepts": ["forget"], "alpha": 1.0})
    assert again.status_code == 200 and again.json()["variant"]["variant_id"] == variant_id, again.text
    shown = page.get_by_test_id("unlearn-warning")
    expect(shown.first).to_contain_text("reference")
    assert set(shown.all_inner_texts()) <= set(again.json()["warnings"]), (shown.all_inner_texts(), again.text)
    return variant_id


def evaluate_from_the_variant_page(page: Page, server: LiveServer, variant_id: str) -> None:
    """The README's last step, from the variant's page: score it against the base on both sets."""
    expect(page.get_by_test_id("variant-status")).to_have_attribute("data-status", "ready", timeout=JOB_MS)
    page.get_by_test_id("probes-forget").set_input_files(str(demo(server) / "forget.jsonl"))
    page.get_by_test_id("probes-retain").set_input_files(str(demo(server) / "retain.jsonl"))
    page.get_by_test_id("evaluate").click()
    result_box = page.get_by_test_id("eval-result")
    expect(result_box).to_be_visible(timeout=JOB_MS)
    job = wait_for_job(server.client, str(page.get_by_test_id("eval-job").get_attribute("data-job-id")))
    assert job["status"] == "succeeded" and job["variant_id"] == variant_id, job
    scores = job["result"]["summary"]["variant"]
    for name in CONCEPTS:  # the page shows the job's own figures
        shown = f"{100 * scores[name]['exact_match']:.1f}%"
        expect(result_box.locator(f"[data-testid=eval-summary] tr[data-id={name}]")).to_contain_text(shown)
    assert scores["forget"]["exact_match"] == 0.0, scores  # the README's table: alpha 1 forgets every fact


def test_the_readme_walkthrough_from_the_console(
    console_page: Callable[..., Page], console_server: LiveServer, screenshot_dir: Path
) -> None:
    page = console_page("write", "#/models")
    page.on("dialog", lambda dialog: dialog.accept())
    model = register_from_the_form(page, console_server)
    check_model_page(page, model)

    page.click("#nav a[data-section=concepts]")
    refuse_a_bad_file(page, console_server)
    for name in CONCEPTS:
        add_from_the_form(page, console_server, name)
    for name in CONCEPTS:
        expect(state_badge(page, name)).to_have_text("ready", timeout=JOB_MS)
        records = records_in(demo(console_server) / f"{name}.jsonl")
        expect(page.locator(f'[data-testid=concepts] tr[data-id="{name}"] td.num')).to_have_text(str(records))
    screenshot(page, screenshot_dir, "concepts")

    page.click('[data-testid=concepts] tr[data-id="forget"] a[href="#/concepts/forget"]')
    check_concept_page(page, console_server, "forget")
    page.locator(f'[data-testid=draw-concept-map][data-model="{MODEL_ID}"]').click()
    expect(page.get_by_test_id("concept-map")).to_be_visible(timeout=JOB_MS)
    screenshot(page, screenshot_dir, "concept")

    page.click(f'[data-testid=concept-statistics] tr[data-id="{MODEL_ID}"] a[href="{MODEL_HASH}"]')
    for name in CONCEPTS:
        expect(page.locator(f'[data-testid=model-concepts] tr[data-id="{name}"] .badge')).to_have_text(
            "ready", timeout=PAGE_MS
        )
    variant_id = unlearn_from_the_form(page, console_server)
    evaluate_from_the_variant_page(page, console_server, variant_id)

    page.goto(f"{console_server.base_url}/ui/{MODEL_HASH}")
    expect(page.locator(f'[data-testid=model-variants] tr[data-id="{variant_id}"] .badge')).to_have_text(
        "ready", timeout=PAGE_MS
    )
    universes = console_server.client.get(f"/models/{MODEL_ID}/universes").json()
    assert universes, "the unlearn built the model's universe"
    expect(page.locator("[data-testid=universes] tbody tr")).to_have_count(len(universes))
    page.get_by_test_id("draw-map").click()
    expect(page.get_by_test_id("engram-map")).to_be_visible(timeout=JOB_MS)
    # Deleting a model that concepts and a variant need is refused (409); the page shows what needs it.
    page.get_by_test_id("delete-model").click()
    refusal = page.get_by_test_id("delete-outcome").get_by_test_id("problem")
    expect(refusal).to_contain_text("409: ", timeout=PAGE_MS)
    assert console_server.client.get(f"/models/{MODEL_ID}").status_code == 200
    screenshot(page, screenshot_dir, "model")

    # A concept in the universe of a stored variant is refused too (409), with what needs it.
    page.click('[data-testid=model-concepts] a[href="#/concepts/forget"]')
    page.get_by_test_id("delete-concept").click()
    expect(page.get_by_test_id("delete-outcome").get_by_test_id("problem")).to_contain_text("409: ", timeout=PAGE_MS)
    assert console_server.client.get("/concepts/forget").status_code == 200

    page.click("#nav a[data-section=models]")
    row = page.locator(f'[data-testid=models] tr[data-id="{MODEL_ID}"]')
    expect(row).to_contain_text("team=console")
    expect(row.locator("td.num")).to_have_text(str(len(model["layers"])))
    screenshot(page, screenshot_dir, "models")


def walked(server: LiveServer) -> None:
    """The walk-through's model and concepts, through the API where the first test did not leave them."""
    register_model(server.client, MODEL_ID, f"file://{demo(server) / 'model'}", existing_ok=True)
    for name in CONCEPTS:
        if server.client.get(f"/concepts/{name}").status_code == 404:
            dataset = (demo(server) / f"{name}.jsonl").read_bytes()
            answer = server.client.post(
                "/concepts", data={"name": name, "models": MODEL_ID}, files={"dataset": (f"{name}.jsonl", dataset)}
            )
            assert answer.status_code == 202, answer.text
    wait_concepts_ready(server.client, CONCEPTS, MODEL_ID, timeout=JOB_MS / 1000)


def assert_every_action_disabled(page: Page, at_least: int) -> None:
    buttons = page.locator("#view button[data-scope]")
    expect(buttons.first).to_be_visible(timeout=PAGE_MS)
    assert buttons.count() >= at_least
    for i in range(buttons.count()):
        expect(buttons.nth(i)).to_be_disabled()
        expect(buttons.nth(i)).to_have_attribute("title", re.compile(r"needs an? (write|admin) key"))


def test_a_read_key_sees_models_and_concepts_but_cannot_act(
    console_page: Callable[..., Page], console_server: LiveServer
) -> None:
    walked(console_server)
    page = console_page("read", "#/models")
    expect(page.locator(f'[data-testid=models] tr[data-id="{MODEL_ID}"]')).to_be_visible(timeout=PAGE_MS)
    assert_every_action_disabled(page, 1)  # register

    page.click(f'[data-testid=models] a[href="{MODEL_HASH}"]')
    expect(page.get_by_test_id("model-id")).to_have_text(MODEL_ID, timeout=PAGE_MS)
    expect(page.locator('[data-testid=model-concepts] tr[data-id="forget"] .badge')).to_have_text("ready")
    expect(page.locator("[data-testid=unlearn-concepts] option")).to_have_count(2)
    assert_every_action_disabled(page, 2)  # unlearn, delete

    page.click("#nav a[data-section=concepts]")
    expect(state_badge(page, "retain")).to_have_text("ready", timeout=PAGE_MS)
    assert_every_action_disabled(page, 1)  # add

    page.click('[data-testid=concepts] a[href="#/concepts/retain"]')
    check_concept_page(page, console_server, "retain")
    assert_every_action_disabled(page, 1)  # delete


def test_what_nothing_needs_is_deleted_from_its_page(console_page: Callable[..., Page], console_server: LiveServer) -> None:
    """A concept whose statistics no variant uses and a model nothing needs: each page's delete
    button removes it (204) and goes back to its list; the API no longer knows it."""
    walked(console_server)
    page = console_page("write", "#/concepts")
    page.on("dialog", lambda dialog: dialog.accept())
    scratch: FilePayload = {"name": "scratch.jsonl", "mimeType": "application/jsonl", "buffer": SCRATCH}
    page.get_by_test_id("concept-name").fill("scratch")
    page.get_by_test_id("concept-models").select_option(MODEL_ID)
    page.get_by_test_id("concept-dataset").set_input_files(files=[scratch])
    page.get_by_test_id("concept-submit").click()
    expect(state_badge(page, "scratch")).to_have_text("ready", timeout=JOB_MS)
    page.click('[data-testid=concepts] a[href="#/concepts/scratch"]')
    expect(page.get_by_test_id("concept-records")).to_have_text("3", timeout=PAGE_MS)
    page.get_by_test_id("delete-concept").click()
    expect(page).to_have_url(re.compile(r"#/concepts$"), timeout=PAGE_MS)
    expect(page.locator('[data-testid=concepts] tr[data-id="scratch"]')).to_have_count(0)
    assert console_server.client.get("/concepts/scratch").status_code == 404

    page.click("#nav a[data-section=models]")
    page.get_by_test_id("register-id").fill("demo/scratch")
    page.get_by_test_id("register-source").fill(f"file://{demo(console_server) / 'model'}")
    page.get_by_test_id("register-submit").click()
    expect(page).to_have_url(re.compile(r"#/models/demo%2Fscratch$"), timeout=JOB_MS)
    expect(page.get_by_test_id("model-id")).to_have_text("demo/scratch", timeout=PAGE_MS)
    page.get_by_test_id("delete-model").click()
    expect(page).to_have_url(re.compile(r"#/models$"), timeout=PAGE_MS)
    expect(page.locator('[data-testid=models] tr[data-id="demo/scratch"]')).to_have_count(0)
    assert console_server.client.get("/models/demo/scratch").status_code == 404
