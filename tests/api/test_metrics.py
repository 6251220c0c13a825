"""``GET /metrics`` after a job, and JSON logs that carry request and job IDs (live server)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, wait_for_job


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_a_finished_job(api: httpx.Client, live_server: LiveServer, tiny_llama_dir: Path) -> None:
    assert api.post("/models", json={"model_id": "metrics/tiny", "source": f"file://{tiny_llama_dir}"}).status_code in (
        200,
        201,
    )
    before = _samples(api.get("/metrics").text)
    records = [{"text": p + c} for p, c in make_facts(5, seed=21)]
    posted = api.post("/concepts", json={"name": "metrics-c", "models": ["metrics/tiny"], "records": records})
    assert posted.status_code == 202, posted.text
    job = wait_for_job(api, posted.json()["jobs"][0]["job_id"])
    assert job["status"] == "succeeded"

    after = _samples(api.get("/metrics").text)
    succeeded = ("engram_jobs_total", (("kind", "collect"), ("status", "succeeded")))
    assert after[succeeded] >= before.get(succeeded, 0.0) + 1
    tokens = ("engram_collection_tokens_total", ())
    assert after[tokens] >= before.get(tokens, 0.0) + job["result"]["tokens"]
    assert after[("engram_collection_tokens_per_second_count", ())] >= 1
    latency = ("engram_http_request_duration_seconds_count", (("method", "POST"), ("route", "/concepts"), ("status", "202")))
    assert after[latency] >= 1
    assert ("engram_queue_depth", (("queue", "gpu"),)) in after


def test_logs_are_json_with_request_and_job_ids(api: httpx.Client, live_server: LiveServer) -> None:
    response = api.get("/models", headers={"X-Request-ID": "req-test-123"})
    assert response.headers["x-request-id"] == "req-test-123"
    assert api.get("/healthz").headers["x-request-id"], "a request without an ID gets one"
    lines = [json.loads(line) for line in live_server.log_path.read_text().splitlines() if line.startswith("{")]
    assert any(line.get("request_id") == "req-test-123" for line in lines)
    assert any(line.get("job_id") for line in lines), "records logged while a job runs name it"
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
