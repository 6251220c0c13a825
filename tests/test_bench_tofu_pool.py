"""bench.tofu's pooled answers (``--answer-pool``): the demo's questions with answers shared across people.

Checked against the demo's facts directly: the questions and their order are make_facts', every
answer is one of the first ``pool`` answers of its attribute, and so every forget answer is also
some retain fact's answer (what lets a retain model score it as TOFU's does, not as unseen tokens).
"""

from __future__ import annotations

import pytest

from bench.tofu import pooled_facts
from engram_fixtures.demo import make_facts, split_forget

pytestmark = pytest.mark.fast


def _attribute(prompt: str) -> str:
    """The demo's four question forms, by a word only that form has."""
    return next(word for word in ("born", "colour", "work as", "pet") if word in prompt)


def test_pooled_answers_keep_the_questions_and_share_answers_across_people() -> None:
    demo, pooled = make_facts(100, 3), pooled_facts(100, 3, 4)
    assert [p for p, _ in pooled] == [p for p, _ in demo]
    allowed: dict[str, list[str]] = {}
    for prompt, answer in demo:  # the first four answers of each attribute, in the facts' order
        if len(allowed.setdefault(_attribute(prompt), [])) < 4:
            allowed[_attribute(prompt)].append(answer)
    assert sorted(allowed) == ["born", "colour", "pet", "work as"]
    for prompt, answer in pooled:
        assert answer in allowed[_attribute(prompt)]
    forget, retain = split_forget(pooled, 0.1, 3)
    assert {a for _, a in forget} <= {a for _, a in retain}
    assert pooled_facts(100, 3, None) == demo  # no pool: the demo's facts


def test_a_pool_of_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        pooled_facts(20, 0, 1)
