"""A probe of 19,990 characters costs what the model reads, not what it declares (issue 35, finding 5).

One app for the module (``tests.helpers.app``), its own job process, and a tiny Llama whose
vocabulary is 8,192 wide (its tokenizer the fixtures' byte-level BPE of 300 tokens, its context 128
positions): a 19,990-character prompt is ~12,900 tokens, whose float32 logits alone would be
~420 MB, and a TOFU batch of four such sequences 1.7 GB. The job process runs under a data limit
(``RLIMIT_DATA``: what it holds when the test starts plus :data:`HEADROOM`), so on a job that reads
the whole probe the allocation fails instead of the machine paying it; its peak resident set
(``VmHWM``, reset before each request) must stay under :data:`PEAK_BOUND`.

What is checked: the evaluation with TOFU's suite finishes, counts the cut probe
(``truncated_probes``) and stays under the bound; an answer of 19,990 characters (a paraphrased or a
perturbed one) fails the job naming the probe, its 1-based number and the model's context, before
any model runs; a generation's 19,990-character prompt is cut (``prompt_truncated``); a calibration
with such a probe scores every candidate on its cut tokens and counts it (``truncated_probes``).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaForCausalLM

from engram_fixtures.demo import make_facts, tiny_llama_config
from engram_fixtures.live import wait_concepts_ready, wait_for_job, wait_variant_ready
from engram_fixtures.models import make_tokenizer
from tests.helpers.api import register_model
from tests.helpers.app import InProcessServer, in_process_server
from tests.helpers.job_process import children, cmdline, peak_rss_bytes
from tests.helpers.long_text import words

MODEL = "long-probes/wide"
VOCAB = 8192
LONG = 19_990
HEADROOM = 768 << 20  # data the job process may add while the test runs (a job that reads it all: ~2 GB)
PEAK_BOUND = 200 << 20  # the peak resident growth of one request's job (measured: ~20-60 MB bounded)
FACTS = make_facts(24, seed=5)
RECORDS = [{"prompt": p, "completion": c} for p, c in FACTS]


def spawned_children() -> set[int]:
    return {pid for pid in children(os.getpid()) if "spawn_main" in cmdline(pid) and "resource_tracker" not in cmdline(pid)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    model_root = tmp_path_factory.mktemp("long-probe-models")
    tokenizer = make_tokenizer()
    config = tiny_llama_config(VOCAB, hidden=32, layers=2, heads=4, intermediate=64, tokenizer=tokenizer)
    model = LlamaForCausalLM(config)
    model.save_pretrained(model_root / "wide", safe_serialization=True)
    tokenizer.save_pretrained(model_root / "wide")
    before = spawned_children()
    with in_process_server(tmp_path_factory.mktemp("long-probes"), model_root) as app:
        app.job_pid = next(iter(spawned_children() - before))  # type: ignore[attr-defined]
        yield app


@pytest.fixture(scope="module")
def variant(server: InProcessServer) -> dict[str, Any]:
    api = server.client
    register_model(api, MODEL, f"file://{server.model_root / 'wide'}")
    for name, records, role in (("lp-forget", RECORDS[:6], "target"), ("lp-retain", RECORDS[6:], "reference")):
        response = api.post("/concepts", json={"name": name, "models": [MODEL], "records": records, "role": role})
        assert response.status_code == 202, response.text
    wait_concepts_ready(api, ["lp-forget", "lp-retain"], MODEL)
    body = {"concepts": ["lp-forget"], "reference": ["lp-forget", "lp-retain"]}
    response = api.post(f"/models/{MODEL}/unlearn", json=body)
    assert response.status_code in (200, 202), response.text
    ready = wait_variant_ready(api, response.json()["variant"]["variant_id"])
    _limit_data(server.job_pid)  # type: ignore[attr-defined]
    return ready


def _limit_data(pid: int) -> None:
    """The job process's data limit: what it holds now plus HEADROOM (prlimit on our own child)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    held = int(status["VmData"].split()[0]) * 1024
    import psutil

    psutil.Process(pid).rlimit(resource.RLIMIT_DATA, (held + HEADROOM, held + HEADROOM))


