"""``engram unlearn`` without ``--alpha`` (issue 36): the service's conservative default, and its
warning printed on stderr while stdout stays the variant; the client sends no alpha it was not given."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engram_client import EngramClient
from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, wait_concepts_ready, wait_for_job
from tests.helpers.cli import ok, run_cli, says

MODEL = "cli-default-alpha/tiny"
FACTS = make_facts(24, seed=17)


@pytest.fixture(scope="module")
def server(live_server: LiveServer, tiny_llama_dir: Path) -> LiveServer:
    """The model with a target and a reference concept ready on it."""
    client = live_server.client
    response = client.post("/models", json={"model_id": MODEL, "source": f"file://{tiny_llama_dir}"})
    assert response.status_code in (200, 201, 202), response.text
    if response.status_code == 202:  # the register job ran past the request's wait (under load)
        assert wait_for_job(client, response.json()["job_id"], timeout=300)["status"] == "succeeded"
    for name, role, facts in (("cli-da-forget", "target", FACTS[:6]), ("cli-da-retain", "reference", FACTS[6:])):
        records = [{"prompt": p, "completion": c} for p, c in facts]
        response = client.post("/concepts", json={"name": name, "role": role, "models": [MODEL], "records": records})
        assert response.status_code == 202, response.text
    wait_concepts_ready(client, ["cli-da-forget", "cli-da-retain"], MODEL)
    return live_server


def test_unlearn_without_alpha_prints_the_default_warning(server: LiveServer) -> None:
    result = ok(run_cli(server.base_url, "--json", "unlearn", MODEL, "-c", "cli-da-forget"))
    variant = json.loads(result.stdout)
    assert (variant["alpha"], variant["terms"]) == (0.25, {"cli-da-forget": -0.25})
    assert says(result.stderr, "warning: alpha not given: used 0.25, the conservative default")
    given = ok(run_cli(server.base_url, "--json", "unlearn", MODEL, "-c", "cli-da-forget", "--alpha", "0.25"))
    assert json.loads(given.stdout)["variant_id"] == variant["variant_id"]
    assert "warning" not in given.stderr


def test_the_client_sends_alpha_only_when_given(server: LiveServer) -> None:
    sent: list[bytes] = []
    transport = httpx.HTTPTransport()

    class Recording(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            sent.append(request.read())
            return transport.handle_request(request)

    with EngramClient(server.base_url, transport=Recording()) as engram:
        default = engram.unlearn(MODEL, ["cli-da-forget"])
        given = engram.unlearn(MODEL, ["cli-da-forget"], 1.0)
    assert [json.loads(body) for body in sent] == [
        {"concepts": ["cli-da-forget"]},
        {"concepts": ["cli-da-forget"], "alpha": 1.0},
    ]
    assert default.variant.alpha == 0.25 and "conservative default" in default.warnings[0]
    assert given.variant.alpha == 1.0 and given.warnings == []
