"""Mini-TOFU in chat format: a tiny Llama with a chat template memorised 200 facts as one-turn chats.

Through the live API (embedded mode) the forget and retain sets are posted as ``{"messages"}``
records (only the assistant turns are counted: the answer and its end-of-turn token, as ai-engram's
TOFU benchmark counts them), the 10% forget set is unlearned at the paper's uniform TOFU strength
(α=0.6, the universe forget ∪ retain), and the service's own evaluation scores the variant on
messages probes (the assistant turn's answer NLL and greedy exact match).

The done-when, as bars: the forget answers' NLL rises 10× or more; the retain set moves far less:
its NLL rises at most a third as much (as a ratio), it keeps 70% or more greedy exact match, and it
loses at most half the exact match the forget set loses (which must fall to 50% or less).
Measured (seed 0): forget ×81 (exact match 1.0 → 0.20), retain ×16 (1.0 → 0.81). At α=1 the same
model gives forget ×363 / retain ×91 (retain exact match 0.17), and the plain demo ×593 / ×77 (0.41):
α=1 uniform is harsh on this 256-wide model in either format, not a chat effect (the retain damage
sits in block 0, whose inputs are context-free token embeddings that the forget and retain answers,
made from one syllable inventory, share: 54 of the forget answers' 58 token types).

Run ``pytest tests/e2e/test_chat_tofu.py -s`` to see the figures.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engram_fixtures.live import LiveServer, running_server, wait_concepts_ready, wait_for_job, wait_variant_ready
from tests.helpers.api import register_model

pytestmark = pytest.mark.slow
MODEL_ID = "demo/chat-tofu"
ALPHA = 0.6  # the paper's uniform TOFU strength (its TOFU table; ai-engram benchmarks.tofu DEFAULT_ALPHA["plain"])


@pytest.fixture(scope="module")
def chat_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chat demo (trained on the facts rendered with its chat template); the model root holding it."""
    from engram_fixtures.cache import copy_entry
    from engram_fixtures.demo import chat_tofu

    root = tmp_path_factory.mktemp("chat-tofu")
    copy_entry(chat_tofu(), root / "demo")  # trained once per fixture cache (200 facts, seed 0, one thread)
    return root


@pytest.fixture(scope="module")
def server(chat_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tmp_path_factory.mktemp("chat-tofu-server"), chat_demo) as live:
        yield live


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_chat_mini_tofu_forgets_its_forget_set(chat_demo: Path, server: LiveServer) -> None:
    api = server.client
    demo = chat_demo / "demo"
    forget, retain = records(demo / "forget.jsonl"), records(demo / "retain.jsonl")
    assert all(list(r) == ["messages"] for r in forget + retain)
    source = f"file://{demo / 'model'}"
    register_model(api, MODEL_ID, source)
    for name, role, data in (("chat-forget", "target", forget), ("chat-retain", "reference", retain)):
        response = api.post("/concepts", json={"name": name, "role": role, "models": [MODEL_ID], "records": data})
        assert response.status_code == 202, response.text
    concepts = wait_concepts_ready(api, ["chat-forget", "chat-retain"], MODEL_ID, timeout=300)
    # Each one-turn chat counts its answer and the EOS that closes the turn.
    assert concepts["chat-forget"]["models"][MODEL_ID]["tokens"] > len(forget)
    submitted = api.post(f"/models/{MODEL_ID}/unlearn", json={"concepts": ["chat-forget"], "alpha": ALPHA})
    assert submitted.status_code == 202, submitted.text
    variant = wait_variant_ready(api, submitted.json()["variant"]["variant_id"], timeout=300)

    response = api.post(f"/variants/{variant['variant_id']}/evaluate", json={"forget": forget, "retain": retain})
    assert response.status_code == 202, response.text
    job = wait_for_job(api, response.json()["job_id"], timeout=600)
    assert job["status"] == "succeeded", job
    figures = job["result"]["summary"]
    print("\nchat mini-TOFU figures:\n" + json.dumps(figures, indent=1))  # noqa: T201 - the note's figures
    before, after = figures["base"], figures["variant"]
    assert before["forget"]["exact_match"] >= 0.9 and before["retain"]["exact_match"] >= 0.9, "not memorised"
    forget_rise = after["forget"]["mean_nll"] / before["forget"]["mean_nll"]
    retain_rise = after["retain"]["mean_nll"] / before["retain"]["mean_nll"]
    assert forget_rise >= 10.0, figures  # forgets: answer NLL x10 or more
    # ... while the retain set moves far less, in likelihood and in what greedy decoding answers.
    assert retain_rise <= forget_rise / 3.0, figures
    forget_lost = before["forget"]["exact_match"] - after["forget"]["exact_match"]
    retain_lost = before["retain"]["exact_match"] - after["retain"]["exact_match"]
    assert after["forget"]["exact_match"] <= 0.5, figures
    assert after["retain"]["exact_match"] >= 0.7, figures
    assert retain_lost <= 0.5 * forget_lost, figures
