"""A GGUF model in distributed mode: registered by one Celery worker, read by another.

The register job dequantizes the ``.gguf`` into its worker's ``ENGRAM_CACHE_DIR``; every process of
the cluster has its own (as on separate machines). A worker that did not register the model must
dequantize the same file into its own cache, check the result against the registration by content,
and run the job; the variant it builds must be the one the registering worker's folder gives.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from engram_fixtures.demo import make_facts
from engram_fixtures.live import kill_worker, wait_for_job, wait_variant_ready
from tests.distributed.cluster import Cluster

pytestmark = pytest.mark.slow

MODEL = "dist/tiny-gguf"
FACTS = make_facts(12, seed=5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Redis, the API and a first worker; the tiny Llama as an F32 ``.gguf`` in the model root."""
    from engram_fixtures.models import make_tiny_llama
    from service.engine.gguf_write import write_gguf

    root = tmp_path_factory.mktemp("dist-gguf")
    folder = make_tiny_llama(root / "checkpoint" / "tiny", hidden=32, layers=2, tie_word_embeddings=True)
    (root / "models").mkdir()
    write_gguf(folder, root / "models" / "tiny.gguf", "F32", "tiny")
    cluster = Cluster(root)
    try:
        cluster.start_worker()
        yield cluster
    finally:
        cluster.close()


def _gguf_folders(cluster: Cluster, role: str) -> list[Path]:
    cache = cluster.root / "cache" / role / "gguf"
    return sorted(p for p in cache.iterdir() if not p.name.startswith(".")) if cache.is_dir() else []


def test_a_worker_that_did_not_register_the_gguf_dequantizes_it_and_runs_the_job(cluster: Cluster) -> None:
    client = cluster.api.client
    registered = client.post("/models", json={"model_id": MODEL, "source": f"file://{cluster.models / 'tiny.gguf'}"})
    assert registered.status_code in (201, 202), registered.text
    if registered.status_code == 202:
        assert wait_for_job(client, registered.json()["job_id"], timeout=300)["status"] == "succeeded"
    (first,) = _gguf_folders(cluster, "worker-0")
    assert client.get(f"/models/{MODEL}").json()["quantization"] == "F32"
    kill_worker(cluster.workers[0])  # from here on, only a worker with an empty cache runs jobs
    cluster.start_worker()
    records = [{"prompt": p, "completion": c} for p, c in FACTS[:6]]
    posted = client.post("/concepts", json={"name": "gguf-dist", "models": [MODEL], "records": records})
    assert posted.status_code == 202, posted.text
    collected = wait_for_job(client, posted.json()["jobs"][0]["job_id"], timeout=300)
    assert collected["status"] == "succeeded", collected
    (second,) = _gguf_folders(cluster, "worker-1")
    assert second.name == first.name  # the same file, the same recipe: the same folder name
    ours, theirs = load_file(second / "model.safetensors"), load_file(first / "model.safetensors")
    assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)

    submitted = client.post(f"/models/{MODEL}/unlearn", json={"concepts": ["gguf-dist"], "alpha": 0.5})
    assert submitted.status_code in (200, 202), submitted.text
    wait_variant_ready(client, submitted.json()["variant"]["variant_id"], timeout=300)
