"""Issue 35, finding 8: two write keys that each built on the other's universe were charged nothing
(a universe two keys used counted against neither) and their universes were never evicted for
anyone, locking a third key out of ENGRAM_UNIVERSE_BYTES_BUDGET for the retention window.

Now every key that used a universe within the retention age is charged its bytes in full
(service.universes.shares), and the universes only other keys keep alive stay evictable for a key
that needs room, from the most charged key first.

The real app in this process (tests.helpers.app.in_process_server: the embedded job process, real
file storage) with three write keys; the concepts' statistics are published beforehand as a
collection would publish them (tests.helpers.store_world), so the test runs only the universe and
variant jobs it is about.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_fixtures.live import wait_for_job
from engram_fixtures.models import make_tiny_llama, make_tokenizer
from service.api.auth import key_identity
from service.concepts.service import ready_statistics
from service.jobs.admission import job_owner
from service.models.registry import get_model
from service.universes.projection import project_universe
from service.universes.retention import UniverseShareExceeded, storage_summary
from service.universes.service import universe_view
from service.universes.spec import make_spec
from service.variants.service import submit_variant
from tests.helpers.app import another_client, in_process_server
from tests.helpers.store_world import StoreWorld, text_records

MODEL = "cross/llama"
OPTIONS = {"scaling": "uniform", "format": "delta"}
CONCEPTS = {"a": (0, 20, 11), "b": (20, 40, 11), "c": (40, 60, 11), "d": (60, 80, 11), "e": (80, 100, 11)}
PAIRS = [("a", "b"), ("c", "d"), ("e", "a"), ("b", "e")]


def make_world(root: Path) -> StoreWorld:
    """``cross/llama`` with concepts a to e ready on it (their statistics published)."""
    world = StoreWorld(root)
    llama = make_tiny_llama(root / "models" / "llama", hidden=32, layers=2, seed=0, tokenizer=make_tokenizer())
    world.register(MODEL, llama)
    for name, (start, stop, seed) in CONCEPTS.items():
        world.publish(MODEL, name, text_records(start, stop, seed))
    return world


def universe_bytes(world: StoreWorld) -> int:
    """The largest projected bytes of the universes of PAIRS (they differ by header bytes only)."""
    model = get_model(world.ctx, MODEL)
    specs = (make_spec(model, ready_statistics(world.ctx, MODEL, list(pair)), None) for pair in PAIRS)
    return max(project_universe(world.ctx, spec).total for spec in specs)


def unlearn(world: StoreWorld, key: str, target: str, **where: Any) -> str:
    """A request of ``key`` (its universe: ``reference`` or ``universe`` in ``where``) run to its end."""
    token = job_owner.set(key)
    try:
        view, _ = submit_variant(world.ctx, MODEL, {target: -1.0}, 1.0, {**OPTIONS, **where})
    finally:
        job_owner.reset(token)
    for job in world.run_pending():
        assert job.status == "succeeded", job
    return str(view.universe_id)


def test_keys_using_each_others_universes_are_charged_and_make_room_for_a_third_key(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    size = universe_bytes(world)
    budget = int(2.5 * size)  # two universes fit, a third needs one of them gone
    keys = {name: secrets.token_urlsafe(24) for name in ("a", "b", "c")}
    env = {
        "ENGRAM_API_KEYS": ",".join(f"{key}:write" for key in keys.values()),
        "ENGRAM_UNIVERSE_BYTES_BUDGET": str(budget),  # ENGRAM_UNIVERSE_KEY_SHARE unset: 0.5 with keys
    }

    def unlearn_over_http(http: httpx.Client, target: str, **where: Any) -> httpx.Response:
        answer = http.post(f"/models/{MODEL}/unlearn", json={"concepts": [target], **where, **OPTIONS})
        if answer.status_code == 202:
            assert wait_for_job(http, answer.json()["job"]["job_id"])["status"] == "succeeded"
        return answer

    with in_process_server(tmp_path, tmp_path / "models", **env) as server:
        a, b, c = (another_client(server, {"Authorization": f"Bearer {keys[n]}"}) for n in ("a", "b", "c"))
        built_by_a = unlearn_over_http(a, "a", reference=["b"])
        built_by_b = unlearn_over_http(b, "c", reference=["d"])
        assert built_by_a.status_code == built_by_b.status_code == 202, (built_by_a.text, built_by_b.text)
        first, second = built_by_a.json()["variant"]["universe_id"], built_by_b.json()["variant"]["universe_id"]
        # Each key builds a variant on the other's universe: both universes are now used by both keys.
        assert unlearn_over_http(a, "d", universe=second).status_code == 202
        assert unlearn_over_http(b, "b", universe=first).status_code == 202

        usage = a.get("/universes/usage").json()
        charges = {k["key"]: (k["bytes"], k["universes"]) for k in usage["keys"]}
        both = sum(a.get(f"/universes/{u}").json()["bytes"] for u in (first, second))
        fingerprint = {name: key_identity(key) for name, key in keys.items()}
        assert charges == {fingerprint["a"]: (both, 2), fingerprint["b"]: (both, 2)}, "each is charged both, in full"

        theirs = unlearn_over_http(c, "e", reference=["a"])
        assert theirs.status_code == 202, f"key C was locked out of the budget: {theirs.text}"
        statuses = {u: a.get(f"/universes/{u}").json()["status"] for u in (first, second)}
        # A used `second` before B used `first`: the least recently used of the most charged key goes.
        assert statuses == {second: "evicted", first: "ready"}, statuses
        after = a.get("/universes/usage").json()
        assert after["bytes"]["total"] <= budget, after

        # A is still charged the universe it shares with B: past its share (1.25 universes) it is refused.
        refused = unlearn_over_http(a, "b", reference=["e"])
        assert refused.status_code == 409 and refused.json()["type"].endswith("/universe-key-share-exceeded")
        assert refused.json()["key_bytes"] == a.get(f"/universes/{first}").json()["bytes"], refused.json()
        for http in (a, b, c):
            http.close()


def test_a_universe_both_keys_use_counts_toward_each_keys_share(tmp_path: Path) -> None:
    """A key reading another key's universe is charged for it: its own next build can be past its share."""
    world = make_world(tmp_path)
    size = universe_bytes(world)
    world.ctx.settings = world.ctx.settings.model_copy(
        update={"universe_bytes_budget": 4 * size, "universe_key_share": 0.4}  # 1.6 universes per key
    )
    mine = unlearn(world, "key-a", "a", reference=["b"])
    theirs = unlearn(world, "key-b", "c", reference=["d"])
    unlearn(world, "key-a", "d", universe=theirs)
    token = job_owner.set("key-a")
    try:
        with pytest.raises(UniverseShareExceeded) as refused:
            submit_variant(world.ctx, MODEL, {"e": -1.0}, 1.0, {**OPTIONS, "reference": ["a"]})
    finally:
        job_owner.reset(token)
    held = sum(universe_view(world.ctx, u).bytes for u in (mine, theirs))
    assert refused.value.numbers["key_bytes"] == held, "the universe it reads counts in full"
    assert "counts in full" in refused.value.detail
    assert world.pending == []
    keys = {k.key: k.universes for k in storage_summary(world.ctx).keys}
    assert keys == {"key-a": 2, "key-b": 1}
