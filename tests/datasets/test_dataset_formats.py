"""Chat and instruction datasets in the shapes users have them, through a real server.

One server for the module (embedded mode, file storage) with a tiny Llama whose tokenizer has a chat
template, and one whose template breaks the prefix property (a collection-time problem per record).
OpenAI messages with content parts and a ``name``, ShareGPT ``conversations`` and Alpaca
``instruction``/``input``/``output`` records, sent inline, as a gzip-compressed upload, and by a
``file://`` JSONL or Parquet reference, give the dataset (digest), the tokens and the statistics of
the canonical records they mean, token for token. What the statistics cannot represent (an image or
audio part, a tool call, an unknown ShareGPT speaker) is a 422 naming the record where the user
finds it: ``records[i]``, the file's line, or the Parquet row, one way in each message. A collected
concept shows its truncation report per model.

The 422s are the app's answers: they run on the same app and settings in this process
(``tests.helpers.app``, the fast tier); what a job collects runs on the server.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from engram_fixtures.live import LiveServer, start_server, stop_server, wait_for_job
from engram_fixtures.models import make_tiny_chat_llama
from service.datasets.spool import record_line
from service.engine.records import Record, encode_record
from tests.helpers.api import assert_problem, unchanged
from tests.helpers.app import InProcessServer, in_process_server

MODEL = "formats/chat"
BROKEN = "formats/broken"
MAX_LENGTH = 64
# Marks the last message: a shorter render is no token prefix of a longer one (refused per record).
BROKEN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{% if loop.last %}[last]{% endif %}\n"
    "{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


# (in-the-wild records, the canonical records they mean). Each list's rows share one Arrow type, so
# that it is also a Parquet file.
OPENAI_PARTS = [
    {
        "messages": [
            {"role": "system", "content": parts("Answer with the name only.")},
            {"role": "user", "content": parts("Who wrote Emma?", "Be brief."), "name": "ada"},
            {"role": "assistant", "content": parts(" Jane", " Austen")},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": parts("Capital of France?")},
            {"role": "assistant", "content": parts("Paris")},
        ]
    },
]
OPENAI_CANONICAL = [
    {
        "messages": [
            {"role": "system", "content": "Answer with the name only."},
            {"role": "user", "content": "Who wrote Emma?\nBe brief.", "name": "ada"},
            {"role": "assistant", "content": " Jane\n Austen"},
        ]
    },
    {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]},
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "Be terse."},
            {"from": "human", "value": "Who wrote Emma?"},
            {"from": "gpt", "value": "Jane Austen"},
            {"from": "user", "value": "And Dracula?"},
            {"from": "model", "value": "Bram Stoker"},
        ]
    },
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "assistant", "value": "4"}]},
]
SHAREGPT_CANONICAL = [
    {
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Who wrote Emma?"},
            {"role": "assistant", "content": "Jane Austen"},
            {"role": "user", "content": "And Dracula?"},
            {"role": "assistant", "content": "Bram Stoker"},
        ]
    },
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
]
ALPACA = [
    {"instruction": "Name the author of Emma.", "input": "", "output": "Jane Austen"},
    {"instruction": "Translate to French.", "input": "the cat", "output": "le chat"},
]
ALPACA_CANONICAL = [
    {"prompt": "Name the author of Emma.", "completion": "Jane Austen"},
    {"prompt": "Translate to French.\n\nthe cat", "completion": "le chat"},
]
SHAPES = {
    "openai-parts-and-name": (OPENAI_PARTS, OPENAI_CANONICAL),
    "sharegpt": (SHAREGPT, SHAREGPT_CANONICAL),
    "alpaca": (ALPACA, ALPACA_CANONICAL),
}


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def digest_of(records: list[dict[str, Any]]) -> str:
    return hashlib.sha256(b"".join(record_line(Record.from_mapping(r, i)) for i, r in enumerate(records))).hexdigest()


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dataset-formats")
    make_tiny_chat_llama(path / "models" / "chat")
    make_tiny_chat_llama(path / "models" / "broken", template=BROKEN_TEMPLATE)
    (path / "datasets").mkdir()
    return path


def settings(root: Path) -> dict[str, str]:
    """The module's settings, as a server's environment spells them."""
    return {"ENGRAM_DATASET_ROOTS": str(root / "datasets"), "ENGRAM_MAX_LENGTH": str(MAX_LENGTH)}


def register(api: httpx.Client, root: Path) -> None:
    for model_id, folder in ((MODEL, "chat"), (BROKEN, "broken")):
        source = f"file://{root / 'models' / folder}"
        response = api.post("/models", json={"model_id": model_id, "source": source})
        assert response.status_code == 201, response.text


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[LiveServer]:
    live = start_server(
        root / "store", root / "models", root / "server.log", ENGRAM_CACHE_DIR=str(root / "cache"), **settings(root)
    )
    try:
        register(live.client, root)
        yield live
    finally:
        stop_server(live)


@pytest.fixture(scope="module")
def app(root: Path) -> Iterator[InProcessServer]:
    """The same app and settings in this process (a store of its own): for what the app refuses."""
    with in_process_server(root / "in-process", root / "models", **settings(root)) as server:
        register(server.client, root)
        yield server


def post(api: httpx.Client, name: str, model: str = MODEL, **body: Any) -> httpx.Response:
    return api.post("/concepts", json={"name": name, "models": [model], **body})


def finished(api: httpx.Client, response: httpx.Response, status: str = "succeeded") -> dict[str, Any]:
    """The collection job of a 202 answer with one job, finished with ``status``."""
    assert response.status_code == 202, response.text
    job = wait_for_job(api, response.json()["jobs"][0]["job_id"])
    assert job["status"] == status, job
    return job


def send(
    api: httpx.Client, root: Path, how: str, name: str, records: list[dict[str, Any]], **options: Any
) -> httpx.Response:
    """Post ``records`` as a concept: inline, a gzip-compressed upload, or a JSONL or Parquet reference."""
    if how == "inline":
        return post(api, name, records=records)
    if how == "upload":
        files = {"dataset": ("data.jsonl.gz", gzip.compress(jsonl(records)))}
        return api.post("/concepts", data={"name": name, "models": MODEL}, files=files)
    path = root / "datasets" / f"{name}.{how}"
    if how == "parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        path.write_bytes(jsonl(records))
    return post(api, name, dataset={"uri": f"file://{path}", **options})


# ---------------------------------------------------------------- shapes that are read


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_shape_in_the_wild_is_its_canonical_records_token_for_token(server: LiveServer, root: Path, shape: str) -> None:
    wild, canonical = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(root / "models" / "chat")
    for i, (raw, plain) in enumerate(zip(wild, canonical, strict=True)):
        read, meant = Record.from_mapping(raw, i), Record.from_mapping(plain, i)
        assert read == meant
        assert encode_record(tokenizer, read, MAX_LENGTH) == encode_record(tokenizer, meant, MAX_LENGTH)
    api = server.client
    expected = finished(api, post(api, f"{shape}-canonical", records=canonical))
    for how in ("inline", "upload", "jsonl", "parquet"):
        job = finished(api, send(api, root, how, f"{shape}-{how}", wild))
        concept = api.get(f"/concepts/{shape}-{how}").json()
        assert (concept["num_records"], concept["dataset_digest"]) == (len(canonical), digest_of(canonical)), how
        # The same dataset key: the same statistics file, collected once.
        assert (job["result"]["tokens"], job["result"]["stats"]) == (
            expected["result"]["tokens"],
            expected["result"]["stats"],
        ), how


def test_alpaca_fields_come_before_an_exports_formatted_text_column(server: LiveServer, root: Path) -> None:
    path = root / "datasets" / "alpaca-with-text.parquet"
    rows = [{**r, "text": f"### Instruction: {r['instruction']} ### Response: {r['output']}"} for r in ALPACA]
    pq.write_table(pa.Table.from_pylist(rows), path)
    api = server.client
    finished(api, post(api, "alpaca-text-column", dataset={"uri": f"file://{path}"}))
    assert api.get("/concepts/alpaca-text-column").json()["dataset_digest"] == digest_of(ALPACA_CANONICAL)
    finished(api, post(api, "alpaca-text-chosen", dataset={"uri": f"file://{path}", "columns": {"text": "text"}}))
    chosen = api.get("/concepts/alpaca-text-chosen").json()["dataset_digest"]
    assert chosen == digest_of([{"text": r["text"]} for r in rows])


# ---------------------------------------------------------------- shapes that are refused, by name


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
REFUSED = [
    pytest.param(
        {
            "messages": [
                {"role": "user", "content": [*parts("What is this?"), {"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "assistant", "content": "a cat"},
            ]
        },
        ("message 0", "content part 1", "'image_url'", "text-only"),
        id="image-part",
    ),
    pytest.param(
        {
            "messages": [
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]},
                {"role": "assistant", "content": "a cat"},
            ]
        },
        ("message 0", "content part 0", "'input_audio'"),
        id="audio-part",
    ),
    pytest.param(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
                {"role": "assistant", "content": "sunny"},
            ]
        },
        ("message 1", "tool-call", "'tool_calls'"),
        id="tool-calls",
    ),
    pytest.param(
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]},
        ("message 1", "'from' 'bot'", "human"),
        id="unknown-speaker",
    ),
    pytest.param(
        {"instruction": "x", "output": "y", "text": "### x ### y"},
        ("exactly one of", "instruction", "text"),
        id="alpaca-and-text",
    ),
]


@pytest.mark.parametrize(("bad", "mentions"), REFUSED)
@pytest.mark.fast
def test_what_statistics_cannot_represent_is_a_422_naming_the_record(
    app: InProcessServer, bad: dict[str, Any], mentions: tuple[str, ...]
) -> None:
    server = app
    api = server.client
    with unchanged(server):
        assert_problem(post(api, "refused", records=[GOOD, bad]), 422, "record 1", *mentions)
        upload = api.post(
            "/concepts",
            data={"name": "refused", "models": MODEL},
            files={"dataset": ("d.jsonl", b"\n" + jsonl([GOOD, bad]))},
        )
        assert_problem(upload, 422, "dataset line 3", *mentions)
    assert api.get("/concepts/refused").status_code == 404


# ---------------------------------------------------------------- one record, one name


def no_record_count(detail: str) -> None:
    assert re.search(r"record \d", detail) is None, detail


def test_a_reference_names_a_bad_record_by_its_line_or_row_not_its_count_of_kept_records(
    server: LiveServer, root: Path
) -> None:
    api = server.client
    bad = REFUSED[0].values[0]
    records = [GOOD] * 6 + [bad]
    path = root / "datasets" / "numbered.jsonl"
    path.write_bytes(b"\n" + jsonl(records))  # a blank first line: row 6 is line 8
    problem = finished(api, post(api, "numbered-jsonl", dataset={"uri": f"file://{path}", "rows": {"start": 3}}), "failed")
    assert "dataset line 8: message 0: content part 1" in problem["error"]["detail"], problem
    no_record_count(problem["error"]["detail"])
    # Parquet rows are named as dataset.rows counts them (0-based); the concept shows the same problem.
    rows = [{"messages": [{"role": "user", "content": parts("hi")}, {"role": "assistant", "content": parts("yo")}]}] * 4
    image = {"type": "image_url", "image_url": {"url": "x"}}
    rows.append(
        {"messages": [{"role": "user", "content": [*parts("What?"), image]}, {"role": "assistant", "content": parts("a")}]}
    )
    path = root / "datasets" / "numbered.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    problem = finished(api, post(api, "numbered-pq", dataset={"uri": f"file://{path}", "rows": {"start": 2}}), "failed")
    assert "dataset row 4: message 0: content part 1" in problem["error"]["detail"], problem
    no_record_count(problem["error"]["detail"])
    assert api.get("/concepts/numbered-pq").json()["dataset"]["error"] == problem["error"]["detail"]


def test_a_collection_names_a_references_record_by_its_row(server: LiveServer, root: Path) -> None:
    api = server.client
    path = root / "datasets" / "broken.jsonl"
    path.write_bytes(jsonl([GOOD] * 5))
    reference = {"uri": f"file://{path}", "rows": {"start": 2}}
    problem = finished(api, post(api, "broken-rows", model=BROKEN, dataset=reference), "failed")["error"]["detail"]
    assert "dataset row 2" in problem and "prefix" in problem, problem
    no_record_count(problem)
    inline = finished(api, post(api, "broken-inline", model=BROKEN, records=[GOOD] * 2), "failed")["error"]["detail"]
    assert inline.startswith("record 0:") and "prefix" in inline, inline


# ---------------------------------------------------------------- the truncation report on the concept


def test_a_collected_concept_shows_its_truncation_report_per_model(server: LiveServer) -> None:
    api = server.client
    long = " ".join(f"word{i}" for i in range(200))
    records = [{"text": long}, {"prompt": long, "completion": " the answer"}, {"text": "short"}]
    response = post(api, "formats-long", records=records)
    assert response.json()["concept"]["models"][MODEL]["truncation"] is None  # not collected yet
    job = finished(api, response)
    report = {k: job["result"][k] for k in ("records", "truncated", "uncounted")}
    assert report["truncated"]["max_length"] == MAX_LENGTH and report["truncated"]["first"] == [0, 1]
    assert report["uncounted"] == {"records": 1, "first": [1]}
    for _ in range(2):  # the route's answer, then the in-memory one (service.api.fast_status)
        assert api.get("/concepts/formats-long").json()["models"][MODEL]["truncation"] == report
    listed = {c["name"]: c for c in api.get("/concepts").json()}
    assert listed["formats-long"]["models"][MODEL]["truncation"] == report