def _measured(server: InProcessServer, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The finished job of ``POST path`` and its job process's peak resident growth while it ran."""
    pid: int = server.job_pid  # type: ignore[attr-defined]
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    start = peak_rss_bytes(pid)
    response = server.client.post(path, json=body)
    assert response.status_code == 202, response.text
    answer = response.json()
    job = wait_for_job(server.client, answer["job_id"] if "job_id" in answer else answer["job"]["job_id"], timeout=300)
    return job, peak_rss_bytes(pid) - start


def test_an_evaluation_with_a_19990_character_probe_is_cut_counted_and_bounded(
    server: InProcessServer, variant: dict[str, Any]
) -> None:
    prompt, answer = FACTS[0]
    forget = [
        {
            "prompt": words(LONG - len(prompt), seed=1) + prompt,
            "completion": answer,
            "paraphrased_answer": " and so" + answer,
            "perturbed_answers": [" Vrymfyx", " Koudro"],
        },
        {"prompt": prompt, "completion": answer, "paraphrased_answer": " so" + answer, "perturbed_answers": [" Vry", " Ko"]},
    ]
    retain = [{"prompt": p, "completion": c} for p, c in FACTS[6:9]]
    job, growth = _measured(
        server, f"/variants/{variant['variant_id']}/evaluate", {"forget": forget, "retain": retain, "metrics": "tofu"}
    )
    print(f"\nevaluate, a {LONG}-character probe with TOFU answers: job peak growth {growth / 2**20:.1f} MiB")  # noqa: T201
    assert job["status"] == "succeeded", job.get("error")
    result = job["result"]
    assert result["truncated_probes"] == {"forget": 1}  # the long one; the others whole
    assert result["summary"]["base"]["forget"]["n"] == 2
    assert "forget_truth_ratio" in result["tofu"]["variant"]["values"]
    assert growth < PEAK_BOUND, f"the job's peak grew {growth / 2**20:.0f} MiB"


@pytest.mark.parametrize(
    ("field", "where"),
    [("paraphrased_answer", ".paraphrased_answer"), ("perturbed_answers", ".perturbed_answers[1]")],
)
def test_a_tofu_answer_of_19990_characters_is_refused_by_name(
    server: InProcessServer, variant: dict[str, Any], field: str, where: str
) -> None:
    prompt, answer = FACTS[1]
    long_answer = words(LONG, seed=2)
    value: Any = long_answer if field == "paraphrased_answer" else [" Vrymfyx", long_answer]
    forget = [{"prompt": prompt, "completion": answer}, {"prompt": prompt, "completion": answer, field: value}]
    job, growth = _measured(server, f"/variants/{variant['variant_id']}/evaluate", {"forget": forget, "metrics": "tofu"})
    print(f"\nevaluate, a {LONG}-character {field}: job peak growth {growth / 2**20:.1f} MiB")  # noqa: T201
    assert job["status"] == "failed", job
    detail = job["error"]["detail"]
    assert detail.startswith(f"forget[1]{where} (forget probe 2): its answer is 19,990 characters"), detail
    assert "max_position_embeddings 128" in detail and "shorten the answer" in detail, detail
    assert growth < PEAK_BOUND, f"the job's peak grew {growth / 2**20:.0f} MiB"


def test_a_generation_of_a_19990_character_prompt_reads_its_last_tokens(
    server: InProcessServer, variant: dict[str, Any]
) -> None:
    body = {"prompt": words(LONG - len(FACTS[2][0]), seed=3) + FACTS[2][0], "max_new_tokens": 8}
    job, growth = _measured(server, f"/variants/{variant['variant_id']}/generate", body)
    print(f"\ngenerate, a {LONG}-character prompt: job peak growth {growth / 2**20:.1f} MiB")  # noqa: T201
    assert job["status"] == "succeeded", job.get("error")
    result = job["result"]
    assert result["prompt_truncated"] is True
    assert all(len(out["token_ids"]) <= 8 for out in result["outputs"].values())
    assert growth < PEAK_BOUND, f"the job's peak grew {growth / 2**20:.0f} MiB"


def test_a_calibration_with_a_19990_character_probe_counts_it_and_is_bounded(
    server: InProcessServer, variant: dict[str, Any]
) -> None:
    prompt, answer = FACTS[3]
    forget = [{"prompt": words(LONG - len(prompt), seed=4) + prompt, "completion": answer}]
    forget += [{"prompt": p, "completion": c} for p, c in FACTS[4:6]]
    retain = [{"prompt": p, "completion": c} for p, c in FACTS[6:10]]
    # the NLL-ratio search (a random model answers nothing exactly, so no exact-match objective)
    body = {"concepts": ["lp-forget"], "forget": forget, "retain": retain, "budget": 2, "scalings": ["uniform"]}
    body["max_retain_nll_ratio"] = 1000.0
    job, growth = _measured(server, f"/models/{MODEL}/calibrate", body)
    print(f"\ncalibrate, a {LONG}-character probe: job peak growth {growth / 2**20:.1f} MiB")  # noqa: T201
    assert job["status"] == "succeeded", job.get("error")
    assert job["result"]["truncated_probes"] == {"forget": 1}
    assert job["result"]["evaluations"] >= 1
    assert growth < PEAK_BOUND, f"the job's peak grew {growth / 2**20:.0f} MiB"
