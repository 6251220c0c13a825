"""A Parquet reference costs what its metadata says, checked before a value is read (issue 35, finding 4).

A 3,958-byte Parquet file (20 rows of one 100 MB zero blob, zstd: pyarrow writes equal values as a
dictionary of one entry) took a collection job past 4 GB: pyarrow expanded the dictionary into a
batch of every row, ``to_pylist`` copied it again, and only then was the first record found too
large. These tests write such files with pyarrow, scaled down (``ENGRAM_MAX_RECORD_BYTES`` of 1 MiB,
blobs of 4 MiB), and read them as a collection job does (:func:`resolve_reference`) in a process of
their own, whose peak resident memory above its imports is measured (``VmHWM``): reading what
is refused must cost less than :data:`GROWTH_BOUND`, and the refusal must name the file, the row
group, the column and the setting. On the reader before this change the same files cost 78 to 312
MB each and were refused as "dataset row 0 …" after the whole batch and its Python copy were in
memory (this module's ``CHILD`` run over both readers, 2026-11-29).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engram_fixtures.live import wait_for_job
from engram_fixtures.models import make_tiny_chat_llama
from service.config import Settings
from service.datasets import parquet_costs
from service.datasets.parquet import row_bytes
from service.datasets.parquet_costs import BATCH_BYTES, Limits, batch_rows, check_first_pages, check_footer
from service.datasets.refs import StoredReference, resolve_reference, submitted_reference
from service.errors import InvalidInput
from tests.helpers.api import register_model
from tests.helpers.app import in_process_server
from tests.helpers.job_process import children, cmdline, peak_rss_bytes
from tests.helpers.s3 import SeaweedServer, drop_bucket, new_bucket

MiB = 1 << 20
RECORD_BYTES = MiB  # ENGRAM_MAX_RECORD_BYTES in these tests: the attack scaled down 16 times
BLOB = 4 * MiB  # a value over it, of zeros: zstd makes a few KB of it
# What reading a file refused from its metadata may add to a process's peak memory: the footer and
# a page header (0.6 MB measured). The reader before this change added 157 and 312 MB for them.
GROWTH_BOUND = 8 * MiB
# A job process does more than read (a job record, the model's files checked): a margin over GROWTH_BOUND.
JOB_GROWTH_BOUND = 16 * MiB
# An S3 source makes its own boto3 client, whose service model is parsed again (11 MB measured,
# whatever the object): the same margin.
S3_GROWTH_BOUND = 16 * MiB
# One BLOB among small rows is decoded before it is measured: Arrow holds a few copies of it (the
# decompressed dictionary page, the dictionary, the batch, a builder's doubled buffer): 35 MB measured,
# where the reader before this change added 78 MB (a Python copy and its JSON line on top).
HIDDEN_BOUND = 10 * BLOB

# Reads a reference as a collection job does, in a fresh process, and prints what it cost.
CHILD = r"""
import json, pathlib, sys
import pyarrow.parquet  # imported before the baseline: the reader's own code is not what is measured
try:  # pyarrow imports pandas on first use where it is installed (mlflow brings it in dev): library code too (~60 MB)
    import pandas
except ImportError:
    pass
from service.config import Settings
from service.datasets.refs import StoredReference, resolve_reference

def peak():  # VmHWM: this process's peak (ru_maxrss would start at the parent's, kept across exec)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024

args = json.loads(sys.argv[1])
if args.get("warm"):  # a good reference read first: the S3 client's own memory is not what is measured
    warm = pathlib.Path(args["folder"]) / "warm"
    warm.mkdir()
    resolve_reference(StoredReference.model_validate(args["warm"]), Settings(**args["settings"]), warm)
before = peak()
try:
    spooled = resolve_reference(
        StoredReference.model_validate(args["reference"]), Settings(**args["settings"]), pathlib.Path(args["folder"])
    )
    outcome = {"records": spooled.num_records}
except Exception as exc:
    outcome = {"error": f"{type(exc).__name__}: {exc}"}
