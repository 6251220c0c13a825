"""A dataset reference's row range as checked at submission (``check_reference``): stored as ``start``
always and ``stop`` when given, left out when it selects every row, and a range longer than
ENGRAM_MAX_RECORDS refused by name before anything is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.config import Settings
from service.datasets.refs import check_reference
from service.errors import PayloadTooLarge

MAX_RECORDS = 10


def checked(tmp_path: Path, rows: dict[str, Any] | None) -> dict[str, Any]:
    file = tmp_path / "facts.jsonl"
    file.write_text('{"text": "a"}\n')
    settings = Settings(dataset_roots=str(tmp_path), max_records=MAX_RECORDS)
    raw: dict[str, Any] = {"uri": f"file://{file}", **({"rows": rows} if rows is not None else {})}
    return check_reference(raw, settings)


@pytest.mark.parametrize(
    ("rows", "stored"),
    [
        (None, None),
        ({"start": 0}, None),
        ({"start": 0, "stop": None}, None),
        ({"start": 3}, {"start": 3}),
        ({"stop": 5}, {"start": 0, "stop": 5}),
        ({"start": 3, "stop": 3 + MAX_RECORDS}, {"start": 3, "stop": 3 + MAX_RECORDS}),
    ],
)
def test_a_row_range_is_stored_in_one_form(tmp_path: Path, rows: dict[str, Any] | None, stored: Any) -> None:
    reference = checked(tmp_path, rows)
    assert reference.get("rows") == stored
    assert ("rows" in reference) == (stored is not None), "a range of every row is left out, not stored empty"


def test_a_range_longer_than_max_records_is_413_naming_the_setting(tmp_path: Path) -> None:
    named = rf"selects {MAX_RECORDS + 1} rows, more than {MAX_RECORDS} .*ENGRAM_MAX_RECORDS"
    with pytest.raises(PayloadTooLarge, match=named):
        checked(tmp_path, {"start": 2, "stop": 3 + MAX_RECORDS})
