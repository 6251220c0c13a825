"""Every example in docs/ is run by a test, or says on the page why it is not.

The tests of tests/docs/ pick blocks by kind (tests/helpers/doc_examples.py): shell and Python
blocks of the walk-through pages run against a live server (test_docs_walkthrough.py), request
bodies and JSONL records are checked by the service's own models and readers (test_doc_bodies.py),
and an output block is compared with what its command printed. A block of any other page, or of a
language nothing runs, must carry ``<!-- not run: REASON -->``: this module fails on one that does
not, and prints the count of each kind, so a skipped example is visible in the page and in CI.
"""

from __future__ import annotations

from collections import Counter

from tests.helpers.doc_examples import (
    JSON_BODY,
    JSONL,
    KINDS,
    NOT_RUN_KIND,
    OUTPUT,
    PYTHON,
    SHELL,
    WALKTHROUGH_PAGES,
    all_examples,
)

# Checked wherever they are (test_doc_bodies.py), or compared by the walk-through (an output block).
CHECKED_ANYWHERE = {JSON_BODY, JSONL}


def test_every_example_is_run_or_says_why_not() -> None:
    unaccounted = []
    for example in all_examples():
        if example.kind in CHECKED_ANYWHERE or example.kind == NOT_RUN_KIND and example.not_run:
            continue
        if example.kind in (SHELL, PYTHON, OUTPUT) and example.page in WALKTHROUGH_PAGES:
            continue
        unaccounted.append(f"{example.where} ({example.kind})")
    assert not unaccounted, (
        "these examples are run by no test: run them (a walk-through page, a json/jsonl block) or mark "
        "them <!-- not run: REASON --> on the line before the fence:\n" + "\n".join(unaccounted)
    )


def test_the_count_of_each_kind() -> None:
    """Printed with ``-s`` (and in CI's log): how many examples each kind has, and every reason."""
    counts = Counter(example.kind for example in all_examples())
    assert set(counts) <= set(KINDS), counts
    reasons = [f"  {e.where}: {e.not_run}" for e in all_examples() if e.kind == NOT_RUN_KIND]
    print("\ndocs examples:", dict(counts), "\nnot run:\n" + "\n".join(reasons))  # noqa: T201 - the count, with -s
    assert counts[SHELL] > 0 and counts[PYTHON] > 0 and counts[JSONL] > 0
    # Not run is the exception: if most examples were marked, the docs would not be tested.
    assert counts[NOT_RUN_KIND] * 3 < sum(counts.values()), counts


def test_a_marker_is_read_from_the_line_before_the_fence(tmp_path: object) -> None:
    from pathlib import Path

    from tests.helpers.doc_examples import examples

    assert isinstance(tmp_path, Path)
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- not run: needs Docker -->\n```bash\ndocker compose up\n```\n\n"
        "<!-- not run: far above -->\n\nprose\n```python\nprint(1)\n```\n"
    )
    first, second = examples(page)
    assert (first.kind, first.not_run, first.line) == (NOT_RUN_KIND, "needs Docker", 4)
    assert (second.kind, second.not_run) == (PYTHON, None), "a marker applies to the fence right after it only"
