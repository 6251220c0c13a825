"""Data in the wild (issue 15) through a real server: chat records, datasets by reference, limits.

One server for the module (embedded mode, file storage) that may read ``file://`` datasets from its
own dataset root and ``s3://`` datasets from a real SeaweedFS, with small limits so they are cheap
to hit (``ENGRAM_MAX_RECORDS=60``, ``ENGRAM_MAX_DATASET_BYTES`` and ``ENGRAM_MAX_UPLOAD_BYTES``
64 KiB). Its models: a tiny Llama whose tokenizer has a chat template, the same without one, and one
whose template breaks the prefix property.

- A concept of chat records has exactly the statistics of a float64 reference computed over the
  counted tokens of the rule (each assistant turn: ``render(messages[:i+1])`` beyond
  ``render(messages[:i], add_generation_prompt=True)``), and its token count is the rule's.
- JSONL and Parquet references on S3 and ``file://`` (and ``hf://`` from a hub cache, offline) give
  the dataset digest, and so the statistics, of the same records posted inline.
- Bad references are a clear problem and store no dataset.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engram_fixtures.demo import make_facts
from engram_fixtures.live import (
    LiveServer,
    download_variant,
    start_server,
    stop_server,
    wait_concepts_ready,
    wait_for_job,
    wait_variant_ready,
)
from engram_fixtures.models import make_tiny_chat_llama
from service.datasets.spool import record_line
from service.engine.records import Record
from service.engine.stats_io import load_statistics
from tests.helpers.api import assert_problem, unchanged
from tests.helpers.s3 import SeaweedServer

CHAT = "chat/tiny"
PLAIN = "plain/tiny"  # no chat template
BROKEN = "broken/tiny"  # a template that marks the last message: renders are no prefixes of each other
MAX_RECORDS = 60
MAX_BYTES = 64 * 1024
DATA_WEIGHTED_TOL = 1e-3
FACTS = make_facts(80, seed=15)
SYSTEM = "Answer with the name only."
# A template that renders the last message differently: the shorter render is no prefix of the longer.
BROKEN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{% if loop.last %}[last]{% endif %}\n"
    "{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def conversations(facts: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Chats of one or two question/answer turns, some with a system prompt or a tool message."""
    records = []
    for k in range(0, len(facts) - 1, 2):
        (q1, a1), (q2, a2) = facts[k], facts[k + 1]
        messages = [{"role": "user", "content": q1}, {"role": "assistant", "content": a1}]
        if k % 4 == 0:
            messages = [{"role": "system", "content": SYSTEM}, *messages]
        if k % 6 == 0:
            messages += [{"role": "tool", "content": "lookup: ok"}]
        messages += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
        records.append({"messages": messages})
    return records


def pairs(facts: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"prompt": p, "completion": c} for p, c in facts]


CHATS = conversations(FACTS[:16])  # 8 conversations, 16 assistant turns
PAIRS = pairs(FACTS[16:40])  # 24 records for the references


def digest_of(records: list[dict[str, Any]]) -> str:
    return hashlib.sha256(b"".join(record_line(Record.from_mapping(r, i)) for i, r in enumerate(records))).hexdigest()


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data-in-the-wild")
    make_tiny_chat_llama(path / "models" / "chat")
    make_tiny_chat_llama(path / "models" / "plain", template=None)
    make_tiny_chat_llama(path / "models" / "broken", template=BROKEN_TEMPLATE)
    (path / "datasets").mkdir()
    (path / "home").mkdir()
    return path


@pytest.fixture(scope="module")
def server(root: Path, seaweed: SeaweedServer, s3_bucket: str) -> Iterator[LiveServer]:
    live = start_server(
        root / "store",
        root / "models",
        root / "server.log",
        ENGRAM_DATASET_ROOTS=str(root / "datasets"),
        # The module's bucket, and the names the refusal cases use (so they meet the rule they test).
        ENGRAM_DATASET_BUCKETS=f"{s3_bucket},bucket,nowhere",
        ENGRAM_MAX_RECORDS=str(MAX_RECORDS),
        ENGRAM_MAX_DATASET_BYTES=str(MAX_BYTES),
        ENGRAM_MAX_UPLOAD_BYTES=str(MAX_BYTES),
        ENGRAM_S3_ENDPOINT_URL=seaweed.endpoint_url,
        ENGRAM_CACHE_DIR=str(root / "cache"),
        HOME=str(root / "home"),
        **seaweed.env(),
    )
    try:
        for model_id, folder in ((CHAT, "chat"), (PLAIN, "plain"), (BROKEN, "broken")):
            response = live.client.post(
                "/models", json={"model_id": model_id, "source": f"file://{root / 'models' / folder}"}
            )
            assert response.status_code == 201, response.text
        yield live
    finally:
        stop_server(live)


