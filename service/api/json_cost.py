"""What a JSON body will cost once decoded, counted from its bytes before anything parses it.

The byte limit (``ENGRAM_MAX_JSON_BYTES``) bounds what a body is, not what it becomes: ``{}`` is two
bytes and, decoded and validated, ~150 bytes of Python objects; ten million empty records in a
28 MiB body took the API from 168 MiB to 1.7 GiB before the route answered 422, and it kept 1.5 GiB
afterwards (CPython keeps the arenas of freed small objects). What a body costs grows with the
number of its values, so that number is bounded (``ENGRAM_MAX_JSON_VALUES``) and counted here,
without decoding, in memory bounded by the body's own size:

- first from structural bytes alone (``bytes.count`` at C speed): every value but the root follows
  a ``:``, a ``,`` or a ``[``, so their count plus one is an upper bound, which commas and colons
  inside strings can only inflate;
- only past the bound, exactly, a piece at a time with numpy (vector operations over the bytes: a
  regular expression's ``sub`` keeps an object per match, as much as the decoder would): what lies
  outside strings is structure; every value but the root follows a comma or is the first member of
  a container that is not empty (``{}`` and ``[]``, whitespace allowed inside, are the empty ones).
  Quotes are told from escaped ones by the run of backslashes before them. No value is decoded.

A body that is not JSON gets a count of what it resembles; the route's parser then says where it
breaks. Keys are not counted: the decoder shares repeated keys, and a key always comes with a value.
"""

from __future__ import annotations

import numpy as np

from service.errors import PayloadTooLarge

_QUOTE, _BACKSLASH, _COMMA = ord('"'), ord("\\"), ord(",")
_OPEN, _CLOSE = np.frombuffer(b"{[", np.uint8), np.frombuffer(b"}]", np.uint8)
_WHITESPACE = np.frombuffer(b" \t\n\r", np.uint8)
PIECE = 256 << 10  # bytes read at a time by the exact count: it holds ~40 times this, whatever the body


def json_values_at_most(body: bytes) -> int:
    """An upper bound on the values of ``body``, from structural bytes alone (strings can inflate it)."""
    return 1 + body.count(b":") + body.count(b",") + body.count(b"[")


def json_values(body: bytes, piece: int = PIECE) -> int:
    """The values ``body`` holds as JSON: the root, each array element and each object member's value."""
    count = _StructureCount()
    for start in range(0, len(body), piece):
        count.add(np.frombuffer(body, np.uint8, min(piece, len(body) - start), start))
    return count.values


class _StructureCount:
    """The structure outside strings, a piece at a time: each string stands as its opening quote.

    What is carried from one piece to the next: whether it ends inside a string, the backslashes it
    ends with (they escape what the next piece starts with), and its last byte of structure (a ``{``
    whose ``}`` opens the next piece is an empty object).
    """

    def __init__(self) -> None:
        self.commas = self.containers = self.empty = 0
        self.inside, self.backslashes, self.last = False, 0, np.zeros(0, np.uint8)

    def add(self, data: np.ndarray) -> None:
        quotes = (data == _QUOTE) & ~self._escaped(data)
        before = np.cumsum(quotes, dtype=np.int64) - quotes + self.inside  # the real quotes before each byte
        structure = data[(before % 2 == 0) & ~np.isin(data, _WHITESPACE)]  # a closing quote is inside
        self.inside = bool((before[-1] + quotes[-1]) % 2)
        self.commas += int(np.count_nonzero(structure == _COMMA))
        self.containers += int(np.count_nonzero(np.isin(structure, _OPEN)))
        joined = np.concatenate((self.last, structure))
        pairs = (joined[:-1] == _OPEN[0]) & (joined[1:] == _CLOSE[0]) | (joined[:-1] == _OPEN[1]) & (joined[1:] == _CLOSE[1])
        self.empty += int(np.count_nonzero(pairs))
        self.last = joined[-1:]

    def _escaped(self, data: np.ndarray) -> np.ndarray:
        """Each byte preceded by an odd run of backslashes (this piece's and those the last one ended with)."""
        backslash = data == _BACKSLASH
        if not backslash.any() and not self.backslashes:
            return backslash
        at = np.arange(len(data), dtype=np.int64)
        last_other = np.maximum.accumulate(np.where(backslash, -1 - self.backslashes, at))
        run = at - last_other  # the backslashes ending at each byte, itself included
        escaped = np.empty(len(data), bool)
        escaped[0] = self.backslashes % 2 == 1
        escaped[1:] = run[:-1] % 2 == 1
        self.backslashes = int(run[-1])
        return escaped

    @property
    def values(self) -> int:
        return 1 + self.commas + self.containers - self.empty


def check_json_values(body: bytes, limit: int, path: str) -> None:
    """Refuse (413) a body of more than ``limit`` values, before it is decoded.

    Raises:
        PayloadTooLarge: it holds more; the message names the setting and what to send instead.
    """
    if json_values_at_most(body) <= limit:
        return
    count = json_values(body)
    if count <= limit:
        return
    raise PayloadTooLarge(
        f"the request body holds {count:,} JSON values, more than the {limit:,} a JSON body may hold "
        f"(ENGRAM_MAX_JSON_VALUES; each value costs the API memory once decoded): {_what_to_send(path)}"
    )


def _what_to_send(path: str) -> str:
    if path.rstrip("/") == "/concepts":
        return (
            "send a large dataset as a multipart JSONL 'dataset' upload or as a dataset reference, which are "
            "read one record at a time (up to ENGRAM_MAX_RECORDS records)"
        )
    return "split the request into smaller ones (fewer probes, labels or items each)"
