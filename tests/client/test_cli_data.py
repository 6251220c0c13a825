"""The ``engram`` CLI with data in the wild (issue 15): datasets by reference, the chat template, chat probes.

Runs ``python -m engram_client.cli`` against the session's real server (``live_server``), like
``test_cli.py``. Its own models, under the session's model root (the server's ENGRAM_MODEL_ROOTS, so
``file://`` references inside it are allowed): ``cli-data/chat``, a tiny Llama whose tokenizer has a
chat template, and ``cli-data/plain``, the session's tiny Llama without one. Names are prefixed
``cli-data`` so they cannot collide with other modules on the shared server.

- ``concepts add --dataset-uri … --column … --rows …`` stores a reference that the worker resolves
  into the very dataset (digest) and statistics that the same records uploaded as a file give.
- ``concepts add --template chat`` counts each answer and its closing token (the chat rule), which
  a plain concept of the same records does not; a model without a chat template is the service's 422.
- ``evaluate`` takes ``{"messages"}`` probes and ``generate --chat [--system]`` sends chat messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from engram_client import EngramClient
from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer
from engram_fixtures.models import make_tiny_chat_llama
from tests.helpers.cli import failed, ok, run_cli, says, write_jsonl

CHAT_MODEL = "cli-data/chat"
PLAIN_MODEL = "cli-data/plain"
FACTS = make_facts(30, seed=31)
PAIRS = [{"prompt": p, "completion": c} for p, c in FACTS[:20]]


@dataclass(frozen=True)
class World:
    url: str
    chat_dir: Path  # the chat model's folder
    data: Path  # datasets inside the server's model root (file:// references may name them)


def uri(path: Path) -> str:
    return f"file://{path}"


@pytest.fixture(scope="module")
def world(live_server: LiveServer, model_root: Path, tiny_llama_dir: Path) -> World:
    chat_dir = make_tiny_chat_llama(model_root / "cli-data-chat")
    data = model_root / "cli-data-sets"
    data.mkdir()
    table = pa.table({"question": [r["prompt"] for r in PAIRS], "answer": [r["completion"] for r in PAIRS]})
    pq.write_table(table, data / "cli-data-facts.parquet", row_group_size=7)
    write_jsonl(data / "pairs.jsonl", PAIRS)
    url = live_server.base_url
    ok(run_cli(url, "models", "add", CHAT_MODEL, uri(chat_dir)))
    ok(run_cli(url, "models", "add", PLAIN_MODEL, uri(tiny_llama_dir)))
    return World(url, chat_dir, data)


def concept_json(url: str, name: str) -> dict[str, Any]:
    return json.loads(ok(run_cli(url, "--json", "concepts", "show", name)).stdout)


def job_result(api: httpx.Client, concept: dict[str, Any], model: str) -> dict[str, Any]:
    job = api.get(f"/jobs/{concept['models'][model]['job_id']}").json()
    assert job["status"] == "succeeded", job
    return job["result"]


def test_a_reference_gives_the_dataset_and_statistics_of_the_same_records_uploaded(world: World, api: httpx.Client) -> None:
    rows = world.data / "rows-5-15.jsonl"
    write_jsonl(rows, PAIRS[5:15])
    ok(run_cli(world.url, "concepts", "add", rows, "-m", CHAT_MODEL, "--name", "cli-data-uploaded"))
    uploaded = concept_json(world.url, "cli-data-uploaded")

    parquet = uri(world.data / "cli-data-facts.parquet")
    args = ("--dataset-uri", parquet, "--column", "prompt=question", "--column", "completion=answer", "--rows", "5:15")
    shown = ok(run_cli(world.url, "concepts", "add", "-m", CHAT_MODEL, *args))
    assert f"concept cli-data-facts: {parquet}, fetched by the worker" in shown.stderr  # the name: the URI's stem
    assert f"cli-data-facts: {parquet} (10 records, resolved)" in shown.stdout
    assert "cli-data-facts on cli-data/chat: ready" in shown.stdout
    concept = concept_json(world.url, "cli-data-facts")
    fingerprint = concept["dataset"].pop("fingerprint")
    assert set(fingerprint) == {"size", "mtime_ns", "inode"}  # a file:// reference: pinned to this file
    assert fingerprint["size"] == (world.data / "cli-data-facts.parquet").stat().st_size
    assert concept["dataset"] == {
        "uri": parquet,
        "format": "parquet",
        "columns": {"text": None, "prompt": "question", "completion": "answer", "messages": None},
        "rows": {"start": 5, "stop": 15},
        "digest": uploaded["dataset_digest"],
        "status": "resolved",
        "error": None,
    }
    assert (concept["dataset_digest"], concept["num_records"]) == (uploaded["dataset_digest"], 10)
    assert concept["models"][CHAT_MODEL]["tokens"] == uploaded["models"][CHAT_MODEL]["tokens"]
    ours, theirs = job_result(api, concept, CHAT_MODEL), job_result(api, uploaded, CHAT_MODEL)
    assert ours["stats"] == theirs["stats"] and ours["reused"] is True  # the same statistics, not collected again

    # A JSONL reference with the format given and an open-ended row range: the records from row 15 on.
    tail = ok(
        run_cli(
            world.url, "--json", "concepts", "add", "-m", CHAT_MODEL, "--name", "cli-data-tail",
            "--dataset-uri", uri(world.data / "pairs.jsonl"), "--dataset-format", "jsonl", "--rows", "15:",
        )
    )  # fmt: skip
    added = json.loads(tail.stdout)
    assert added["concept"]["dataset"]["rows"] == {"start": 15, "stop": None}
    assert added["concept"]["num_records"] == len(PAIRS) - 15 and added["jobs"][0]["status"] == "succeeded"


def test_a_bad_reference_prints_the_problem_and_exits_1(world: World) -> None:
    outside = failed(
        run_cli(world.url, "concepts", "add", "-m", CHAT_MODEL, "--dataset-uri", "file:///etc/cli-data.jsonl"),
        "(422)",
        "outside",
    )
    assert "ENGRAM_DATASET_ROOTS" in outside
    missing = uri(world.data / "cli-data-missing.jsonl")
    failed(run_cli(world.url, "concepts", "add", "-m", CHAT_MODEL, "--dataset-uri", missing), "failed", "does not exist")
    concept = concept_json(world.url, "cli-data-missing")
    assert concept["dataset"]["status"] == "failed" and "does not exist" in concept["dataset"]["error"]
    shown = ok(run_cli(world.url, "concepts", "show", "cli-data-missing")).stdout
    assert f"cli-data-missing: {missing} (failed)" in shown and "does not exist" in shown
    wrong_column = ("--column", "prompt=question", "--column", "completion=reply")
    failed(
        run_cli(world.url, "concepts", "add", "-m", CHAT_MODEL, "--name", "cli-data-wrong",
                "--dataset-uri", uri(world.data / "cli-data-facts.parquet"), *wrong_column),
        "failed",
        "reply",
    )  # fmt: skip


def rule_tokens(tokenizer: Any, pair: dict[str, str]) -> int:
    """The chat rule's count for a one-turn chat, straight from the template: the render of the
    conversation beyond the render of the question with the generation prompt."""
    messages = [{"role": "user", "content": pair["prompt"]}, {"role": "assistant", "content": pair["completion"]}]
    whole = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert whole[: len(prompt)] == prompt
    return len(whole) - len(prompt)


def test_template_chat_counts_each_answer_and_its_closing_token(world: World) -> None:
    path = write_jsonl(world.data / "cli-data-pairs.jsonl", PAIRS)
    templated = ok(
        run_cli(world.url, "concepts", "add", path, "-m", CHAT_MODEL, "--name", "cli-data-templated", "--template", "chat")
    )
    assert "cli-data-templated: records rendered with the chat template (chat)" in templated.stdout
    plain = ok(run_cli(world.url, "concepts", "add", path, "-m", CHAT_MODEL, "--name", "cli-data-untemplated"))
    tokenizer = AutoTokenizer.from_pretrained(world.chat_dir)
    chat, raw = concept_json(world.url, "cli-data-templated"), concept_json(world.url, "cli-data-untemplated")
    assert chat["template"] == "chat" and raw["template"] is None
    assert chat["models"][CHAT_MODEL]["tokens"] == sum(rule_tokens(tokenizer, r) for r in PAIRS)
    answers = sum(len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) for r in PAIRS)
    assert raw["models"][CHAT_MODEL]["tokens"] == answers
    assert "rendered with the chat template" not in plain.stdout


def test_template_chat_on_a_model_without_one_is_the_services_422(world: World) -> None:
    path = world.data / "cli-data-pairs.jsonl"
    write_jsonl(path, PAIRS)
    failed(
        run_cli(
            world.url, "concepts", "add", path, "-m", PLAIN_MODEL, "--name", "cli-data-notemplate", "--template", "chat"
        ),
        "(422)",
        "chat template",
    )
    failed(run_cli(world.url, "concepts", "show", "cli-data-notemplate"), "Not found (404)")  # nothing stored


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        pytest.param([], ("FILE", "--dataset-uri"), id="neither-file-nor-reference"),
        pytest.param(["FILE", "--dataset-uri", "s3://b/k.jsonl"], ("one of them",), id="both"),
        pytest.param(["FILE", "--rows", "0:4"], ("describe a --dataset-uri",), id="rows-without-reference"),
        pytest.param(["--dataset-uri", "s3://b/k.jsonl", "--column", "prompt"], ("FIELD=COLUMN",), id="column-no-equals"),
        pytest.param(["--dataset-uri", "s3://b/k.jsonl", "--column", "answer=x"], ("FIELD=COLUMN",), id="column-field"),
        pytest.param(
            ["--dataset-uri", "s3://b/k.jsonl", "--column", "text=a", "--column", "text=b"], ("twice",), id="column-twice"
        ),
        pytest.param(["--dataset-uri", "s3://b/k.jsonl", "--rows", "5"], ("START:STOP",), id="rows-no-colon"),
        pytest.param(["--dataset-uri", "s3://b/k.jsonl", "--rows", "a:b"], ("START:STOP",), id="rows-not-numbers"),
        pytest.param(["FILE", "--template", "jinja"], ("jinja",), id="unknown-template"),
    ],
)
def test_concepts_add_usage_errors_exit_2(world: World, args: list[str], mentions: tuple[str, ...]) -> None:
    path = world.data / "cli-data-pairs.jsonl"
    write_jsonl(path, PAIRS)
    argv = [str(path) if a == "FILE" else a for a in args]
    result = run_cli(world.url, "concepts", "add", "-m", CHAT_MODEL, "--name", "cli-data-usage", *argv)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    for mention in mentions:
        assert says(result.stderr, mention), result.stderr


@pytest.fixture(scope="module")
def chat_variant(world: World) -> str:
    """``cli-data-templated``'s facts unlearned from the chat model (built here so the order of tests does not matter)."""
    with EngramClient(world.url) as client:
        submission = client.add_concept("cli-data-forget", [CHAT_MODEL], records=PAIRS[:10], template="chat")
        assert {j.status for j in client.wait_for_jobs([j.job_id for j in submission.jobs], poll_s=0.1)} == {"succeeded"}
        variant = client.unlearn(CHAT_MODEL, ["cli-data-forget"], alpha=1.0)
        return client.wait_for_variant(variant.variant.variant_id, poll_s=0.1).variant_id