def post(api: httpx.Client, name: str, models: list[str], **body: Any) -> httpx.Response:
    return api.post("/concepts", json={"name": name, "models": models, **body})


def collected(api: httpx.Client, response: httpx.Response) -> dict[str, Any]:
    """The succeeded collection job of a 202 answer with one job."""
    assert response.status_code == 202, response.text
    job = wait_for_job(api, response.json()["jobs"][0]["job_id"])
    assert job["status"] == "succeeded", job
    return job


def stored_datasets(server: LiveServer) -> set[str]:
    folder = server.storage_dir / "datasets"
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


# ---------------------------------------------------------------- chat records


def rule(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
    """The conversation's tokens and which are counted, straight from the issue's rule."""
    whole = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    counted = [False] * len(whole)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True, return_dict=False)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=False)
        assert through[: len(before)] == before and whole[: len(through)] == through
        counted[len(before) : len(through)] = [True] * (len(through) - len(before))
    return whole, counted


def reference_sums(
    model_dir: Path, encoded: list[tuple[list[int], list[bool]]], every_token: bool = False
) -> dict[str, Any]:
    """float64 ``Σ x xᵀ`` of every linear layer's input over the counted tokens, record by record."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(torch.float64).eval()
    sums: dict[str, torch.Tensor] = {}
    mask: list[torch.Tensor] = []

    def hook(name: str) -> Any:
        def pre(_module: Any, args: tuple[Any, ...]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1])[mask[0]]
            sums[name] = sums.get(name, 0) + x.T @ x

        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad():
            for ids, counted in encoded:
                mask[:] = [torch.ones(len(ids), dtype=torch.bool) if every_token else torch.tensor(counted)]
                model(input_ids=torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return sums


def statistics_of(server: LiveServer, job: dict[str, Any]) -> Any:
    return load_statistics(server.storage_dir / job["result"]["stats"] / "statistics.safetensors")


def test_chat_concept_equals_a_float64_reference_over_the_counted_tokens(server: LiveServer, root: Path) -> None:
    api = server.client
    job = collected(api, post(api, "chat-facts", [CHAT], records=CHATS))
    tokenizer = AutoTokenizer.from_pretrained(root / "models" / "chat")
    encoded = [rule(tokenizer, r["messages"]) for r in CHATS]
    counted_tokens = sum(sum(c) for _, c in encoded)
    # Each assistant turn counts its content and the EOS that closes it, nothing else.
    assert counted_tokens == sum(
        len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) + 1
        for r in CHATS
        for m in r["messages"]
        if m["role"] == "assistant"
    )
    concept = api.get("/concepts/chat-facts").json()
    state = {k: v for k, v in concept["models"][CHAT].items() if k != "truncation"}
    assert state == {"status": "ready", "tokens": counted_tokens, "job_id": job["job_id"]}
    assert concept["dataset_digest"] == digest_of(CHATS)
    stored = (server.storage_dir / "datasets" / f"{digest_of(CHATS)}.jsonl").read_text().splitlines()
    assert json.loads(stored[0]) == CHATS[0]
    assert stored[0].startswith('{"messages": [{"content": ')  # the canonical form: keys sorted

    stats = statistics_of(server, job)
    expected = reference_sums(root / "models" / "chat", encoded)
    everything = reference_sums(root / "models" / "chat", encoded, every_token=True)
    assert set(stats.layer_group) == set(expected)
    for layer, sigma in expected.items():
        error = float((stats.sum_for(layer) - sigma).norm() / sigma.norm())
        assert error <= DATA_WEIGHTED_TOL, f"{layer}: data-weighted relative error {error:.2e}"
        # The bar discriminates: counting every token read is far from it.
        assert float((everything[layer] - sigma).norm() / sigma.norm()) > 100 * DATA_WEIGHTED_TOL, layer
    assert stats.tokens == counted_tokens


def test_template_chat_renders_prompt_completion_as_one_turn(server: LiveServer) -> None:
    api = server.client
    records = pairs(FACTS[40:48])
    as_chats = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]} for p, c in FACTS[40:48]]
    raw = collected(api, post(api, "pairs-raw", [CHAT], records=records))
    chat = collected(api, post(api, "pairs-chat", [CHAT], records=records, template="chat"))
    messages = collected(api, post(api, "pairs-messages", [CHAT], records=as_chats))
    concept = api.get("/concepts/pairs-chat").json()
    assert concept["template"] == "chat" and concept["dataset_digest"] == digest_of(records)
    assert chat["result"]["stats"] != raw["result"]["stats"], "the template is part of the statistics key"
    # The same tokens as the one-turn chats: the same counts and Σ.
    assert chat["result"]["tokens"] == messages["result"]["tokens"] > raw["result"]["tokens"]
    a, b = statistics_of(server, chat), statistics_of(server, messages)
    for layer in a.layer_group:
        assert torch.allclose(a.sum_for(layer), b.sum_for(layer), rtol=1e-9, atol=1e-9), layer
    # Posting again: template left out keeps it; another is a 409 naming both; null is no template.
    again = post(api, "pairs-chat", [CHAT], records=records)
    assert again.status_code == 202 and again.json()["jobs"][0]["job_id"] == chat["job_id"]
    assert_problem(post(api, "pairs-raw", [CHAT], records=records, template="chat"), 409, "'chat'", "None")
    assert_problem(post(api, "pairs-chat", [CHAT], records=records, template=None), 422, "template")


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        pytest.param({"records": CHATS[:2]}, (PLAIN, "chat template"), id="messages"),
        pytest.param({"records": PAIRS[:2], "template": "chat"}, (PLAIN, "chat template"), id="template-chat"),
        pytest.param(
            {"dataset": {"uri": "s3://nowhere/chats.parquet", "columns": {"messages": "conversation"}}},
            (PLAIN, "chat template"),
            id="reference-of-messages",
        ),
        pytest.param({"records": [{"text": "plain text"}], "template": "chat"}, ("text records",), id="chat-over-text"),
    ],
)
def test_chat_without_a_template_is_422_and_stores_nothing(
    server: LiveServer, body: dict[str, Any], mentions: tuple[str, ...]
) -> None:
    with unchanged(server):
        assert_problem(post(server.client, "no-template", [PLAIN], **body), 422, *mentions)


def test_a_template_that_breaks_the_prefix_property_fails_the_job_naming_the_record(server: LiveServer) -> None:
    api = server.client
    response = post(api, "broken-chat", [BROKEN], records=CHATS[:3])
    assert response.status_code == 202, response.text
    job = wait_for_job(api, response.json()["jobs"][0]["job_id"])
    assert job["status"] == "failed", job
    assert "record 0" in job["error"]["detail"] and "prefix" in job["error"]["detail"], job["error"]
    assert api.get("/concepts/broken-chat").json()["models"][BROKEN]["status"] == "failed"


@pytest.mark.parametrize(
    ("records", "mentions"),
    [
        pytest.param([{"messages": [{"role": "user", "content": "hi"}]}], ("record 0", "no assistant"), id="no-assistant"),
        pytest.param(
            [{"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}],
            ("record 0", "message 0"),
            id="assistant-first",
        ),
        pytest.param(
            [{"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]}],
            ("message 1", "wizard"),
            id="unknown-role",
        ),
        pytest.param(
            [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}]}],
            ("message 1", "content"),
            id="content-not-a-string",
        ),
        pytest.param(
            [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "weight": 0}]}],
            ("message 1", "weight"),
            id="unknown-message-field",
        ),
        pytest.param([{"messages": [], "text": "x"}], ("record 0",), id="messages-and-text"),
    ],
)
def test_bad_chat_records_are_422(server: LiveServer, records: list[Any], mentions: tuple[str, ...]) -> None:
    with unchanged(server):
        assert_problem(post(server.client, "bad-chat", [CHAT], records=records), 422, *mentions)


def test_uploaded_chat_records_have_the_digest_of_the_same_posted_inline(server: LiveServer) -> None:
    api = server.client
    data = "".join(json.dumps(r) + "\n" for r in CHATS[:4]).encode()
    response = api.post(
        "/concepts",
        data={"name": "chat-upload", "models": CHAT},
        files={"dataset": ("chats.jsonl", data, "application/json")},
    )
    assert response.status_code == 202, response.text
    assert response.json()["concept"]["dataset_digest"] == digest_of(CHATS[:4])


def test_uploads_keep_their_byte_limit(server: LiveServer) -> None:
    data = b"".join(json.dumps({"text": "x" * 2000}).encode() + b"\n" for _ in range(40))  # ~80 KB, 40 records
    with unchanged(server):
        response = server.client.post(
            "/concepts",
            data={"name": "big-upload", "models": CHAT},
            files={"dataset": ("big.jsonl", data, "application/json")},
        )
        assert_problem(response, 413, str(MAX_BYTES), "ENGRAM_MAX_UPLOAD_BYTES")


# ---------------------------------------------------------------- evaluate and generate with messages


@pytest.fixture(scope="module")
def chat_variant(server: LiveServer) -> dict[str, Any]:
    api = server.client
    collected(api, post(api, "chat-forget", [CHAT], records=conversations(FACTS[48:52])))
    collected(api, post(api, "chat-retain", [CHAT], records=conversations(FACTS[52:64]), role="reference"))
    wait_concepts_ready(api, ["chat-forget", "chat-retain"], CHAT)
    body = {"concepts": ["chat-forget"], "reference": ["chat-forget", "chat-retain"]}
    response = api.post(f"/models/{CHAT}/unlearn", json=body)
    assert response.status_code in (200, 202), response.text
    return wait_variant_ready(api, response.json()["variant"]["variant_id"])


def turn_nll(model: Any, tokenizer: Any, messages: list[dict[str, str]]) -> float:
    """Mean NLL of the last assistant turn's counted tokens, from the rule directly: a sequence longer
    than the model's context (max_position_embeddings) keeps its BOS and the prompt's last tokens."""
    before = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    context = model.config.max_position_embeddings
    if len(whole) > context:
        answer, room = whole[len(before) :], context - (len(whole) - len(before))
        kept = before[:1] + before[len(before) - (room - 1) :] if before[0] == tokenizer.bos_token_id else before[-room:]
        before, whole = kept, kept + answer
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([whole])).logits[0].float()
    target = torch.tensor(whole[len(before) :])
    return float(torch.nn.functional.cross_entropy(logits[len(before) - 1 : len(whole) - 1], target))


def test_evaluate_and_generate_take_messages(
    server: LiveServer, chat_variant: dict[str, Any], root: Path, tmp_path: Path
) -> None:
    api = server.client
    probes = [r["messages"] for r in conversations(FACTS[48:52])]
    response = api.post(
        f"/variants/{chat_variant['variant_id']}/evaluate",
        params={"wait": 30},
        json={"forget": [{"messages": m} for m in probes], "retain": [pairs(FACTS[52:53])[0]]},
    )
    assert response.status_code in (200, 202), response.text
    job = wait_for_job(api, response.json()["job_id"])
    assert job["status"] == "succeeded", job
    tokenizer = AutoTokenizer.from_pretrained(root / "models" / "chat")
    base = AutoModelForCausalLM.from_pretrained(root / "models" / "chat").eval()
    variant = AutoModelForCausalLM.from_pretrained(download_variant(api, chat_variant, tmp_path / "variant")).eval()
    served = [r for r in job["result"]["records"] if r["split"] == "forget"]
    context = base.config.max_position_embeddings
    longer = sum(len(tokenizer.apply_chat_template(m, tokenize=True, return_dict=False)) > context for m in probes)
    assert job["result"].get("truncated_probes", {}).get("forget", 0) == longer, job["result"].get("truncated_probes")
    for record, messages in zip(served, probes, strict=True):
        for name, model in (("base", base), ("variant", variant)):
            expected = turn_nll(model, tokenizer, messages)
            assert abs(record[name]["nll"] - expected) <= 1e-4 * max(1.0, expected), (name, record, expected)
    # A probe without an assistant message is refused before any job.
    no_turn = [m for m in probes[0] if m["role"] != "assistant"]
    bad = api.post(f"/variants/{chat_variant['variant_id']}/evaluate", json={"forget": [{"messages": no_turn}]})
    assert_problem(bad, 422, "assistant")

    conversation = probes[0][:-1]
    response = api.post(
        f"/variants/{chat_variant['variant_id']}/generate",
        params={"wait": 30},
        json={"messages": conversation, "max_new_tokens": 6, "models": ["base"]},
    )
    job = wait_for_job(api, response.json()["job_id"])
    assert job["status"] == "succeeded", job
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = base.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    assert job["result"]["outputs"]["base"]["token_ids"] == out[0, len(prompt) :].tolist()
    assert job["result"]["messages"] == conversation
    assert_problem(
        api.post(f"/variants/{chat_variant['variant_id']}/generate", json={"prompt": "x", "messages": conversation}), 422
    )


# ---------------------------------------------------------------- datasets by reference


def write_sources(folder: Path, records: list[dict[str, str]]) -> dict[str, bytes]:
    """The records as JSONL and Parquet under other column names (and an extra column), by name."""
    rows = [{"id": i, "question": r["prompt"], "answer": r["completion"]} for i, r in enumerate(records)]
    jsonl = "".join(json.dumps(row) + "\n" for row in rows).encode()
    table = pa.table({k: [row[k] for row in rows] for k in ("id", "question", "answer")})
    pq.write_table(table, folder / "facts.parquet", row_group_size=7)  # several row groups
    files = {"facts.jsonl": jsonl, "facts.parquet": (folder / "facts.parquet").read_bytes()}
    chats = pa.table({"conversation": [r["messages"] for r in CHATS], "source": ["x"] * len(CHATS)})
    pq.write_table(chats, folder / "chats.parquet")
    files["chats.parquet"] = (folder / "chats.parquet").read_bytes()
    files["plain.jsonl"] = "".join(json.dumps(r) + "\n" for r in records).encode()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


@pytest.fixture(scope="module")
def sources(server: LiveServer, root: Path, seaweed: SeaweedServer, s3_bucket: str) -> dict[str, str]:
    """URI prefix by place: the dataset root, S3, and a hub cache (offline: what hf:// finds there)."""
    folder = root / "datasets"
    files = write_sources(folder, PAIRS)
    client = seaweed.client()
    for name, data in files.items():
        client.put_object(Bucket=s3_bucket, Key=f"sets/{name}", Body=data)
    snapshot = root / "cache" / "hf-datasets" / "datasets--org--facts" / "snapshots" / ("0" * 40)
    (snapshot / "data").mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    for name, data in files.items():
        (snapshot / "data" / name).write_bytes(data)
    return {"file": f"file://{folder}/", "s3": f"s3://{s3_bucket}/sets/", "hf": "hf://datasets/org/facts/data/"}


MAPPED = {"prompt": "question", "completion": "answer"}


@pytest.mark.parametrize("place", ["file", "s3", "hf"])
def test_references_give_the_statistics_of_the_same_records_inline(
    server: LiveServer, sources: dict[str, str], place: str
) -> None:
    api = server.client
    inline = collected(api, post(api, f"inline-{place}", [CHAT], records=PAIRS))
    expected = digest_of(PAIRS)
    for name, reference in (
        (f"{place}-jsonl", {"uri": sources[place] + "facts.jsonl", "columns": MAPPED}),
        (f"{place}-parquet", {"uri": sources[place] + "facts.parquet", "columns": MAPPED}),
        (f"{place}-plain", {"uri": sources[place] + "plain.jsonl"}),
    ):
        response = post(api, name, [CHAT], dataset=reference)
        assert response.status_code == 202, response.text
        pending = response.json()["concept"]
        assert pending["dataset"]["uri"] == reference["uri"]
        job = collected(api, response)
        assert job["result"]["stats"] == inline["result"]["stats"], name  # the same key: the same statistics
        assert job["result"]["reused"] is True, name  # no collection ran again
        tokens = job["result"]["tokens"]
        assert tokens > 0 and (job["progress"]["done"], job["progress"]["total"]) == (tokens, tokens), job["progress"]
        concept = api.get(f"/concepts/{name}").json()
        assert concept["dataset_digest"] == expected and concept["num_records"] == len(PAIRS), concept
        assert concept["dataset"]["digest"] == expected and concept["dataset"]["status"] == "resolved", concept
        pinned = {"file": {"size", "mtime_ns", "inode"}, "s3": {"etag", "size"}, "hf": {"commit"}}[place]
        assert pinned <= set(concept["dataset"]["fingerprint"] or {}), concept["dataset"]  # what reads are pinned to
        assert concept["models"][CHAT]["status"] == "ready"
        # Idempotent: the same reference again starts nothing.
        again = post(api, name, [CHAT], dataset=reference)
        assert again.status_code == 202 and again.json()["jobs"][0]["job_id"] == job["job_id"]
        assert_problem(post(api, name, [CHAT], dataset={**reference, "rows": {"stop": 3}}), 409, name)


def test_parquet_messages_and_a_row_range(server: LiveServer, sources: dict[str, str]) -> None:
    api = server.client
    chats = post(
        api, "ref-chats", [CHAT], dataset={"uri": sources["s3"] + "chats.parquet", "columns": {"messages": "conversation"}}
    )
    collected(api, chats)
    assert api.get("/concepts/ref-chats").json()["dataset_digest"] == digest_of(CHATS)
    for place, fmt in (("file", "parquet"), ("s3", "jsonl")):
        rows = {"start": 5, "stop": 17}
        response = post(
            api, f"rows-{place}", [CHAT], dataset={"uri": sources[place] + f"facts.{fmt}", "columns": MAPPED, "rows": rows}
        )
        collected(api, response)
        assert api.get(f"/concepts/rows-{place}").json()["dataset_digest"] == digest_of(PAIRS[5:17]), place


@pytest.mark.parametrize(
    ("reference", "status", "mentions"),
    [
        pytest.param({"uri": "file:///etc/passwd.jsonl"}, 422, ("outside", "ENGRAM_DATASET_ROOTS"), id="file-outside-roots"),
        pytest.param({"uri": "DATASETS/../facts.jsonl"}, 422, ("..",), id="file-dotdot"),
        pytest.param({"uri": "ftp://host/facts.jsonl"}, 422, ("uri",), id="bad-scheme"),
        pytest.param({"uri": "s3://bucket/a/../b.jsonl"}, 422, ("..",), id="s3-dotdot"),
        pytest.param({"uri": "hf://datasets/org/facts/x/../y.jsonl"}, 422, ("..",), id="hf-dotdot"),
        pytest.param({"uri": "s3://bucket/facts.csv"}, 422, ("format",), id="unknown-format"),
        pytest.param(
            {"uri": "s3://bucket/facts.jsonl", "rows": {"start": 0, "stop": 1000}},
            413,
            ("ENGRAM_MAX_RECORDS",),
            id="rows-over-the-record-limit",
        ),
        pytest.param(
            {"uri": "s3://bucket/facts.jsonl", "columns": {"prompt": "q"}}, 422, ("columns",), id="columns-half-pair"
        ),
        pytest.param(
            {"uri": "s3://bucket/facts.jsonl", "rows": {"start": 4, "stop": 2}}, 422, ("rows",), id="rows-reversed"
        ),
    ],
)
def test_bad_references_are_refused_at_the_api(
    server: LiveServer, root: Path, reference: dict[str, Any], status: int, mentions: tuple[str, ...]
) -> None:
    reference = {**reference, "uri": reference["uri"].replace("DATASETS", f"file://{root / 'datasets'}")}
    with unchanged(server):
        assert_problem(post(server.client, "bad-ref", [CHAT], dataset=reference), status, *mentions)


def _big_jsonl(folder: Path) -> None:
    (folder / "too-many.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(MAX_RECORDS + 5)))
    (folder / "too-big.jsonl").write_text("".join(json.dumps({"text": "y" * 1000}) + "\n" for _ in range(70)))
    (folder / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (folder / "not-parquet.parquet").write_bytes(b"PAR1 but not really")


@pytest.mark.parametrize(
    ("uri", "extra", "mentions"),
    [
        pytest.param("S3missing.jsonl", {}, ("does not exist",), id="missing-object"),
        pytest.param("FILEmissing.jsonl", {}, ("does not exist",), id="missing-file"),
        pytest.param(
            "S3facts.parquet",
            {"columns": {"prompt": "question", "completion": "reply"}},
            ("reply", "answer"),
            id="wrong-parquet-column",
        ),
        pytest.param("FILEfacts.jsonl", {"columns": {"text": "body"}}, ("line 1", "body"), id="wrong-jsonl-column"),
        pytest.param("FILEfacts.parquet", {}, ("no column messages", "question"), id="parquet-no-default-columns"),
        pytest.param("FILElatin1.jsonl", {}, ("line 2", "UTF-8"), id="not-utf8"),
        pytest.param("FILEtoo-many.jsonl", {}, (str(MAX_RECORDS), "ENGRAM_MAX_RECORDS"), id="over-the-record-limit"),
        pytest.param("FILEtoo-big.jsonl", {}, (str(MAX_BYTES), "ENGRAM_MAX_DATASET_BYTES"), id="over-the-byte-limit"),
        pytest.param("FILEnot-parquet.parquet", {}, ("Parquet",), id="not-parquet"),
        pytest.param("HFmissing.jsonl", {}, ("cannot fetch", "hf://"), id="hf-missing"),
    ],
)
def test_bad_references_fail_their_job_and_store_nothing(
    server: LiveServer, sources: dict[str, str], root: Path, uri: str, extra: dict[str, Any], mentions: tuple[str, ...]
) -> None:
    _big_jsonl(root / "datasets")
    for key, place in (("S3", "s3"), ("FILE", "file"), ("HF", "hf")):
        uri = uri.replace(key, sources[place]) if uri.startswith(key) else uri
    api = server.client
    before = stored_datasets(server)
    name = "bad-" + hashlib.sha256(uri.encode() + json.dumps(extra).encode()).hexdigest()[:12]
    response = post(api, name, [CHAT], dataset={"uri": uri, **extra})
    assert response.status_code == 202, response.text
    job = wait_for_job(api, response.json()["jobs"][0]["job_id"])
    assert job["status"] == "failed", job
    for mention in mentions:
        assert mention in job["error"]["detail"], job["error"]
    assert job["error"]["status"] < 500, job["error"]
    concept = api.get(f"/concepts/{name}").json()
    assert concept["models"][CHAT]["status"] == "failed"
    assert concept["dataset"]["status"] == "failed" and concept["dataset"]["error"] == job["error"]["detail"]
    assert concept["dataset_digest"] is None and concept["num_records"] is None
    assert stored_datasets(server) == before, "a bad reference stored a dataset"


def test_the_python_client_posts_references_templates_and_messages(
    server: LiveServer, sources: dict[str, str], chat_variant: dict[str, Any]
) -> None:
    from engram_client import EngramClient

    with EngramClient(server.base_url) as client:
        reference = {"uri": sources["file"] + "facts.parquet", "columns": MAPPED, "rows": {"stop": 10}}
        submission = client.add_concept("client-ref", [CHAT], dataset=reference, template="chat")
        assert submission.concept.dataset is not None and submission.concept.dataset.uri == reference["uri"]
        assert submission.concept.template == "chat" and submission.concept.dataset_digest is None
        job = wait_for_job(server.client, submission.jobs[0].job_id)
        assert job["status"] == "succeeded", job
        concept = client.get_concept("client-ref")
        assert concept.dataset_digest == digest_of(PAIRS[:10]) and concept.dataset.status == "resolved"
        messages = conversations(FACTS[48:50])[0]["messages"]
        generated = client.generate(chat_variant["variant_id"], messages[:-1], 4, ["variant"], wait=True)
        assert generated.result is not None and generated.result["messages"] == messages[:-1]
        evaluated = client.evaluate(chat_variant["variant_id"], forget=[{"messages": messages}], wait=True)
        assert evaluated.status == "succeeded" and evaluated.result["summary"]["base"]["forget"]["n"] == 1
