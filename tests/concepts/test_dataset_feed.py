"""Dataset bytes to records, below the HTTP layer: gzip inflation, what is not JSON Lines, truncation.

:class:`~service.datasets.spool.JsonlFeed` gets an upload's or a reference's bytes in chunks of any size;
gzip-compressed bytes must give exactly the records of the plain bytes whatever the chunking, with
no more than :data:`~service.datasets.spool.INFLATE_PIECE` bytes inflated at once. Truncation at
``max_length`` is counted per record (:class:`~service.concepts.collected.Survey`) for every kind
of record, chat included.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import pytest

from engram_fixtures.models import CHAT_TEMPLATE, make_tokenizer
from service.concepts.collected import Survey
from service.datasets.spool import INFLATE_PIECE, DatasetSpool, Gunzip, JsonlFeed, SpooledDataset
from service.engine.records import Record, encode_record
from service.errors import InvalidInput, MalformedBody, PayloadTooLarge

RECORDS = [{"text": f"record {i} 😀"} for i in range(50)] + [{"prompt": "Q?", "completion": " A"}]
PLAIN = b"\xef\xbb\xbf" + "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in RECORDS).encode()


def spooled(tmp_path: Path, data: bytes, chunk: int, max_bytes: int | None = None) -> SpooledDataset:
    with DatasetSpool(tmp_path / "dataset.jsonl", max_records=1000) as spool:
        feed = JsonlFeed(spool, max_bytes=max_bytes, limit_name="THE_LIMIT")
        for start in range(0, len(data), chunk):
            feed.feed(data[start : start + chunk])
        return feed.finish()


@pytest.mark.parametrize("chunk", [1, 2, 3, 17, 1 << 20])
def test_gzip_gives_the_records_of_the_plain_bytes_whatever_the_chunking(tmp_path: Path, chunk: int) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "gz").mkdir()
    plain = spooled(tmp_path / "plain", PLAIN, chunk)
    two_members = gzip.compress(PLAIN[:100]) + gzip.compress(PLAIN[100:])
    packed = spooled(tmp_path / "gz", two_members, chunk)
    assert (packed.digest, packed.num_records) == (plain.digest, len(RECORDS))


def test_a_one_byte_dataset_is_plain_not_a_gzip_prefix(tmp_path: Path) -> None:
    with pytest.raises(MalformedBody, match="line 1 is not valid JSON"):
        spooled(tmp_path, b"x", chunk=1)
    with pytest.raises(InvalidInput, match="no records"):
        spooled(tmp_path, b"\n", chunk=1)


def test_inflation_is_bounded_per_piece_and_drains_what_zlib_holds() -> None:
    # Highly compressible: each input chunk inflates to many pieces, the last ones held inside zlib.
    data = os.urandom(1000) * (5 * INFLATE_PIECE // 1000) + b"end"
    packed = gzip.compress(data, compresslevel=9)
    gunzip = Gunzip(None, "THE_LIMIT")
    pieces = [piece for start in range(0, len(packed), 4096) for piece in gunzip.feed(packed[start : start + 4096])]
    gunzip.finish()
    assert max(len(p) for p in pieces) <= INFLATE_PIECE
    assert b"".join(pieces) == data


def test_a_gzip_bomb_stops_at_the_limit_it_names(tmp_path: Path) -> None:
    line = (json.dumps({"text": "a " * 500}) + "\n").encode()
    bomb = gzip.compress(line * 20_000)
    with pytest.raises(PayloadTooLarge, match="THE_LIMIT"):
        spooled(tmp_path, bomb, chunk=len(bomb), max_bytes=len(line) * 100)


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        (gzip.compress(PLAIN)[:-8], MalformedBody, "ends before its gzip stream"),
        (b"\x1f\x8b\x08\x00not deflate at all", MalformedBody, "not valid gzip"),
        (b'[\n  {"text": "a"}\n]\n', InvalidInput, "JSON array"),
        (b'   [{"text": "a"}]', InvalidInput, "JSON array"),
        (b"\n\nPAR1\x00\x00", InvalidInput, "Parquet"),
        (b"BZh91AY&SY", InvalidInput, "bzip2"),
        (b"text,label\nhello,1\n", MalformedBody, "line 1 is not valid JSON.*JSON Lines"),
        (b'{"text": "a"}\nnot json\n', MalformedBody, r"line 2 is not valid JSON: Expecting value \(column 1\)$"),
    ],
)
def test_what_is_not_json_lines_is_named(tmp_path: Path, data: bytes, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        spooled(tmp_path, data, chunk=5)


# ---------------------------------------------------------------- truncation, counted per record


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_every_kind_of_record_says_how_many_tokens_max_length_cut(tokenizer: Any) -> None:
    long = " ".join(f"word{i}" for i in range(60))
    whole = len(tokenizer(long)["input_ids"])
    limit = 16
    text = encode_record(tokenizer, Record(text=long), limit)
    assert (len(text.input_ids), text.cut) == (limit, whole - limit)
    assert encode_record(tokenizer, Record(text="short"), limit).cut == 0
    exact = tokenizer.decode(tokenizer(long, add_special_tokens=False)["input_ids"][: limit - 1])
    assert encode_record(tokenizer, Record(text=exact), limit).cut == 0  # at the limit, nothing cut
    pair = encode_record(tokenizer, Record(prompt=long, completion=" yes"), limit)
    assert pair.cut > 0 and not any(pair.counted)
    chat = Record.from_mapping({"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "ok"}]}, 0)
    example = encode_record(tokenizer, chat, limit)
    assert len(example.input_ids) == limit and example.cut > 0 and not any(example.counted)


def test_the_survey_lists_truncated_and_uncounted_records(tokenizer: Any) -> None:
    long = " ".join(f"word{i}" for i in range(60))
    records = [Record(text="short"), Record(text=long), Record(prompt=long, completion=" yes"), Record(text="b")]
    survey = Survey.of((encode_record(tokenizer, r, 16) for r in records), 16)
    report = survey.report()
    assert report["records"] == 4
    assert report["truncated"]["records"] == 2 and report["truncated"]["first"] == [1, 2]
    assert report["uncounted"] == {"records": 1, "first": [2]}
    nothing = Survey.of([encode_record(tokenizer, Record(prompt=long, completion=" yes"), 16)], 16)
    assert nothing.tokens == 0 and "ENGRAM_MAX_LENGTH" in nothing.nothing_counted()
