"""Each API key's share of the universe budget: what it is charged, and whose universes make room for whom.

Charge. A key keeps alive every universe its requests used within ``ENGRAM_UNIVERSE_RETENTION_S``
(built or requested it, or requested a variant of it: the ``users`` of its usage record), and is
charged the bytes all of them hold, stored and reserved. A universe several keys used is charged
in full to each of them. Full bytes rather than a split, because:

- a key's charge then depends on its own requests only. Split, B reading A's universe would halve
  A's charge and B going quiet would double it back, a 409 on A's next build that A did nothing to
  cause;
- reading someone else's universe costs the reader what it pins. Split, keys that read each
  other's universes would each look light: two keys that build one universe each and read the
  other's would each be charged one universe while keeping two alive, and a third key could not
  tell them from keys holding half as much;
- sharing can only make a universe cost more, never protect it: every key that keeps it alive is
  charged for it, and any of them being heavier than a key that needs room makes it evictable.

The sum of the keys' charges may so exceed what storage holds; the budget itself is checked on the
bytes stored (:func:`service.universes.retention.make_room`), the charges only against
``ENGRAM_UNIVERSE_KEY_SHARE`` × the budget per key.

Displacement. When a key needs room that evicting unused universes does not give, universes that
only other keys keep alive (no model's current universe, none a job needs) are evicted for it: from
the key charged the most first, its least recently used universe first, and only from keys charged
more than the requesting key will be once its universe is built. Evicting a universe lowers the
charge of every key that used it. So a key can push out a heavier one, never a lighter one, and
keys that use each other's universes are as evictable as keys that use their own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from service.universes.holdings import StoredUniverse, UniverseStorage


def _by_use(universes: Iterable[StoredUniverse]) -> list[StoredUniverse]:
    """Least recently used first (the universe ID breaks ties, so the order never depends on listing)."""
    return sorted(universes, key=lambda u: (u.last_used, u.universe_id))


def key_holdings(storage: UniverseStorage, now: datetime, excluding: str | None = None) -> dict[str, list[StoredUniverse]]:
    """Key identity → every universe holding bytes that it used within the retention age, least
    recently used first; a universe several keys used is in each of their lists."""
    kept: dict[str, list[StoredUniverse]] = {}
    for u in _by_use(storage.universes):
        if u.held <= 0 or u.universe_id == excluding:  # an evicted one holds nothing
            continue
        for key in sorted(u.live_users(now, storage.retention_s)):
            kept.setdefault(key, []).append(u)
    return kept


def key_charge(storage: UniverseStorage, key: str, now: datetime, excluding: str | None = None) -> int:
    """What ``key`` is charged: the bytes (stored and reserved) of every universe it keeps alive."""
    return sum(u.held for u in key_holdings(storage, now, excluding).get(key, []))


@dataclass(frozen=True)
class ShareOverrun:
    """A build that would take its key past ``ENGRAM_UNIVERSE_KEY_SHARE`` of the budget.

    Attributes:
        charged: what the key is charged now (the universe being built excluded).
        universes: how many universes that charge is made of.
        limit: what one key may be charged (share × budget).
    """

    charged: int
    universes: int
    limit: int


def share_overrun(storage: UniverseStorage, key: str, projected: int, now: datetime, excluding: str) -> ShareOverrun | None:
    """The overrun when a build of ``projected`` bytes (universe ``excluding``) takes ``key`` past its
    share; None when it fits, or when shares are off (a share of 1)."""
    if storage.share >= 1:
        return None
    mine = key_holdings(storage, now, excluding).get(key, [])
    charged = sum(u.held for u in mine)
    if charged + projected <= storage.share_bytes:
        return None
    return ShareOverrun(charged=charged, universes=len(mine), limit=storage.share_bytes)


def displaceable(
    storage: UniverseStorage, key: str, need: int, projected: int, now: datetime, excluding: str
) -> list[StoredUniverse]:
    """Universes to evict for ``key`` to free ``need`` bytes (fewer when no more may go), in order:
    see the module docstring. ``projected``: the bytes of the universe ``key`` builds (``excluding``)."""
    held = key_holdings(storage, now, excluding)
    charges = {k: sum(u.held for u in found) for k, found in held.items()}
    mine = charges.get(key, 0) + projected
    candidates = {
        k: [u for u in found if u.evictable_for(key, now, storage.retention_s)] for k, found in held.items() if k != key
    }
    chosen: list[StoredUniverse] = []
    taken: set[str] = set()
    freed = 0
    while freed < need:
        heavy = [k for k, found in candidates.items() if found and charges[k] > mine]
        if not heavy:
            break
        victim = max(heavy, key=lambda k: (charges[k], k))
        candidate = candidates[victim].pop(0)
        if candidate.universe_id in taken:  # shared with a key already displaced: its bytes are freed once
            continue
        taken.add(candidate.universe_id)
        chosen.append(candidate)
        freed += candidate.held
        for user in candidate.live_users(now, storage.retention_s):  # everyone who kept it is charged less
            if user in charges:
                charges[user] -= candidate.held
    return chosen
