"""Long texts for the probe-bound tests, and a tokenizer that records what it was asked to read."""

from __future__ import annotations

import random
from typing import Any

# Words of one, two and three bytes per character, so a character budget is not a byte budget.
WORDS = "the cat sat on a warm mat while Zürich slept and ℵ₀ counted sheep quietly".split()


def words(chars: int, seed: int = 0) -> str:
    """``chars`` characters of seeded random ``WORDS`` (the same text for the same seed)."""
    rng = random.Random(seed)
    text = ""
    while len(text) < chars:
        text += rng.choice(WORDS) + " "
    return text[:chars]


class CountingTokenizer:
    """The tokenizer, recording the longest text it was asked to tokenize (what it costs in memory)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.longest = inner, 0

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.longest = max(self.longest, len(text))
        return self.inner(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
