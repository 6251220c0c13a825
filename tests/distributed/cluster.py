"""A distributed deployment in processes: a private Redis, the API and Celery workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engram_fixtures.live import (
    LiveServer,
    RedisServer,
    kill_worker,
    server_env,
    start_redis,
    start_server,
    start_worker,
    stop_redis,
    stop_server,
)

# Fast failure detection for tests: reconcile every second, a worker silent 3 s is presumed dead.
DIST_ENV = {
    "ENGRAM_RECONCILE_INTERVAL_S": "1",
    "ENGRAM_HEARTBEAT_TTL_S": "3",
    "ENGRAM_TASK_HARD_LIMIT_S": "600",
    "ENGRAM_TASK_MAX_RETRIES": "8",
}


class Cluster:
    """Redis + API + workers sharing one storage directory."""

    def __init__(self, root: Path, **env: str) -> None:
        self.root = root
        self.models = root / "models"
        self.storage = root / "store"
        self.extra = env
        self.redis: RedisServer = start_redis()
        self.workers: list[Any] = []
        self.api: LiveServer = start_server(self.storage, self.models, root / "api.log", **self.env_for("api"))

    def env_for(self, role: str) -> dict[str, str]:
        """Settings of one process; each has its own download cache, as on separate machines."""
        return {
            "ENGRAM_BROKER_URL": self.redis.url,
            "ENGRAM_COLLECT_BATCH_SIZE": "1",
            "ENGRAM_CACHE_DIR": str(self.root / "cache" / role),
            **DIST_ENV,
            **self.extra,
        }

    def start_worker(self) -> Any:
        env = server_env(self.storage, self.models, **self.env_for(f"worker-{len(self.workers)}"))
        worker = start_worker(env, self.root / f"worker-{len(self.workers)}.log")
        self.workers.append(worker)
        return worker

    def restart_redis(self) -> None:
        port = self.redis.port
        stop_redis(self.redis)
        self.redis = start_redis(port)

    def close(self) -> None:
        for worker in self.workers:
            kill_worker(worker)
        stop_server(self.api)
        stop_redis(self.redis)
