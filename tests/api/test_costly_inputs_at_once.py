"""Issue 35's second done-when: one request of each costly kind, at once, through the HTTP API of a
live server (``engram-service serve``, a process of its own), while another key's collection runs.

The costly kinds, at the sizes the red team used: a 1 × 39,000,000 PNG strip (under
ENGRAM_MAX_IMAGE_PIXELS, ~100 KB) in a concept for an image model and in one for a text model; a
Parquet reference of 3,958 bytes holding 20 rows of a 100 MB zero blob (zstd); an evaluation with a
19,990-character probe and TOFU answers as long; a request with a 1 MB header; and a callback URL
whose receiver answers 200 and then streams without end (capped here at :data:`STREAM_BYTES`, so
that a server that reads it all fails by a measured peak, not by taking the machine).

What must hold: the API's resident peak (``VmHWM``, reset just before the burst) grows by less than
:data:`API_GROWTH_BOUND`; each costly request is refused with a 4xx that says why, or its job fails
by name (a problem that is not an internal error) or succeeds, all within the job process's
ENGRAM_JOB_MEMORY_BYTES (:data:`JOB_BUDGET`), and the job process is never replaced; the other
key's collection succeeds. The peaks are printed (``-s``).
"""

from __future__ import annotations

import base64
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import LlamaForCausalLM

from engram_fixtures.demo import make_facts, tiny_llama_config
from engram_fixtures.live import (
    LiveServer,
    free_port,
    start_server,
    stop_server,
    wait_concepts_ready,
    wait_for_job,
    wait_variant_ready,
)
from engram_fixtures.models import make_tokenizer
from engram_fixtures.vision import make_tiny_resnet
from tests.helpers.api import register_model
from tests.helpers.job_process import alive, job_process, peak_rss_bytes
from tests.helpers.long_text import words

TEXT, IMAGE = "costly/text", "costly/image"
ATTACKER, VICTIM = "attacker-key-0123456789", "victim-key-0123456789"
JOB_BUDGET = 1536 << 20  # ENGRAM_JOB_MEMORY_BYTES of the server's job process
API_GROWTH_BOUND = 256 << 20  # the API's resident peak over its size before the burst
STRIP_PIXELS = 39_000_000
LONG = 19_990
STREAM_BYTES = 512 << 20  # the "endless" callback answer, capped
HEADER_BYTES = 1 << 20
SECRET = "costly-callback-secret"
FACTS = make_facts(24, seed=35)


