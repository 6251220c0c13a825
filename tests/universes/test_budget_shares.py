"""Issue 23, finding 6: one write key could fill ENGRAM_UNIVERSE_BYTES_BUDGET with universes of
distinct concept subsets, everyone else then got 409 for the retention window, no API could delete
a universe, and the budget was never checked against the disk.

- A key's universes (those it used within the retention age) may hold at most
  ENGRAM_UNIVERSE_KEY_SHARE of the budget: past it, that key gets a 409 naming the setting and its
  usage, and nothing changes.
- Another key still builds: the universes only heavier keys keep alive are evicted for it, least
  recently used first; a key never pushes out a lighter one. A universe two keys use is charged to
  both (issue 35, finding 8: tests/universes/test_shared_universe_charges.py).
- ``DELETE /universes/{id}`` (admin): every stored object goes; 409 naming the job while a job
  reads it, 409 naming the model while it is a model's current universe; 403 for read and write keys.
- For file:// storage the budget in force is capped to ENGRAM_UNIVERSE_VOLUME_FRACTION of the
  store's volume, said in a warning and in ``GET /universes/usage``.

Real file storage and the real job bodies in-process (tests.helpers.store_world), and a real server with
three keys for the HTTP paths (engram_fixtures.live).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from engram_client import EngramAPIError, EngramClient
from engram_fixtures.live import REPO_ROOT, running_server, wait_for_job
from engram_fixtures.models import make_tiny_llama, make_tokenizer
from service.concepts.service import ready_statistics
from service.errors import Conflict, NotFound
from service.jobs.admission import job_owner
from service.models.registry import get_model
from service.storage.keys import MODEL_UNIVERSES, universe_prefix
from service.universes import retention
from service.universes.projection import project_universe
from service.universes.retention import UniverseBudgetExceeded, UniverseShareExceeded, universe_storage
from service.universes.service import delete_universe, submit_universe, universe_view
from service.universes.spec import make_spec
from service.variants.service import submit_variant
from tests.helpers.store_world import StoreWorld, text_records

MODEL = "shares/llama"
OPTIONS = {"scaling": "uniform", "format": "delta"}
CONCEPTS = {"a": (0, 20, 11), "b": (20, 40, 11), "c": (40, 60, 11), "d": (60, 80, 11), "e": (80, 100, 11)}


def make_world(root: Path) -> StoreWorld:
    """``shares/llama`` with concepts a to e ready on it (their statistics published)."""
    world = StoreWorld(root)
    llama = make_tiny_llama(root / "models" / "llama", hidden=32, layers=2, seed=0, tokenizer=make_tokenizer())
    world.register(MODEL, llama)
    for name, (start, stop, seed) in CONCEPTS.items():
        world.publish(MODEL, name, text_records(start, stop, seed))
    return world


@pytest.fixture
def world(tmp_path: Path) -> StoreWorld:
    return make_world(tmp_path)


@contextmanager
def as_key(name: str | None) -> Iterator[None]:
    """Requests made inside come from API key ``name`` (what the API's context dependency sets)."""
    token = job_owner.set(name)
    try:
        yield
    finally:
        job_owner.reset(token)


def configure(world: StoreWorld, **values: Any) -> None:
    world.ctx.settings = world.ctx.settings.model_copy(update=values)


def pair_bytes(world: StoreWorld, pairs: list[tuple[str, str]]) -> int:
    """The largest projected bytes of the universes of these concept pairs (they differ by header bytes)."""
    model = get_model(world.ctx, MODEL)
    return max(
        project_universe(world.ctx, make_spec(model, ready_statistics(world.ctx, MODEL, list(p)), None)).total for p in pairs
    )


def unlearn(world: StoreWorld, target: str, reference: str) -> str:
    """An unlearn request that builds the universe {target, reference}, run to its end; its universe ID."""
    view, _ = submit_variant(world.ctx, MODEL, {target: -1.0}, 1.0, {**OPTIONS, "reference": [reference]})
    for job in world.run_pending():
        assert job.status == "succeeded", job
    return str(view.universe_id)


def stored(world: StoreWorld) -> dict[str, int]:
    root = Path(world.ctx.settings.storage_url.removeprefix("file://"))
    return {
        p.relative_to(root).as_posix(): p.stat().st_mtime_ns
        for p in root.rglob("*")
        if p.is_file() and ".tmp" not in p.parts
    }


# ---------------------------------------------------------------- shares


def test_a_key_past_its_share_gets_a_409_naming_the_setting_and_its_usage(world: StoreWorld) -> None:
    size = pair_bytes(world, [("a", "b"), ("a", "c"), ("a", "d")])
    configure(world, universe_bytes_budget=10 * size, universe_key_share=0.25)  # 2.5 universes per key
    with as_key("key-a"):
        first, second = unlearn(world, "a", "b"), unlearn(world, "a", "c")
        before = stored(world)
        with pytest.raises(UniverseShareExceeded) as refused:
            submit_variant(world.ctx, MODEL, {"a": -1.0}, 1.0, {**OPTIONS, "reference": ["d"]})
    problem = refused.value.to_problem().model_dump()
    held = sum(universe_view(world.ctx, u).bytes for u in (first, second))
    assert problem["status"] == 409 and problem["type"].endswith("/universe-key-share-exceeded")
    assert (problem["key"], problem["key_bytes"], problem["share_bytes"]) == ("key-a", held, int(2.5 * size))
    assert "ENGRAM_UNIVERSE_KEY_SHARE=0.25" in problem["detail"] and "key-a" in problem["detail"]
    assert f"{held} bytes" in problem["detail"], "the detail states the key's usage"
    assert stored(world) == before and world.pending == [], "nothing written, no job"
    with as_key("key-b"):  # the budget has room: another key is not refused
        unlearn(world, "a", "d")


def test_another_key_still_builds_once_one_key_filled_its_share(world: StoreWorld) -> None:
    size = pair_bytes(world, [("a", "b"), ("a", "c"), ("a", "d"), ("b", "e"), ("c", "e")])
    # Two universes fit one key's share; the budget holds two and a half: B's needs room.
    configure(world, universe_bytes_budget=int(2.5 * size), universe_key_share=0.8)
    with as_key("key-a"):
        oldest, newer = unlearn(world, "a", "b"), unlearn(world, "a", "c")
        with pytest.raises(UniverseShareExceeded):
            submit_variant(world.ctx, MODEL, {"a": -1.0}, 1.0, {**OPTIONS, "reference": ["d"]})
    with as_key("key-b"):
        theirs = unlearn(world, "b", "e")
    assert universe_view(world.ctx, oldest).status == "evicted", "A's least recently used universe made room"
    assert universe_view(world.ctx, newer).status == universe_view(world.ctx, theirs).status == "ready"
    assert universe_storage(world.ctx).held() <= world.ctx.settings.universe_bytes_budget
    summary = retention.storage_summary(world.ctx)
    assert {k.key: k.universes for k in summary.keys} == {"key-a": 1, "key-b": 1}
    # Now A and B hold one universe each: neither may push the other out (a key only displaces a heavier one).
    with as_key("key-a"), pytest.raises(UniverseBudgetExceeded) as refused:
        submit_variant(world.ctx, MODEL, {"c": -1.0}, 1.0, {**OPTIONS, "reference": ["e"]})
    assert not isinstance(refused.value, UniverseShareExceeded)
    assert universe_view(world.ctx, theirs).status == "ready"


def test_a_universe_two_keys_use_is_evicted_for_a_third_only_in_its_turn(world: StoreWorld) -> None:
    """Issue 35, finding 8 changed this rule: a universe two keys use was never evicted early; now
    it counts for both keys and goes in its turn, least recently used first."""
    size = pair_bytes(world, [("a", "b"), ("c", "d"), ("a", "e"), ("b", "e")])
    configure(world, universe_bytes_budget=int(3.5 * size), universe_key_share=0.9)
    with as_key("key-a"):
        shared = unlearn(world, "a", "b")
        mine, kept = unlearn(world, "c", "d"), unlearn(world, "a", "e")
    with as_key("key-b"):
        submit_variant(world.ctx, MODEL, {"b": -1.0}, 1.0, {**OPTIONS, "universe": shared})
        world.run_pending()
    charged = {k.key: k.universes for k in retention.storage_summary(world.ctx).keys}
    assert charged == {"key-a": 3, "key-b": 1}, "the shared universe counts for both keys"
    with as_key("key-c"):
        unlearn(world, "b", "e")
    assert universe_view(world.ctx, mine).status == "evicted", "A's least recently used universe made room"
    assert universe_view(world.ctx, kept).status == "ready", "only as many as needed"
    assert universe_view(world.ctx, shared).status == "ready", "B used it last: it is A's most recently used"


def test_without_auth_every_caller_is_one_key_with_the_whole_budget(world: StoreWorld) -> None:
    assert world.ctx.settings.api_keys is None and world.ctx.settings.key_share == 1.0
    size = pair_bytes(world, [("a", "b"), ("a", "c"), ("a", "d")])
    configure(world, universe_bytes_budget=3 * size)
    with as_key("anonymous"):
        built = [unlearn(world, "a", other) for other in ("b", "c", "d")]
    assert {universe_view(world.ctx, u).status for u in built} == {"ready"}
    configure(world, api_keys="x" * 16 + ":write")
    assert world.ctx.settings.key_share == 0.5, "with keys, each gets half by default"


# ---------------------------------------------------------------- DELETE /universes/{id}


def test_delete_removes_every_stored_object_of_a_universe(world: StoreWorld) -> None:
    uid = unlearn(world, "a", "b")
    submit_variant(world.ctx, MODEL, {"b": -1.0}, 1.0, {**OPTIONS, "universe": uid})  # queued, not run
    [job] = world.pending
    before = stored(world)
    with pytest.raises(Conflict) as busy:
        delete_universe(world.ctx, uid)
    assert job.job_id in busy.value.detail and stored(world) == before
    world.run_pending()
    freed = delete_universe(world.ctx, uid)
    assert freed > 0
    assert world.ctx.storage.list(universe_prefix(uid)) == []
    assert not [k for k in world.ctx.storage.list(MODEL_UNIVERSES) if k.endswith(uid)], "no marker lists it"
    with pytest.raises(NotFound):
        universe_view(world.ctx, uid)
    with pytest.raises(NotFound):
        delete_universe(world.ctx, uid)
    assert unlearn(world, "a", "b") == uid, "asked for again, it is rebuilt under the same ID"


def test_a_models_current_universe_is_not_deleted(world: StoreWorld) -> None:
    view, _ = submit_universe(world.ctx, MODEL, ["a", "c"], None)
    world.run_pending()
    with pytest.raises(Conflict) as refused:
        delete_universe(world.ctx, view.universe_id)
    assert MODEL in refused.value.detail and "current" in refused.value.detail
    assert universe_view(world.ctx, view.universe_id).status == "ready"


# ---------------------------------------------------------------- the volume


def test_the_budget_is_capped_to_the_stores_volume(world: StoreWorld, caplog: pytest.LogCaptureFixture) -> None:
    disk = shutil.disk_usage(world.ctx.storage.root)  # type: ignore[attr-defined]
    volume = disk.used + disk.free
    configure(world, universe_bytes_budget=1 << 60)  # an exbibyte: more than any disk
    with caplog.at_level(logging.WARNING, logger="engram.universes"):
        summary = retention.storage_summary(world.ctx)
    assert summary.configured_budget_bytes == 1 << 60
    assert abs(summary.budget_bytes - volume // 2) < volume // 100, "half the volume (its size moves a little)"
    assert "ENGRAM_UNIVERSE_VOLUME_FRACTION=0.5" in summary.budget_note
    assert any("ENGRAM_UNIVERSE_VOLUME_FRACTION" in r.getMessage() for r in caplog.records), "a warning says so"
    # The cap is enforced: a universe that fits the configured budget but not the volume's share is refused.
    size = pair_bytes(world, [("a", "b")])
    configure(world, universe_volume_fraction=(size // 2) / volume)
    with pytest.raises(UniverseBudgetExceeded) as refused:
        submit_universe(world.ctx, MODEL, ["a", "b"], None)
    assert "ENGRAM_UNIVERSE_VOLUME_FRACTION" in refused.value.detail


# ---------------------------------------------------------------- over HTTP, three keys


def test_over_http_shares_eviction_and_admin_delete(tmp_path: Path) -> None:
    """A real server with keys A, B (write), R (read) and an admin: A past its share gets a 409, B
    still builds (A's oldest universe evicted), and only the admin may delete a universe."""
    world = make_world(tmp_path)
    size = pair_bytes(world, [("a", "b"), ("a", "c"), ("a", "d"), ("b", "e")])
    keys = {name: secrets.token_urlsafe(24) for name in ("a", "b", "read", "admin")}
    env = {
        "ENGRAM_API_KEYS": f"{keys['a']}:write,{keys['b']}:write,{keys['read']}:read,{keys['admin']}:admin",
        "ENGRAM_UNIVERSE_BYTES_BUDGET": str(int(2.5 * size)),
        "ENGRAM_UNIVERSE_KEY_SHARE": "0.8",
    }

    def client(name: str) -> httpx.Client:
        return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {keys[name]}"}, timeout=60)

    def unlearn_over_http(http: httpx.Client, target: str, reference: str) -> httpx.Response:
        body = {"concepts": [target], "reference": [reference], **OPTIONS}
        return http.post(f"/models/{MODEL}/unlearn", json=body)

    def built(http: httpx.Client, target: str, reference: str) -> str:
        answer = unlearn_over_http(http, target, reference)
        assert answer.status_code == 202, answer.text
        assert wait_for_job(http, answer.json()["job"]["job_id"])["status"] == "succeeded"
        return str(answer.json()["variant"]["universe_id"])

    with running_server(tmp_path, tmp_path / "models", **env) as server:
        a, b, read, admin = (client(n) for n in ("a", "b", "read", "admin"))
        oldest, newer = built(a, "a", "b"), built(a, "a", "c")
        refused = unlearn_over_http(a, "a", "d")
        assert refused.status_code == 409 and refused.headers["content-type"].startswith("application/problem+json")
        assert "ENGRAM_UNIVERSE_KEY_SHARE" in refused.json()["detail"]
        assert refused.json()["key"].startswith("key-") and keys["a"] not in refused.text, "a fingerprint, never the key"
        theirs = built(b, "b", "e")
        assert a.get(f"/universes/{oldest}").json()["status"] == "evicted"
        usage = read.get("/universes/usage").json()
        assert usage["key_share"] == 0.8 and sorted(k["universes"] for k in usage["keys"]) == [1, 1]

        for name, http in (("read", read), ("write", b)):
            answer = http.delete(f"/universes/{theirs}")
            assert answer.status_code == 403, (name, answer.text)
        assert (tmp_path / "store" / universe_prefix(theirs) / "manifest.json").is_file()
        assert admin.delete(f"/universes/{theirs}").status_code == 204
        assert not (tmp_path / "store" / universe_prefix(theirs)).exists() or not any(
            (tmp_path / "store" / universe_prefix(theirs)).rglob("*.*")
        ), "every stored object of it is gone"
        assert admin.get(f"/universes/{theirs}").status_code == 404
        assert admin.delete(f"/universes/{theirs}").status_code == 404

        # The client and the CLI: `engram universes delete` with a write key is refused, with the admin's it deletes.
        with EngramClient(server.base_url, api_key=keys["admin"]) as engram:
            engram.delete_universe(oldest)  # evicted: only its records were left; they go too
            with pytest.raises(EngramAPIError) as gone:
                engram.get_universe(oldest)
            assert gone.value.status == 404
        refused_cli = engram_cli(server.base_url, keys["b"], "universes", "delete", newer)
        assert refused_cli.returncode == 1 and "403" in refused_cli.stderr and "Traceback" not in refused_cli.stderr
        assert a.get(f"/universes/{newer}").json()["status"] == "ready"
        deleted_cli = engram_cli(server.base_url, keys["admin"], "universes", "delete", newer)
        assert deleted_cli.returncode == 0 and f"deleted universe {newer}" in deleted_cli.stderr, deleted_cli.stderr
        assert a.get(f"/universes/{newer}").status_code == 404
        for http in (a, b, read, admin):
            http.close()


def engram_cli(url: str, api_key: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``engram ARGS`` as a real process against ``url`` with ``api_key``; no other ENGRAM_* setting leaks in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
    env.update(ENGRAM_URL=url, ENGRAM_API_KEY=api_key, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "engram_client.cli", *args]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