outcome["grew"] = peak() - before
print(json.dumps(outcome))
"""


def read_in_child(
    reference: StoredReference, settings: dict[str, Any], folder: Path, warm: StoredReference | None = None
) -> dict[str, Any]:
    """Resolve ``reference`` in a process of its own (``warm`` first): ``{"records" | "error", "grew"}``,
    ``grew`` the bytes its peak resident memory rose by while ``reference`` was read."""
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}  # only the settings given
    env["OMP_NUM_THREADS"] = "1"
    args = {"reference": reference.model_dump(), "settings": settings, "folder": str(folder)}
    if warm is not None:
        args["warm"] = warm.model_dump()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def write_blobs(path: Path, rows: int, blob: int = BLOB) -> None:
    """``rows`` rows of ``blob`` zero bytes, as pyarrow writes equal values: a dictionary of one entry
    and ``rows`` indices into it, zstd-compressed, read back as a plain binary column (as when the
    rows were a plain list of bytes). Built from the one blob: the test never holds ``rows`` copies."""
    column = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), pa.array([b"\0" * blob], pa.binary()))
    pq.write_table(pa.table({"text": column}), path, compression="zstd", store_schema=False)
    assert pq.ParquetFile(path).schema_arrow.field("text").type == pa.binary()


def assert_named(error: str, uri: str, column: str = "text") -> None:
    assert uri in error and "row group 0" in error and f"column {column!r}" in error, error
    assert "ENGRAM_MAX_RECORD_BYTES" in error, error


@pytest.fixture
def data(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    return folder


def local_settings(data: Path) -> dict[str, Any]:
    return {"dataset_roots": str(data), "max_record_bytes": RECORD_BYTES, "cache_dir": str(data.parent / "cache")}


# ---------------------------------------------------------------- refused from the metadata


def test_a_dictionary_of_one_huge_blob_is_refused_from_its_page_header_before_a_value_is_read(
    data: Path, tmp_path: Path
) -> None:
    path = data / "blobs.parquet"
    write_blobs(path, 20)
    assert path.stat().st_size < 8 * 1024  # 80 MB of values in a few KB
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).has_dictionary_page
    uri = f"file://{path}"
    settings = local_settings(data)
    outcome = read_in_child(submitted_reference({"uri": uri}, Settings(**settings)), settings, tmp_path / "spool")
    print(f"\n20 rows x {BLOB} B dictionary blob ({path.stat().st_size} B file): peak grew {outcome['grew']} B")  # noqa: T201
    assert "error" in outcome, outcome
    assert_named(outcome["error"], uri)
    assert "dictionary" in outcome["error"] and "nothing was read" in outcome["error"], outcome
    assert outcome["grew"] < GROWTH_BOUND, outcome
    assert not any((tmp_path / "spool").iterdir()) or not (tmp_path / "spool" / "dataset.jsonl").stat().st_size


def test_plain_rows_over_the_record_bound_on_average_are_refused_from_the_footer(data: Path, tmp_path: Path) -> None:
    path = data / "plain.parquet"
    pq.write_table(
        pa.table({"text": pa.array([b"\0" * BLOB] * 12, pa.binary())}), path, compression="zstd", use_dictionary=False
    )
    uri = f"file://{path}"
    settings = local_settings(data)
    outcome = read_in_child(submitted_reference({"uri": uri}, Settings(**settings)), settings, tmp_path / "spool")
    print(f"\n12 plain rows x {BLOB} B ({path.stat().st_size} B file): peak grew {outcome['grew']} B")  # noqa: T201
    assert_named(outcome["error"], uri)
    assert "its 12 rows decompress to" in outcome["error"] and "nothing was read" in outcome["error"], outcome
    assert outcome["grew"] < GROWTH_BOUND, outcome


def test_a_row_group_past_the_dataset_bound_is_refused_from_the_footer(data: Path, tmp_path: Path) -> None:
    path = data / "wide.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " + "x" * 500 for i in range(4000)]}), path, use_dictionary=False)
    uri = f"file://{path}"
    settings = {**local_settings(data), "max_dataset_bytes": MiB}
    with pytest.raises(Exception, match="ENGRAM_MAX_DATASET_BYTES") as exc:
        resolve_reference(submitted_reference({"uri": uri}, Settings(**settings)), Settings(**settings), tmp_path)
    assert f"{uri}: row group 0 decompresses to" in str(exc.value) and "nothing was read" in str(exc.value)


def test_a_footer_that_understates_a_chunk_is_refused_from_its_first_page_header(data: Path) -> None:
    """A hostile footer: pyarrow writes true sizes and a Thrift footer written by hand would be more
    code than the check, so the footer's one figure is understated by a wrapper (the mock here);
    the page header it is compared with is the file's own, read as the job reads it."""
    path = data / "understated.parquet"
    pq.write_table(pa.table({"text": pa.array([b"\0" * BLOB] * 3, pa.binary())}), path, use_dictionary=False)
    metadata = Understated(pq.ParquetFile(path).metadata)
    limits = Limits(record_bytes=RECORD_BYTES, dataset_bytes=1 << 30)
    chunks = check_footer(metadata, ["text"], [0], "file://u", limits)  # the lie passes the footer's checks

    def read_at(offset: int, size: int) -> bytes:
        with path.open("rb") as handle:
            handle.seek(offset)
            return handle.read(size)

    with pytest.raises(InvalidInput, match="the metadata is inconsistent") as exc:
        check_first_pages(read_at, metadata, chunks, "file://u", limits)
    assert "row group 0, column 'text'" in exc.value.detail


