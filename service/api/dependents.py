"""The 409 a deletion answers while something still needs what it would delete: one wording for every
resource (models, concepts), so a client reads every refusal the same way."""

from __future__ import annotations

from collections.abc import Mapping

NAMED = 20  # a 409 names this many dependents of each kind, then counts the rest


def still_needed(subject: str, blocking: Mapping[str, list[str]], steps: Mapping[str, str]) -> str:
    """``"<subject> is still needed (<kind>: <ids>; ...): nothing was deleted. To delete it: <steps>"``.

    ``steps`` says, for each kind of dependent, what the caller does about it; kinds that share a
    step are advised once.
    """
    named = "; ".join(f"{kind}: {named_ids(ids)}" for kind, ids in blocking.items())
    advice = "; ".join(dict.fromkeys(steps[kind] for kind in blocking))
    return f"{subject} is still needed ({named}): nothing was deleted. To delete it: {advice}"


def named_ids(ids: list[str]) -> str:
    more = len(ids) - NAMED
    return ", ".join(ids[:NAMED]) + (f" and {more} more" if more > 0 else "")
