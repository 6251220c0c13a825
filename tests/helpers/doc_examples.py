"""The examples of the README and docs/ as data: fenced blocks, what each one is, and how to run it.

Every fenced block of a page is an :class:`Example`. The tests under ``tests/docs/`` pick the ones
they run by kind (:func:`kind_of`): shell walk-throughs, Python, JSON bodies, JSONL records. A block
that no test can run as written (it needs Docker, a cluster, the hub, a GPU; or it shows an output)
says so in the page itself, on the line before its fence:

    <!-- not run: needs Docker -->

The marker is read here and counted by ``tests/docs/test_doc_inventory.py``: an unmarked block of a
kind nothing runs fails there, so no example is skipped without a reason a reader can see.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
GENERATED = {"API.md", "settings.md"}  # written by scripts/gen_*_docs.py, checked by their own tests
# The pages tests/docs/test_docs_walkthrough.py runs, in its order: the tutorial, then the how-tos that
# continue it in its folder. Their shell and Python blocks run there; other pages' must be marked.
WALKTHROUGH_PAGES = [DOCS / page for page in ("tutorial.md", "how-to/outputs.md", "how-to/evaluate-and-calibrate.md")]
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", flags=re.S | re.M)
MARKER = re.compile(r"<!--\s*(?P<name>not run|body of|output of):\s*(?P<value>.+?)\s*-->\s*\Z", flags=re.S)

SHELL = "shell"
PYTHON = "python"
JSON_BODY = "json"
JSONL = "jsonl"
OUTPUT = "output"
NOT_RUN_KIND = "not run"
KINDS = (SHELL, PYTHON, JSON_BODY, JSONL, OUTPUT, NOT_RUN_KIND)
LANGUAGE_KINDS = {"bash": SHELL, "sh": SHELL, "console": SHELL, "python": PYTHON, "json": JSON_BODY, "jsonl": JSONL}


@dataclass(frozen=True)
class Example:
    """One fenced block: where it is, its language, its text, and the reason it is not run, if any."""

    page: Path
    line: int  # 1-based line of the opening fence, as an editor counts
    language: str
    code: str
    not_run: str | None  # <!-- not run: REASON -->
    body_of: str | None = None  # <!-- body of: POST /route --> before a ```json request body
    output_of: str | None = None  # <!-- output of: WHAT --> before a block a test compares with what ran

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def kind(self) -> str:
        return kind_of(self)


def kind_of(example: Example) -> str:
    """What runs the block: a marked block is never run; otherwise its fence's language decides."""
    if example.not_run is not None:
        return NOT_RUN_KIND
    if example.output_of is not None:
        return OUTPUT
    return LANGUAGE_KINDS.get(example.language, f"unknown language {example.language!r}")


def doc_pages() -> list[Path]:
    """Every hand-written page of docs/ (the generated references are left to their own tests)."""
    return [page for page in sorted(DOCS.rglob("*.md")) if page.name not in GENERATED or page.parent != DOCS]


def examples(page: Path) -> list[Example]:
    """The page's fenced blocks, in order, each with the ``<!-- not run: … -->`` marker before it."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n")
        marker = MARKER.search(before.rsplit("\n", 1)[-1])
        said = {marker.group("name"): marker.group("value")} if marker else {}
        found.append(
            Example(
                page=page,
                line=text.count("\n", 0, match.start()) + 1,
                language=match.group(1).lower(),
                code=match.group(2),
                not_run=said.get("not run"),
                body_of=said.get("body of"),
                output_of=said.get("output of"),
            )
        )
    return found


def all_examples() -> list[Example]:
    return [example for page in doc_pages() for example in examples(page)]


def of_kind(kind: str, pages: list[Path] | None = None) -> list[Example]:
    return [e for page in pages or doc_pages() for e in examples(page) if e.kind == kind]


def shell_blocks(pages: list[Path] | None = None) -> list[Example]:
    """Every shell block, run or not: the request bodies of a block marked not run are checked too."""
    return [e for page in pages or doc_pages() for e in examples(page) if LANGUAGE_KINDS.get(e.language) == SHELL]


# ---------------------------------------------------------------- shell walk-throughs


def shell_script(blocks: list[Example], skip: tuple[str, ...] = ()) -> str:
    """The blocks' lines as one script, in order, without the lines starting with one of ``skip``."""
    lines = [line for block in blocks for line in block.code.splitlines()]
    return "\n".join(line for line in lines if not line.lstrip().startswith(skip)) if skip else "\n".join(lines)


# ---------------------------------------------------------------- request bodies in curl commands


@dataclass(frozen=True)
class CurlRequest:
    """A ``curl -X POST … -d '<json>'`` of a shell example: its route and its JSON body."""

    example: Example
    method: str
    path: str
    body: Any


URL = re.compile(r"^(?:\$BASE|\$\{BASE\}|\$ENGRAM_URL|https?://[\w.:-]+)(?P<path>/[^?#]*)")
DATA_FLAGS = ("-d", "--data", "--data-raw", "--json")
# The walk-throughs' ``api`` (README, tutorial) is curl that stops on an error answer: its arguments are curl's.
CURL_COMMANDS = ("curl", "api")


def shell_words(code: str) -> list[str]:
    """The code's words as the shell reads them (quotes removed, comments dropped), operators apart."""
    lexer = shlex.shlex(code.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def curl_requests(example: Example) -> Iterator[CurlRequest]:
    """Every curl of a shell example that sends a JSON body: its method, path and parsed body.

    ``$PWD`` in a body stands for a folder (the shell would expand it before curl sends it).
    """
    words = shell_words(example.code)
    starts = [i for i, word in enumerate(words) if word in CURL_COMMANDS]
    for start in starts:
        args: list[str] = []
        for word in words[start + 1 :]:
            if word in CURL_COMMANDS or (word and all(c in "();<>|&" for c in word)):
                break
            args.append(word)
        url = next((m for m in map(URL.match, args) if m), None)
        bodies = [args[i + 1] for i, word in enumerate(args[:-1]) if word in DATA_FLAGS]
        if url is None or not bodies:
            continue
        method = args[args.index("-X") + 1] if "-X" in args else "POST"
        yield CurlRequest(example, method, url.group("path"), json.loads(bodies[0].replace("$PWD", "/work")))


def request_model(method: str, path: str) -> type[BaseModel] | None:
    """The api_schemas model of the route's JSON body, read from the routers themselves."""
    from fastapi.routing import APIRoute

    from api_schemas.concepts import ConceptCreate
    from service.api.routes import calibration, concepts, evaluation, jobs, maps, models, ops, universes, variants

    # The API's own order (service/api/app.py): the {model_id:path} routes of models come late.
    for module in (maps, universes, calibration, models, concepts, jobs, variants, evaluation, ops):
        for route in module.router.routes:
            if not isinstance(route, APIRoute) or method not in (route.methods or ()) or not route.path_regex.match(path):
                continue
            if route.path == "/concepts":  # reads JSON or multipart itself; the JSON body is a ConceptCreate
                return ConceptCreate
            if route.body_field is None:
                return None
            model = route.body_field.field_info.annotation
            assert isinstance(model, type) and issubclass(model, BaseModel), route.path
            return model
    return None
