"""One ready variant for the evaluation, generation and map tests of the client and the CLI.

Built once per session with the Python client on a model of its own (``cli2-tiny``, the session's
tiny Llama again) with concepts ``cli2-forget`` (target) and ``cli2-retain`` (reference), so those
tests neither wait for nor disturb the other modules' flows on the shared server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from engram_client import EngramClient
from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer

CLI2_MODEL = "cli2-tiny"
_FACTS = make_facts(20, seed=23)


@dataclass(frozen=True)
class ReadyVariant:
    """``cli2-forget`` unlearned from ``cli2-tiny`` (α = 1), with the probes both concepts were made of."""

    url: str
    model: str
    variant_id: str
    forget: list[dict[str, str]]
    retain: list[dict[str, str]]
    forget_jsonl: Path
    retain_jsonl: Path


def _jsonl(path: Path, records: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="session")
def cli2(live_server: LiveServer, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ReadyVariant:
    forget = [{"prompt": p, "completion": c} for p, c in _FACTS[:10]]
    retain = [{"prompt": p, "completion": c} for p, c in _FACTS[10:]]
    with EngramClient(live_server.base_url) as engram:
        engram.register_model(CLI2_MODEL, f"file://{tiny_llama_dir}")
        jobs = [
            engram.add_concept(name, [CLI2_MODEL], records=records, role=role).jobs[0].job_id
            for name, records, role in (("cli2-forget", forget, "target"), ("cli2-retain", retain, "reference"))
        ]
        assert {job.status for job in engram.wait_for_jobs(jobs, poll_s=0.1)} == {"succeeded"}
        submission = engram.unlearn(CLI2_MODEL, ["cli2-forget"], alpha=1.0)
        variant = engram.wait_for_variant(submission.variant.variant_id, poll_s=0.1)
    data = tmp_path_factory.mktemp("cli2-probes")
    return ReadyVariant(
        live_server.base_url,
        CLI2_MODEL,
        variant.variant_id,
        forget,
        retain,
        _jsonl(data / "forget.jsonl", forget),
        _jsonl(data / "retain.jsonl", retain),
    )