class Understated:
    """A file's metadata whose column chunks claim 100 uncompressed bytes each."""

    def __init__(self, metadata: Any) -> None:
        self.metadata = metadata

    def __getattr__(self, name: str) -> Any:
        return getattr(self.metadata, name)

    def row_group(self, index: int) -> Any:
        group = self.metadata.row_group(index)
        return type("Group", (), {"num_rows": group.num_rows, "column": lambda _, i: Lying(group.column(i))})()


class Lying:
    def __init__(self, column: Any) -> None:
        self.column = column
        self.total_uncompressed_size = 100

    def __getattr__(self, name: str) -> Any:
        return getattr(self.column, name)


@pytest.mark.parametrize("codec", ["none", "snappy", "gzip", "brotli", "zstd", "lz4"])
def test_a_small_dictionary_is_read_for_its_longest_entry(data: Path, codec: str) -> None:
    """A text column's dictionary (pyarrow keeps it near 1 MiB) is read and decompressed, so its
    longest value, not its size, sizes the batches; a codec read here not (Parquet's LZ4, Hadoop's
    framing) leaves the size as the bound."""
    path = data / f"{codec}.parquet"
    pq.write_table(pa.table({"text": ["a" * i for i in range(1, 200)] * 3}), path, compression=codec)
    metadata = pq.ParquetFile(path).metadata
    limits = Limits(record_bytes=16 * MiB, dataset_bytes=1 << 30)

    def read_at(offset: int, size: int) -> bytes:
        with path.open("rb") as handle:
            handle.seek(offset)
            return handle.read(size)

    (chunk,) = check_first_pages(
        read_at, metadata, check_footer(metadata, ["text"], [0], path.name, limits), path.name, limits
    )
    longest = 199 if metadata.row_group(0).column(0).compression != "LZ4" else sum(range(1, 200))
    assert chunk.entry_bound == longest