def strip_png(height: int) -> bytes:
    """A 1 × ``height`` RGB PNG of zeros, compressed as it is written (never held decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    packer, rows, parts = zlib.compressobj(9), b"\0" * 4 * 65536, []  # each row: filter byte + one RGB pixel
    for start in range(0, height, 65536):
        parts.append(packer.compress(rows[: 4 * min(65536, height - start)]))
    parts.append(packer.flush())
    header = struct.pack(">IIBBBBB", 1, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


def hostile_parquet(path: Path, rows: int = 20, blob: int = 100_000_000) -> Path:
    """``rows`` rows of one ``blob``-byte zero value, zstd: a few KB on disk (built from the one blob)."""
    column = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), pa.array([b"\0" * blob], pa.binary()))
    pq.write_table(pa.table({"text": column}), path, compression="zstd", store_schema=False)
    return path


class EndlessReceiver:
    """A callback receiver that answers 200 and then streams zeros (up to STREAM_BYTES), per connection."""

    def __init__(self) -> None:
        self.port = free_port()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.connections = 0
        self.sent = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.listener.settimeout(0.5)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            self.connections += 1
            threading.Thread(target=self._stream, args=(conn,), daemon=True).start()

    def _stream(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n\r\n")
                block = b"\0" * 65536
                while self.sent < STREAM_BYTES and not self.stop.is_set():
                    conn.sendall(block)
                    self.sent += len(block)
                self.stop.wait(30)  # then silent, the connection open
            except OSError:
                return  # the API closed it: what a bounded delivery does

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[EndlessReceiver]:
    endless = EndlessReceiver()
    yield endless
    endless.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, receiver: EndlessReceiver) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("costly")
    models, data = root / "models", root / "data"
    data.mkdir()
    tokenizer = make_tokenizer()
    config = tiny_llama_config(8192, hidden=32, layers=2, heads=4, intermediate=64, tokenizer=tokenizer)
    LlamaForCausalLM(config).save_pretrained(models / "text", safe_serialization=True)
    tokenizer.save_pretrained(models / "text")
    make_tiny_resnet(models / "image")
    hostile_parquet(data / "blobs.parquet")
    live = start_server(
        root / "store",
        models,
        root / "server.log",
        ENGRAM_API_KEYS=f"{ATTACKER}:write,{VICTIM}:write",
        ENGRAM_JOB_MEMORY_BYTES=str(JOB_BUDGET),
        ENGRAM_DATASET_ROOTS=str(data),
        ENGRAM_CALLBACK_HOSTS=f"127.0.0.1:{receiver.port}",
        ENGRAM_CALLBACK_SECRET=SECRET,
        ENGRAM_CALLBACK_TIMEOUT_S="2",
        ENGRAM_CALLBACK_MAX_ATTEMPTS="2",
        ENGRAM_CALLBACK_BACKOFF_S="0.5",
    )
    live.client.headers["Authorization"] = f"Bearer {ATTACKER}"
    try:
        yield live
    finally:
        stop_server(live)


@pytest.fixture(scope="module")
def variant(server: LiveServer) -> dict[str, Any]:
    api = server.client
    register_model(api, TEXT, f"file://{server.model_root / 'text'}")
    register_model(api, IMAGE, f"file://{server.model_root / 'image'}")
    records = [{"prompt": p, "completion": c} for p, c in FACTS]
    for name, chosen, role in (("cf-forget", records[:6], "target"), ("cf-retain", records[6:], "reference")):
        response = api.post("/concepts", json={"name": name, "models": [TEXT], "records": chosen, "role": role})
        assert response.status_code == 202, response.text
    wait_concepts_ready(api, ["cf-forget", "cf-retain"], TEXT, timeout=300)
    response = api.post(f"/models/{TEXT}/unlearn", json={"concepts": ["cf-forget"], "reference": ["cf-forget", "cf-retain"]})
    assert response.status_code in (200, 202), response.text
    return wait_variant_ready(api, response.json()["variant"]["variant_id"], timeout=300)


def reset_peak(pid: int) -> int:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := the resident set now
    return peak_rss_bytes(pid)


def _concept(api: httpx.Client, name: str, model: str, **fields: Any) -> httpx.Response:
    return api.post("/concepts", json={"name": name, "models": [model], **fields})


def costly_requests(server: LiveServer, variant_id: str, receiver: EndlessReceiver) -> dict[str, Any]:
    """name -> a function sending that request (each with the attacker's key)."""
    api = server.client
    strip = {"image": base64.b64encode(strip_png(STRIP_PIXELS)).decode(), "label": 0}
    prompt, answer = FACTS[0]
    probe = {
        "prompt": words(LONG - len(prompt), seed=1) + prompt,
        "completion": answer,
        "paraphrased_answer": words(LONG, seed=2),
        "perturbed_answers": [words(LONG, seed=3), words(LONG, seed=4)],
    }
    reference = {"uri": f"file://{server.model_root.parent / 'data' / 'blobs.parquet'}", "format": "parquet"}
    callback = f"http://127.0.0.1:{receiver.port}/hook"
    return {
        "strip image to the image model": lambda: _concept(api, "strip-image", IMAGE, records=[strip]),
        "strip image to the text model": lambda: _concept(api, "strip-text", TEXT, records=[strip]),
        "hostile parquet": lambda: _concept(api, "parquet-bomb", TEXT, dataset=reference),
        "19,990-character probe": lambda: api.post(
            f"/variants/{variant_id}/evaluate", json={"forget": [probe], "retain": [probe], "metrics": "tofu"}
        ),
        "1 MB header": lambda: httpx.get(f"{server.base_url}/healthz", headers={"x-big": "a" * HEADER_BYTES}, timeout=30),
        "endless callback": lambda: _concept(
            api, "called-back", TEXT, records=[{"text": "a short record"}], callback_url=callback
        ),
    }


def outcome(api: httpx.Client, response: httpx.Response) -> str:
    """What became of one costly request: its refusal, or its job's end (waited for)."""
    if response.status_code >= 400:
        problem = response.json() if response.headers.get("content-type", "").endswith("json") else {}
        assert response.status_code < 500, response.text
        return f"{response.status_code} {problem.get('detail', response.reason_phrase)}"[:160]
    body = response.json()
    jobs = body.get("jobs") or ([body] if "job_id" in body else [])
    ends = []
    for job in jobs:
        done = wait_for_job(api, job["job_id"], timeout=600)
        if done["status"] == "failed":
            error = done["error"]
            assert error["status"] < 500 or "ENGRAM_JOB_MEMORY_BYTES" in error["detail"], error
            ends.append(f"failed: {error['detail']}"[:160])
        else:
            assert done["status"] == "succeeded", done
            ends.append("succeeded")
    return "; ".join(ends) or f"{response.status_code}"


def test_costly_inputs_at_once_keep_the_api_bounded_and_the_other_key_served(
    server: LiveServer, variant: dict[str, Any], receiver: EndlessReceiver
) -> None:
    api = server.client
    victim = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {VICTIM}"}, timeout=60)
    worker = job_process(server)
    requests = costly_requests(server, variant["variant_id"], receiver)
    api_before, jobs_before = reset_peak(server.process.pid), reset_peak(worker)

    records = [{"text": " ".join(p + c for p, c in make_facts(8, seed=100 + i))} for i in range(60)]
    started = victim.post("/concepts", json={"name": "victim-work", "models": [TEXT], "records": records})
    assert started.status_code == 202, started.text
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = dict(zip(requests, pool.map(lambda send: send(), requests.values()), strict=True))
    assert answers["1 MB header"].status_code == 431, answers["1 MB header"].text[:300]
    outcomes = {name: outcome(api, answer) for name, answer in answers.items()}
    [victim_job] = started.json()["jobs"]
    victim_done = wait_for_job(victim, victim_job["job_id"], timeout=600)
    deadline = time.monotonic() + 30
    while receiver.connections == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # a delivery past its deadline has ended by now

    api_peak, jobs_peak = peak_rss_bytes(server.process.pid), peak_rss_bytes(worker)
    figures = [
        f"API resident: {api_before / 2**20:.0f} MiB before, peak {api_peak / 2**20:.0f} MiB"
        f" (bound: +{API_GROWTH_BOUND >> 20} MiB)",
        f"job process resident: {jobs_before / 2**20:.0f} MiB before, peak {jobs_peak / 2**20:.0f} MiB"
        f" (ENGRAM_JOB_MEMORY_BYTES={JOB_BUDGET})",
        f"callback receiver: {receiver.connections} connection(s), {receiver.sent / 2**20:.1f} MiB sent",
        *(f"  {name}: {end}" for name, end in outcomes.items()),
    ]
    print("\n" + "\n".join(figures))  # noqa: T201
    assert victim_done["status"] == "succeeded", victim_done
    assert receiver.connections >= 1, "the callback was never delivered"
    assert receiver.sent < STREAM_BYTES, "the API read the endless answer to its end"
    assert api_peak - api_before < API_GROWTH_BOUND, f"the API grew {(api_peak - api_before) / 2**20:.0f} MiB"
    assert alive(worker) and job_process(server) == worker, "the job process died"
