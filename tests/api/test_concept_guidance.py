"""Concept and model-root errors that say how to fix the request (issue 28), through the real server
and the ``engram`` CLI (tests/api/test_error_guidance.py has the in-process ones).

- a misspelt concept (``GET /concepts/{name}``, an unlearn, a universe) is a 404 naming its close
  matches and how to list the known concepts;
- an unlearn naming a concept whose collection has not finished is a 409 naming the collection job
  and its URL, and saying to wait for it;
- a ``file://`` model outside ``ENGRAM_MODEL_ROOTS`` is a 422 saying that this is the server's
  setting, which folders it allows, and the two ways to fix it.

Each request also changes nothing (``unchanged``), and the CLI prints the same guidance on stderr.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, running_server, wait_concepts_ready, wait_for_job
from tests.helpers.api import assert_problem, register_model, unchanged
from tests.helpers.cli import failed, run_cli, says
from tests.helpers.job_process import job_process, paused

MODEL = "guide/tiny"
FACTS = [{"prompt": p, "completion": c} for p, c in make_facts(12, seed=41)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_root: Path, tiny_llama_dir: Path) -> Iterator[LiveServer]:
    """A server of this module's own with ``MODEL`` registered and concept ``guide-forget`` ready on it.

    Its own, not the session's: the close matches of a misspelt name are drawn from every concept the
    server knows, and the session's server holds whatever the modules run before this one posted."""
    with running_server(tmp_path_factory.mktemp("concept-guidance"), model_root) as server:
        api = server.client
        register_model(api, MODEL, f"file://{tiny_llama_dir}")
        response = api.post("/concepts", json={"name": "guide-forget", "models": [MODEL], "records": FACTS[:6]})
        assert response.status_code == 202, response.text
        wait_concepts_ready(api, ["guide-forget"], MODEL)
        yield server


def test_a_misspelt_concept_names_its_close_matches_and_how_to_list_them(server: LiveServer) -> None:
    api = server.client
    problem = assert_problem(api.get("/concepts/guide-forgte"), 404, "did you mean guide-forget?", "GET /concepts")
    assert problem["close_matches"] == {"guide-forgte": ["guide-forget"]}
    with unchanged(server):
        body = {"concepts": ["guide-forgte"], "alpha": 1.0}
        problem = assert_problem(api.post(f"/models/{MODEL}/unlearn", json=body), 404, "did you mean guide-forget?")
        assert "engram concepts list" in problem["detail"]
        universe = {"concepts": ["guide-forget", "nothing-like-it"]}
        problem = assert_problem(api.post(f"/models/{MODEL}/universes", json=universe), 404, "nothing-like-it")
        assert problem["close_matches"] == {"nothing-like-it": []}  # no close match: none made up

    stderr = failed(run_cli(server.base_url, "concepts", "show", "guide-forgte"), "did you mean guide-forget?")
    assert says(stderr, "engram concepts list")
    failed(run_cli(server.base_url, "unlearn", MODEL, "-c", "guide-forgte", "--no-wait"), "did you mean guide-forget?")


def test_an_unlearn_before_the_collection_finished_names_the_job_to_wait_for(server: LiveServer) -> None:
    api = server.client
    with paused(job_process(server)):
        response = api.post(
            "/concepts", params={"wait": 0}, json={"name": "guide-later", "models": [MODEL], "records": FACTS[6:]}
        )
        assert response.status_code == 202, response.text
        job_id = response.json()["jobs"][0]["job_id"]
        body = {"concepts": ["guide-later"], "alpha": 1.0, "reference": ["guide-forget"]}
        problem = assert_problem(api.post(f"/models/{MODEL}/unlearn", json=body), 409, job_id, f"/jobs/{job_id}", "wait")
        followed = {"concept": "guide-later", "job_id": job_id, "status": "queued", "url": f"/jobs/{job_id}"}
        assert problem["jobs"] == [followed]
        # The CLI prints the service's problem as it is, whichever command met it.
        for command in (("unlearn", MODEL, "-c", "guide-later"), ("universes", "build", MODEL, "-c", "guide-later")):
            cli = run_cli(server.base_url, *command, "--no-wait")
            failed(cli, "Conflict (409)", job_id, f"/jobs/{job_id}", f"engram jobs watch {job_id}", "wait")
    wait_for_job(api, job_id)
    wait_concepts_ready(api, ["guide-later"], MODEL)


def test_a_model_outside_the_roots_says_it_is_a_server_setting_and_how_to_fix_it(
    server: LiveServer, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere"
    shutil.copytree(tiny_llama_dir, outside)
    with unchanged(server):
        response = server.client.post("/models", json={"model_id": "guide/outside", "source": f"file://{outside}"})
        detail = assert_problem(response, 422, str(outside.resolve()), "ENGRAM_MODEL_ROOTS", "server setting")["detail"]
    assert str(server.model_root.resolve()) in detail  # the roots allowed
    assert "Put the model under" in detail and "operator" in detail  # the two fixes
    stderr = failed(run_cli(server.base_url, "models", "add", "guide/outside", f"file://{outside}"), "server setting")
    assert says(stderr, "ENGRAM_MODEL_ROOTS")
