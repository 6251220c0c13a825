"""A collection is bounded in memory and time whatever its records and the model's chat template
(issue 23, findings 2 and 3), on a live server (embedded mode: the job process is measured).

- One text record of 8 MB (under every request limit): the whole text was tokenized before being
  cut to max_length, ~270 bytes a character (30 MB took the job process past 8 GB). Now it is cut
  to a character budget first: the job process's peak RSS grows by a few MB, and the truncation it
  reports counts every token cut.
- A chat template that loops (``range(100000)`` twice) is cancelled within a second, and the next
  collection runs; left alone it fails at ENGRAM_TEMPLATE_TIMEOUT_S, naming it.
- A template that builds a huge string fails naming the bound it passed (``'a' * 1500000000`` is
  refused before it allocates; a string doubled in a loop hits ENGRAM_TEMPLATE_MEMORY_BYTES).
- A record over ENGRAM_MAX_RECORD_BYTES is a 413 naming the setting, in a JSON body or an upload,
  and nothing is stored; a JSONL line too long to hold one is refused before it is buffered whole.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.live import LiveServer, running_server, wait_concepts_ready, wait_for_job
from engram_fixtures.models import CHAT_TEMPLATE, make_tiny_chat_llama
from service.datasets.spool import DatasetSpool, JsonlFeed
from service.errors import PayloadTooLarge
from tests.helpers.job_process import job_process, peak_rss_bytes, template_children

MAX_LENGTH = 64
TIMEOUT_S = 5
TEMPLATE_MEMORY_BYTES = 256 << 20  # service.config: template_memory_bytes >= 256 MiB
LOOPING = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)
HUGE_REPEAT = "{{ 'a' * 1500000000 }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
DOUBLING = (
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{{ ns.s | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
)
TEMPLATES = {"plain": CHAT_TEMPLATE, "looping": LOOPING, "repeat": HUGE_REPEAT, "doubling": DOUBLING}
CHAT = [{"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello back"}]}]
UNIT = " the quiet cat sat on the warm mat."  # additive under the byte-level pre-tokenizer: N units, N × its tokens
RECORD_BYTES = 8_000_000
RSS_BOUND = 128 << 20  # the growth of the job process's peak RSS allowed for one 8 MB record
MAX_RECORD_BYTES = 10_000_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("bounded")
    models = root / "models"
    for name, template in TEMPLATES.items():
        make_tiny_chat_llama(models / name, template=template)
    env = {
        "ENGRAM_MAX_JSON_BYTES": str(64 << 20),
        "ENGRAM_MAX_LENGTH": str(MAX_LENGTH),
        "ENGRAM_TEMPLATE_TIMEOUT_S": str(TIMEOUT_S),
        # The smallest memory bound allowed: the doubling template reaches it after a quarter of the
        # copying the 1 GiB default takes, well inside TIMEOUT_S on a loaded machine (at the default,
        # three test processes on two cores took 7.5 s and the time bound tripped first).
        "ENGRAM_TEMPLATE_MEMORY_BYTES": str(TEMPLATE_MEMORY_BYTES),
        "ENGRAM_MAX_RECORD_BYTES": str(MAX_RECORD_BYTES),
    }
    with running_server(root, models, **env) as live:
        for name in TEMPLATES:
            response = live.client.post("/models", json={"model_id": f"t/{name}", "source": f"file://{models / name}"})
            assert response.status_code in (200, 201), response.text
        yield live


def post(api: httpx.Client, name: str, model: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    response = api.post("/concepts", json={"name": name, "models": [f"t/{model}"], "records": records})
    assert response.status_code == 202, response.text
    [job] = response.json()["jobs"]
    return dict(job)


def wait_running(api: httpx.Client, job_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while api.get(f"/jobs/{job_id}").json()["status"] != "running":
        assert time.monotonic() < deadline, api.get(f"/jobs/{job_id}").json()
        time.sleep(0.05)


def test_one_huge_text_record_stays_within_a_few_mb_and_its_truncation_is_counted(server: LiveServer) -> None:
    api = server.client
    post(api, "warm-up", "plain", [{"text": "a small record first, so the model is loaded"}])
    wait_concepts_ready(api, ["warm-up"])
    pid = job_process(server)
    before = peak_rss_bytes(pid)
    units = RECORD_BYTES // len(UNIT)
    job = post(api, "huge-record", "plain", [{"text": UNIT * units}])
    final = wait_for_job(api, job["job_id"], timeout=300)
    grown = peak_rss_bytes(pid) - before
    print(f"\n8 MB record: job process peak RSS {before / 2**20:.0f} MB -> +{grown / 2**20:.1f} MB")  # noqa: T201
    assert final["status"] == "succeeded", final
    assert job_process(server) == pid  # the same process measured throughout
    assert grown < RSS_BOUND
    truncated = final["result"]["truncated"]
    assert truncated["records"] == 1
    assert final["result"]["tokens"] == MAX_LENGTH
    # Every token beyond max_length is counted: N units of t tokens and the tokenizer's specials.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.model_root / "plain")
    one, two = (len(tokenizer(UNIT * k)["input_ids"]) for k in (1, 2))
    whole = one + (units - 1) * (two - one)
    assert abs(truncated["tokens"] - (whole - MAX_LENGTH)) <= whole // 1000, (truncated, whole)


def test_a_looping_template_is_cancelled_within_a_second_and_the_next_collection_runs(server: LiveServer) -> None:
    api = server.client
    pid = job_process(server)
    job = post(api, "loops", "looping", CHAT)
    wait_running(api, job["job_id"])
    time.sleep(1.5)  # inside the render (the model loaded, the template process started)
    asked = time.monotonic()
    assert api.delete(f"/jobs/{job['job_id']}").status_code == 200
    final = wait_for_job(api, job["job_id"], timeout=30)
    latency = time.monotonic() - asked
    print(f"\nlooping template: cancelled {latency:.2f}s after DELETE")  # noqa: T201
    assert final["status"] == "cancelled", final
    assert latency < 8.0  # typically 0.25-0.35 s; the margin is for a loaded machine
    assert job_process(server) == pid  # stopped by its own check, not by killing the job process
    assert template_children(pid) == []  # the render process went with the job
    post(api, "after-the-loop", "plain", [{"text": "the collect lane is free again"}])
    wait_concepts_ready(api, ["after-the-loop"], timeout=60)


@pytest.mark.parametrize(
    ("model", "setting"),
    [
        ("repeat", "ENGRAM_TEMPLATE_MAX_CHARS"),
        ("doubling", "ENGRAM_TEMPLATE_MEMORY_BYTES"),
        ("looping", "ENGRAM_TEMPLATE_TIMEOUT_S"),
    ],
)
def test_a_template_past_a_bound_fails_the_job_naming_the_setting(server: LiveServer, model: str, setting: str) -> None:
    api = server.client
    job = post(api, f"bound-{model}", model, CHAT)
    started = time.monotonic()
    final = wait_for_job(api, job["job_id"], timeout=120)
    print(f"\n{model} template: {final['status']} in {time.monotonic() - started:.1f}s")  # noqa: T201
    assert final["status"] == "failed", final
    assert setting in final["error"]["detail"], final["error"]
    assert final["error"]["status"] < 500
    assert template_children(job_process(server)) == []


def test_the_render_process_never_outlives_a_collection(server: LiveServer) -> None:
    api = server.client
    post(api, "plain-chat", "plain", CHAT)
    wait_concepts_ready(api, ["plain-chat"])
    assert template_children(job_process(server)) == []


def assert_413_naming_the_setting(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text[:500]
    assert response.headers["content-type"].startswith("application/problem+json")
    assert "ENGRAM_MAX_RECORD_BYTES" in response.json()["detail"], response.json()


def test_a_record_over_the_record_limit_is_413_naming_it_and_stores_nothing(server: LiveServer) -> None:
    api = server.client
    text = UNIT * (MAX_RECORD_BYTES // len(UNIT) + 10)
    body = {"name": "too-long", "models": ["t/plain"], "records": [{"text": "short"}, {"text": text}]}
    assert_413_naming_the_setting(api.post("/concepts", json=body))
    line = json.dumps({"text": text}).encode()
    files = {"dataset": ("d.jsonl", b'{"text": "short"}\n' + line + b"\n", "application/x-ndjson")}
    assert_413_naming_the_setting(api.post("/concepts", data={"name": "too-long", "models": "t/plain"}, files=files))
    assert api.get("/concepts/too-long").status_code == 404


def feed_unended_line(feed: JsonlFeed, kilobytes: int) -> None:
    for _ in range(kilobytes):
        feed.feed(b"a" * 1024)


def test_a_line_too_long_for_a_record_is_refused_before_it_is_buffered(tmp_path: Path) -> None:
    with DatasetSpool(tmp_path / "d.jsonl", 10, max_record_bytes=1024) as spool:
        feed = JsonlFeed(spool)
        with pytest.raises(PayloadTooLarge, match="dataset line 1 is over .* ENGRAM_MAX_RECORD_BYTES"):
            feed_unended_line(feed, 100)  # refused once it passes 6 × 1024 + 4096 bytes
        assert sum(len(piece) for piece in feed._partial) < 16 * 1024
