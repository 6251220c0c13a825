"""``engram evaluate --forget FILE``: a probe the service refuses is named by its file and 1-based line.

The service's 422 names a probe by its place in the request (``body.forget.3``, 0-based); the CLI
read the probes from a file, so it says ``forget.jsonl line 5`` as its own checks and concept uploads
do (blank lines are not records: a file with one counts lines, not records). The request runs against
the session's real server: the body is refused before any variant is looked up, so none is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

from engram_client.cli.evaluation import named_by_line
from engram_fixtures.live import LiveServer
from tests.helpers.cli import failed, run_cli, says

GOOD = {"prompt": "Q: What is the favourite colour of Kymthai Kudal? A:", "completion": " voukrur"}
EMPTY_COMPLETION = {"prompt": "Q: Where was Brasmym Fivear born? A:", "completion": ""}


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_refused_probe_is_named_by_its_file_and_line(live_server: LiveServer, tmp_path: Path) -> None:
    # Records 0, 1, 2, then a blank line, then record 3 (the bad one) on line 5 of the file.
    good = json.dumps(GOOD)
    forget = write_jsonl(tmp_path / "forget.jsonl", [good, good, good, "", json.dumps(EMPTY_COMPLETION)])
    retain = write_jsonl(tmp_path / "retain.jsonl", [good])
    result = run_cli(live_server.base_url, "evaluate", "0" * 16, "--forget", forget, "--retain", retain)
    stderr = failed(result, "422")
    # The place inside the record stays the service's (completion, and which of its accepted types).
    assert says(stderr, f"{forget} line 5 (completion"), stderr
    assert not says(stderr, "body.forget.3"), stderr


def test_places_are_named_by_the_line_of_the_record_in_the_file_they_came_from(tmp_path: Path) -> None:
    forget = write_jsonl(tmp_path / "f.jsonl", ["{}", "", "  ", "{}"])  # records on lines 1 and 4
    retain = write_jsonl(tmp_path / "r.jsonl", ["{}"])
    files = {"forget": forget, "retain": retain}
    assert named_by_line("body.forget.1.completion: too short", files) == f"{forget} line 4 (completion): too short"
    union = named_by_line("body.forget.1.completion.constrained-str: x", files)
    assert union == f"{forget} line 4 (completion.constrained-str): x"
    assert named_by_line("body.retain.0: bad; body.forget.0", files) == f"{retain} line 1: bad; {forget} line 1"
    # Not a record of a file sent (no such record, or a field the CLI did not read from a file): left as is.
    assert named_by_line("body.forget.2.prompt: x", files) == "body.forget.2.prompt: x"
    assert named_by_line("body.utility.qa.0: x", files) == "body.utility.qa.0: x"
