"""Records cut to a character budget before they are tokenized, so no record can exhaust memory.

A fast tokenizer holds ~270 bytes per input character while it encodes (ids, offsets, words, the
normalized string): one 30 MB record took a collection past 8 GB, although ``max_length`` keeps only
its first few hundred tokens. So every text is cut to a budget of characters before it is tokenized,
a budget large enough that the cut cannot change which tokens are kept:

    budget = (max_length + 1) × L,  L = the longest entry of the tokenizer's vocabulary, in characters

Why the cut changes nothing the statistics see. A record no longer than the budget is not cut:
it is tokenized exactly as before. A longer one: no token stands for more than ``L`` characters of
the text (a byte-level BPE entry is one character per byte; a SentencePiece or WordPiece entry
spells its characters, ``▁`` or ``##`` included), so the first ``max_length`` tokens cover at most
``max_length × L`` characters and lie wholly inside the budget: the record is truncated either
way, and the kept tokens are those of the cut text. (A tokenizer whose normalizer deletes or folds
long runs of input, such as whitespace collapsing, can read more than ``L`` characters a token; such
a record is still reported truncated, never silently shortened.)

The tokens beyond the budget are not kept, only counted for the truncation report, piece by piece
(:func:`count_tokens`: pieces of at least 64 Ki characters, ended before a whitespace, so memory
stays bounded; the count may differ from the whole text's by a token or two a piece).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: a tokenizer is loaded by the caller
    from transformers import PreTrainedTokenizerBase


def char_budget(tokenizer: PreTrainedTokenizerBase, max_length: int) -> int:
    """The characters of a text that are tokenized, for ``max_length`` kept tokens (see the module)."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return (max_length + 1) * max(longest, 1)


def cut(text: str, budget: int | None) -> tuple[str, str]:
    """``text`` as ``(head, rest)``: its first ``budget`` characters and the others (``None``: no cut)."""
    if budget is None or len(text) <= budget:
        return text, ""
    return text[:budget], text[budget:]


PIECE_CHARS = 1 << 16  # the smallest piece a long text is counted in (~20 MB of tokenizer memory)


def count_tokens(tokenizer: PreTrainedTokenizerBase, text: str, budget: int, *, special: bool = False) -> int:
    """The tokens of ``text``, tokenized a piece at a time so that memory stays bounded: pieces of
    ``max(budget, PIECE_CHARS)`` characters, each ended before a whitespace where its second half
    has one (a word is rarely split). A text of one piece is counted exactly.

    Args:
        special: count the special tokens the tokenizer adds (to the first piece).
    """
    piece = max(budget, PIECE_CHARS)
    total, start = 0, 0
    while start < len(text):
        stop = _piece_end(text, start, piece)
        total += len(tokenizer(text[start:stop], add_special_tokens=special and start == 0)["input_ids"])
        start = stop
    return total


def _piece_end(text: str, start: int, piece: int) -> int:
    stop = start + piece
    if stop >= len(text):
        return len(text)
    space = max(text.rfind(" ", stop - piece // 2, stop), text.rfind("\n", stop - piece // 2, stop))
    return space if space > start else stop
