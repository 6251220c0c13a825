"""Records are cut to a character budget before tokenizing (service/engine/record_budget.py).

The budget must change nothing a collection sees: a record within it encodes exactly as without it
(ids, counted positions, the truncation count); a longer one keeps the same tokens and reports the
tokens cut within a token per counted piece. And it must bound memory: a 4 MB record encodes in a
few MB of tokenizer memory instead of the ~270 bytes a character a whole-text encoding holds.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from engram_fixtures.live import REPO_ROOT
from engram_fixtures.models import CHAT_TEMPLATE, make_tokenizer
from service.engine.messages import Message
from service.engine.record_budget import PIECE_CHARS, char_budget
from service.engine.records import Record, encode_record

MAX_LENGTH = 32
WORDS = "the cat sat on a warm mat while Zürich slept and ℵ₀ counted sheep quietly".split()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def records(n_words: int, seed: int) -> list[Record]:
    """One record of each kind whose texts hold about ``n_words`` words each."""
    a, b = words(n_words, seed), words(n_words, seed + 1)
    chat = (Message("system", "be brief"), Message("user", a), Message("assistant", b), Message("user", "and?"))
    return [
        Record(text=a),
        Record(prompt=a, completion=b),
        Record(messages=(*chat, Message("assistant", words(n_words, seed + 2)))),
    ]


def render(tokenizer: Any, record: Record) -> str:
    text: str = tokenizer.apply_chat_template([m.as_dict() for m in record.as_chat()], tokenize=False)
    return text


@pytest.mark.parametrize("n_words", [1, 3, 6, 12, 25])
def test_a_record_within_the_budget_encodes_exactly_as_without_it(tokenizer: Any, n_words: int) -> None:
    budget = char_budget(tokenizer, MAX_LENGTH)
    for seed in range(6):
        for record in records(n_words, seed):
            texts = [record.text, record.prompt, record.completion, *(m.content for m in record.messages or ())]
            assert max(len(t) for t in texts if t) <= budget
            unbounded = encode_record(tokenizer, record, MAX_LENGTH)
            bounded = encode_record(tokenizer, record, MAX_LENGTH, budget=budget)
            if record.messages is not None and len(render(tokenizer, record)) > budget:
                # Short turns, a long conversation: its render is cut, the statistics are not.
                assert (bounded.input_ids, bounded.counted) == (unbounded.input_ids, unbounded.counted)
                assert abs(bounded.cut - unbounded.cut) <= 1
                continue
            assert bounded == unbounded
            for template in (None, "chat") if record.messages is None and record.text is None else (None,):
                assert encode_record(tokenizer, record, MAX_LENGTH, template, budget=budget) == encode_record(
                    tokenizer, record, MAX_LENGTH, template
                )
    # Some of these records reach past max_length: the truncation count is part of what is equal.
    assert encode_record(tokenizer, records(25, 0)[0], MAX_LENGTH).cut > 0


@pytest.mark.parametrize("n_words", [200, 3000, 40_000])
def test_a_record_beyond_the_budget_keeps_the_same_tokens_and_counts_the_cut(tokenizer: Any, n_words: int) -> None:
    budget = char_budget(tokenizer, MAX_LENGTH)
    for record in records(n_words, 7):
        bounded = encode_record(tokenizer, record, MAX_LENGTH, budget=budget)
        unbounded = encode_record(tokenizer, record, MAX_LENGTH)
        assert bounded.input_ids == unbounded.input_ids
        assert bounded.counted == unbounded.counted
        # Counted piece by piece beyond the budget: within one token a piece (a word split between two).
        pieces = 3 + 3 * (len(words(n_words, 7)) // max(budget, PIECE_CHARS) + 1)
        assert abs(bounded.cut - unbounded.cut) <= pieces, (bounded.cut, unbounded.cut)


def test_a_huge_record_encodes_in_bounded_memory() -> None:
    """A 4 MB record in a fresh process: the peak RSS grows by a few MB (whole, it would be ~1 GB)."""
    script = textwrap.dedent(
        """
        import json, resource, sys
        from service.engine.record_budget import char_budget
        from service.engine.records import Record, encode_record
        from engram_fixtures.models import make_tokenizer
        tok = make_tokenizer()
        text = ("the cat sat on a warm mat while Zürich slept " * 90_000)[:4_000_000]
        encode_record(tok, Record(text="warm up"), 512, budget=char_budget(tok, 512))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        example = encode_record(tok, Record(text=text), 512, budget=char_budget(tok, 512))
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"grew_kb": after - before, "kept": len(example.input_ids), "cut": example.cut}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"4 MB record: peak RSS grew by {figures['grew_kb'] / 1024:.1f} MB; {figures['kept']} kept, {figures['cut']} cut")  # noqa: T201
    assert figures["kept"] == 512
    assert figures["cut"] > 500_000  # ~4 characters a token in this text: the cut is counted, not guessed
    assert figures["grew_kb"] < 64 * 1024
