"""``engram-service migrate``: a store written by 0.1.0 rewritten once in the current format.

The store is real (file storage, a registered tiny Llama, published concepts); its old records
are written as 0.1.0 wrote them: a registration without ``format_version``, variant requests
without ``format_version``, the later options and ``universe_id``. The command runs as a real
process on that store, then again (nothing changes), and the readers read what it wrote.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engram_fixtures.models import make_tiny_llama, make_tokenizer
from service.concepts.service import ready_statistics
from service.models.registry import get_model
from service.models.stored import FORMAT_VERSION, UnmigratedRecord
from service.storage.keys import model_key, universe_request_key, variant_request_key
from service.universes.members import resolve_members
from service.universes.records import find_request
from service.universes.service import record_universe
from service.universes.spec import make_spec
from service.variants.migrate import migrate_store
from service.variants.service import find_variant_request
from tests.helpers.store_world import StoreWorld, text_records

MODEL = "m/llama"
OLD = "0123456789abcdef0123456789abcdef"  # a variant requested before universes were stored
ORPHAN = "fedcba9876543210fedcba9876543210"  # its statistics belong to no concept


@pytest.fixture
def world(tmp_path: Path) -> StoreWorld:
    w = StoreWorld(tmp_path)
    w.register(
        MODEL, make_tiny_llama(tmp_path / "models" / "llama", hidden=32, layers=2, seed=0, tokenizer=make_tokenizer())
    )
    w.publish(MODEL, "forget", text_records(0, 20))
    w.publish(MODEL, "retain", text_records(20, 50))
    return w


def old_store(w: StoreWorld) -> dict[str, Any]:
    """The registration, a universe request and two variant requests as 0.1.0 stored them; returns
    the old variant request (the universe's ID is under ``"universe"``)."""
    stats = ready_statistics(w.ctx, MODEL, ["forget", "retain"])
    universe = make_spec(get_model(w.ctx, MODEL), {"retain": stats["retain"]}, None)
    with w.ctx.lock:
        record_universe(w.ctx, universe, None)
    stored_universe = w.ctx.storage.get_json(universe_request_key(universe.universe_id))
    w.ctx.storage.put_json(
        universe_request_key(universe.universe_id),
        {k: v for k, v in stored_universe.items() if k not in ("format_version", "stats")},
    )
    registration = w.ctx.storage.get_json(model_key(MODEL))
    del registration["format_version"]
    w.ctx.storage.put_json(model_key(MODEL), registration)
    old = {
        "variant_id": OLD,
        "model_id": MODEL,
        "terms": {"forget": -1.0},
        "alpha": 1.0,
        "reference": ["retain"],
        "scaling": "weight_norm",
        "modules": ["q_proj"],
        "layers": None,
        "rcond": 0.001,
        "term_stats": {"forget": stats["forget"]["prefix"]},
        "universe_stats": sorted(s["prefix"] for s in stats.values()),
        "job_id": None,
    }
    w.ctx.storage.put_json(variant_request_key(OLD), old)
    orphan_prefix = stats["retain"]["prefix"].replace(stats["retain"]["dataset_digest"], "e" * 64)
    orphan = {**old, "variant_id": ORPHAN, "universe_stats": sorted([stats["forget"]["prefix"], orphan_prefix])}
    w.ctx.storage.put_json(variant_request_key(ORPHAN), orphan)
    return {**old, "universe": universe.universe_id}


def run_migrate(w: StoreWorld, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ENGRAM_STORAGE_URL": w.ctx.settings.storage_url, "ENGRAM_CACHE_DIR": str(w.root / "cache")}
    command = [sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())", "migrate", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_an_old_store_is_migrated_once_and_what_cannot_be_is_refused_by_name(world: StoreWorld) -> None:
    old = old_store(world)
    with pytest.raises(UnmigratedRecord, match=f"variant request {variant_request_key(OLD)} .*engram-service migrate"):
        find_variant_request(world.ctx, OLD)
    with pytest.raises(UnmigratedRecord, match=f"model registration {model_key(MODEL)} .*engram-service migrate"):
        get_model(world.ctx, MODEL)
    with pytest.raises(UnmigratedRecord, match=f"universe request {universe_request_key(old['universe'])} .*migrate"):
        find_request(world.ctx, old["universe"])

    first = run_migrate(world)
    assert first.returncode == 1, first.stderr  # one record refused
    assert f"migrated {model_key(MODEL)}" in first.stdout
    assert f"migrated {variant_request_key(OLD)}" in first.stdout
    assert f"migrated {universe_request_key(old['universe'])}" in first.stdout
    migrated_universe = find_request(world.ctx, old["universe"])
    assert migrated_universe is not None and migrated_universe.stats == (
        ready_statistics(world.ctx, MODEL, ["retain"])["retain"]["prefix"],
    )
    assert migrated_universe.spec.universe_id == old["universe"]
    assert f"refused {variant_request_key(ORPHAN)}: statistics stats/" in first.stderr
    assert "belong to no concept on model m/llama" in first.stderr

    request = find_variant_request(world.ctx, OLD)
    assert request is not None and request.format_version == FORMAT_VERSION
    spec = request.spec
    assert (spec.format, spec.lora_rank, spec.lora_target, spec.strengths) == ("checkpoint", None, None, None)
    assert (spec.scaling, spec.modules, request.rcond, request.terms) == ("weight_norm", ("q_proj",), 0.001, old["terms"])
    # Its universe is the one a request of the same terms, reference and cut resolves to now.
    model = get_model(world.ctx, MODEL)
    expected = resolve_members(world.ctx, model, ["forget"], reference=["retain"], rcond=0.001)
    assert request.universe_id == expected.spec.universe_id
    recorded = find_request(world.ctx, request.universe_id)
    assert recorded is not None and sorted(m.name for m in recorded.members) == ["forget", "retain"]
    assert world.ctx.storage.get_json(variant_request_key(ORPHAN)).get("format_version") is None  # left as it was

    before = {k: world.ctx.storage.get_bytes(k) for k in world.ctx.storage.list("") if not k.startswith("jobs/")}
    second = run_migrate(world)
    assert second.returncode == 1 and "migrated" not in second.stdout, second.stdout
    assert "0 record(s) migrated, 1 refused" in second.stderr
    after = {k: world.ctx.storage.get_bytes(k) for k in world.ctx.storage.list("") if not k.startswith("jobs/")}
    assert after == before


def test_a_dry_run_reports_and_writes_nothing(world: StoreWorld) -> None:
    old = old_store(world)
    before = {k: world.ctx.storage.get_bytes(k) for k in world.ctx.storage.list("")}
    done = migrate_store(world.ctx, dry_run=True)
    assert [k for k, _ in done.changed] == [
        model_key(MODEL),
        universe_request_key(old["universe"]),
        variant_request_key(OLD),
    ]
    assert [k for k, _ in done.refused] == [variant_request_key(ORPHAN)]
    assert {k: world.ctx.storage.get_bytes(k) for k in world.ctx.storage.list("")} == before