def test_evaluate_takes_chat_probes(world: World, chat_variant: str, api: httpx.Client) -> None:
    probes = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
              for r in PAIRS[:4]]  # fmt: skip
    path = write_jsonl(world.data / "cli-data-chat-probes.jsonl", probes)
    result = json.loads(ok(run_cli(world.url, "--json", "evaluate", chat_variant, "--forget", path)).stdout)
    assert result["summary"]["base"]["forget"]["n"] == result["summary"]["variant"]["forget"]["n"] == 4
    bad = write_jsonl(world.data / "cli-data-bad-probes.jsonl", [{"messages": "hello"}])
    failed(run_cli(world.url, "evaluate", chat_variant, "--forget", bad), "line 1", '{"messages": [...]}')


def test_generate_chat_sends_the_messages(world: World, chat_variant: str, api: httpx.Client) -> None:
    question = PAIRS[0]["prompt"]
    shown = ok(
        run_cli(world.url, "--json", "generate", chat_variant, question, "--chat", "--system", "Be brief.",
                "--max-new-tokens", "4", "-m", "variant")
    )  # fmt: skip
    result = json.loads(shown.stdout)
    assert result["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    assert list(result["outputs"]) == ["variant"]
    usage = run_cli(world.url, "generate", chat_variant, question, "--system", "Be brief.")
    assert usage.returncode == 2 and "--chat" in usage.stderr, usage
