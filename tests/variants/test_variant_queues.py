"""Which queue a variant job goes to: a variant that must build its universe first is GPU work (the
float64 decomposition and products), one of a built universe is arithmetic for a CPU worker; universe
jobs and their helpers go to the GPU queue. Dispatched for real onto a private Redis (Celery's Redis
transport keeps each queue as a list named after it; ``tests.helpers.redis``)."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from engram_fixtures.live import RedisServer
from engram_fixtures.models import make_tiny_llama, make_tokenizer
from service.config import Settings
from service.execution.runtime import build_runtime
from service.jobs.records import VariantPayload
from service.variants.service import submit_variant
from tests.helpers.store_world import StoreWorld, text_records

MODEL = "q/llama"
OPTIONS = {"scaling": "uniform", "format": "checkpoint"}


def queued_tasks(client: redis.Redis, queue: str) -> list[str]:
    """The task names waiting in ``queue`` (sorted: kombu pushes at the head)."""
    return sorted(json.loads(raw)["headers"]["task"] for raw in client.lrange(queue, 0, -1))


def test_a_variant_that_builds_its_universe_goes_to_the_gpu_queue(tmp_path: Path, redis_server: RedisServer) -> None:
    world = StoreWorld(tmp_path)
    world.register(
        MODEL, make_tiny_llama(tmp_path / "models" / "llama", hidden=32, layers=2, seed=0, tokenizer=make_tokenizer())
    )
    world.publish(MODEL, "forget", text_records(0, 20))
    world.publish(MODEL, "retain", text_records(20, 60))
    _, first = submit_variant(world.ctx, MODEL, {"forget": -1.0}, 1.0, OPTIONS)
    assert first is not None and first.payload_of(VariantPayload).queue == "gpu"
    world.run_pending()  # builds the universe inside the variant job
    _, second = submit_variant(world.ctx, MODEL, {"forget": -0.5}, 1.0, OPTIONS)
    assert second is not None and second.payload_of(VariantPayload).queue is None

    settings = Settings(
        storage_url=f"file://{tmp_path / 'store'}",
        broker_url=redis_server.url,
        model_roots=str(tmp_path),
        cache_dir=tmp_path / "cache",
    )
    runtime = build_runtime(settings, background=False)
    client = redis.Redis.from_url(redis_server.url)
    client.delete("gpu", "cpu")
    runtime.ctx.dispatch(first)
    runtime.ctx.dispatch(second)
    runtime.ctx.universe_helpers("u" * 32, first.job_id, 2)
    assert queued_tasks(client, "gpu") == ["engram.build_variant", "engram.help_universe", "engram.help_universe"]
    assert queued_tasks(client, "cpu") == ["engram.build_variant"]