def test_dictionaries_are_walked_within_a_budget_per_file(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past DICTIONARY_ENTRIES_READ entries a file's later dictionaries are bounded by their sizes:
    a hostile file of many dictionaries of empty strings costs no more Python time."""
    path = data / "groups.parquet"
    pq.write_table(pa.table({"text": [f"row {i % 50}" for i in range(400)]}), path, row_group_size=100)
    monkeypatch.setattr(parquet_costs, "DICTIONARY_ENTRIES_READ", 120)  # two groups' 50 entries, not a third
    metadata = pq.ParquetFile(path).metadata
    limits = Limits(record_bytes=16 * MiB, dataset_bytes=1 << 30)

    def read_at(offset: int, size: int) -> bytes:
        with path.open("rb") as handle:
            handle.seek(offset)
            return handle.read(size)

    chunks = check_first_pages(read_at, metadata, check_footer(metadata, ["text"], [0, 1, 2, 3], "g", limits), "g", limits)
    bounds = [chunk.entry_bound for chunk in chunks]
    assert bounds[:2] == [len("row 49")] * 2 and all(bound is not None and bound > 6 for bound in bounds[2:]), bounds


# ---------------------------------------------------------------- measured while read


def test_one_huge_value_among_small_ones_is_refused_by_its_row_before_python_holds_it(data: Path, tmp_path: Path) -> None:
    """The averages pass (one 4 MiB value among 200 rows): the batch holding it is sized from the
    dictionary's header (a few rows), and the row is measured in Arrow and refused by its number."""
    path = data / "hidden.parquet"
    texts = [f"row {i}" for i in range(200)]
    texts[150] = "\0" * BLOB
    pq.write_table(pa.table({"text": texts}), path, compression="zstd")
    uri = f"file://{path}"
    settings = local_settings(data)
    outcome = read_in_child(submitted_reference({"uri": uri}, Settings(**settings)), settings, tmp_path / "spool")
    print(f"\none {BLOB} B value among 200 rows: peak grew {outcome['grew']} B")  # noqa: T201
    named = f"PayloadTooLarge: dataset row 150 ({uri}, row group 0, column 'text') is over"
    assert outcome["error"].startswith(named), outcome
    assert "ENGRAM_MAX_RECORD_BYTES" in outcome["error"], outcome
    assert outcome["grew"] < HIDDEN_BOUND, outcome


def test_batches_are_sized_by_bytes_from_the_metadata(data: Path) -> None:
    small, large = data / "small.parquet", data / "large.parquet"
    pq.write_table(pa.table({"text": [f"short row {i}" for i in range(5000)]}), small)
    pq.write_table(pa.table({"text": [os.urandom(MiB // 2).hex() for _ in range(8)]}), large, use_dictionary=False)
    limits = Limits(record_bytes=16 * MiB, dataset_bytes=1 << 30)
    for path, rows in ((small, 4096), (large, BATCH_BYTES // (MiB + 4))):
        metadata = pq.ParquetFile(path).metadata
        assert batch_rows(check_footer(metadata, ["text"], [0], path.name, limits), 0) == rows, path.name


def test_row_bytes_counts_every_value_without_expanding_a_dictionary() -> None:
    messages = [
        [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": None}],
        None,
        [],
        [{"role": "user", "content": "x" * 1000}],
    ]
    array = pa.array(messages)
    assert row_bytes(array).tolist() == [4 + 6 + 9, 0, 0, 4 + 1000]
    shared = pa.DictionaryArray.from_arrays(pa.array([0, 0, None, 1], pa.int32()), pa.array([b"\0" * 1000, b"ab"]))
    assert row_bytes(shared).tolist() == [1000, 1000, 0, 2]
    image = pa.array([{"bytes": b"\x89PNG", "path": None, "label": 3}])
    assert row_bytes(image).tolist() == [4 + 0 + 1]


def test_every_row_group_of_a_row_range_is_read(data: Path, tmp_path: Path) -> None:
    """A range starting inside a row group used to skip later row groups shorter than the distance
    from the first one's start to the range's start: rows 90 to 99 here, silently."""
    path = data / "groups.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(100)]}), path, row_group_size=30)
    settings = Settings(dataset_roots=str(data))
    reference = submitted_reference({"uri": f"file://{path}", "rows": {"start": 50}}, settings)
    spooled = resolve_reference(reference, settings, tmp_path)
    texts = [json.loads(line)["text"] for line in spooled.path.read_text().splitlines()]
    assert texts == [f"row {i}" for i in range(50, 100)]
    past = submitted_reference({"uri": f"file://{path}", "rows": {"start": 120}}, settings)
    with pytest.raises(InvalidInput, match="starts at row 120, but .* has 100 rows"):
        resolve_reference(past, settings, tmp_path)


# ---------------------------------------------------------------- on S3 (SeaweedFS)


@pytest.fixture
def bucket(s3_env: SeaweedServer) -> Iterator[str]:
    name = new_bucket(s3_env, "parquet-costs")
    try:
        yield name
    finally:
        drop_bucket(s3_env, name)


def test_on_s3_the_same_checks_read_headers_by_ranged_gets_and_good_files_read_whole(
    s3_env: SeaweedServer, bucket: str, data: Path, tmp_path: Path
) -> None:
    """An S3 object's first page headers are read by small ranged GETs of their own, then the file
    is opened again to read it: the attack is refused as on disk, and a file of several row groups
    still reads every row of a range."""
    client = s3_env.client()
    attack, good = data / "blobs.parquet", data / "good.parquet"
    write_blobs(attack, 20)
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(100)]}), good, row_group_size=30)
    for path in (attack, good):
        client.put_object(Bucket=bucket, Key=path.name, Body=path.read_bytes())
    settings = {**local_settings(data), "s3_endpoint_url": s3_env.endpoint_url, "dataset_buckets": bucket}
    uri = f"s3://{bucket}/blobs.parquet"
    reference = submitted_reference({"uri": f"s3://{bucket}/good.parquet", "rows": {"start": 50}}, Settings(**settings))
    attack_reference = submitted_reference({"uri": uri}, Settings(**settings))
    outcome = read_in_child(attack_reference, settings, tmp_path / "attack", warm=reference)
    print(f"\nthe dictionary blob on SeaweedFS: peak grew {outcome['grew']} B")  # noqa: T201
    assert_named(outcome["error"], uri)
    assert outcome["grew"] < S3_GROWTH_BOUND, outcome
    spooled = resolve_reference(reference, Settings(**settings), tmp_path)
    texts = [json.loads(line)["text"] for line in spooled.path.read_text().splitlines()]
    assert texts == [f"row {i}" for i in range(50, 100)]


# ---------------------------------------------------------------- through the API and the job process


def job_process_of_this_test() -> int:
    """The in-process server's job process (multiprocessing's spawn child, not its resource tracker)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in children(os.getpid()):
            line = cmdline(pid)
            if "spawn_main" in line and "resource_tracker" not in line:
                return pid
        time.sleep(0.1)
    raise AssertionError("no job process under this test")


def stored_datasets(storage: Path) -> set[str]:
    return {str(p.relative_to(storage)) for p in storage.rglob("*") if p.is_file() and "datasets" in p.parts}


def test_a_collection_of_the_attack_fails_naming_it_and_stores_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    make_tiny_chat_llama(tmp_path / "models" / "chat")
    warm, attack = data / "warm.parquet", data / "blobs.parquet"
    pq.write_table(pa.table({"text": [f"a fact {i}" for i in range(20)]}), warm)
    write_blobs(attack, 20)
    env = {"ENGRAM_DATASET_ROOTS": str(data), "ENGRAM_MAX_RECORD_BYTES": str(RECORD_BYTES), "ENGRAM_MAX_LENGTH": "32"}
    with in_process_server(tmp_path / "server", tmp_path / "models", **env) as server:
        api = server.client
        register_model(api, "costs/chat", f"file://{tmp_path / 'models' / 'chat'}")
        # A good Parquet collection first: the job process has imported pyarrow and loaded the model.
        response = api.post(
            "/concepts", json={"name": "warm", "models": ["costs/chat"], "dataset": {"uri": f"file://{warm}"}}
        )
        assert wait_for_job(api, response.json()["jobs"][0]["job_id"], timeout=600)["status"] == "succeeded"
        job_process = job_process_of_this_test()
        before, stored = peak_rss_bytes(job_process), stored_datasets(server.storage_dir)
        api_before = peak_rss_bytes(os.getpid())  # the API never opens a reference: it only checks its shape
        uri = f"file://{attack}"
        response = api.post("/concepts", json={"name": "blobs", "models": ["costs/chat"], "dataset": {"uri": uri}})
        assert response.status_code == 202, response.text
        job = wait_for_job(api, response.json()["jobs"][0]["job_id"], timeout=600)
        grew = peak_rss_bytes(job_process) - before
        print(f"\nthe job process's peak grew {grew} B reading the attack")  # noqa: T201
        assert job["status"] == "failed", job
        assert_named(job["error"]["detail"], uri)
        assert job["error"]["status"] == 413, job
        assert api.get("/concepts/blobs").json()["dataset"]["error"] == job["error"]["detail"]
        assert grew < JOB_GROWTH_BOUND, grew
        assert peak_rss_bytes(os.getpid()) - api_before < JOB_GROWTH_BOUND
        assert stored_datasets(server.storage_dir) == stored  # no dataset, not even a part of one
