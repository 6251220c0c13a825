"""An image classifier's evaluation job reads its image processor from this machine's checked files,
not from the folder the registration names.

What it stands for: a worker on another machine (a Celery worker with its own ``ENGRAM_CACHE_DIR``)
evaluating a variant of an ``s3://`` classifier. The API machine registered the model from its own
private copy (the record's ``path``, in the API's cache), which the worker does not have: the
worker's copy is in its own cache (:func:`service.models.loaded.checked_model_files`). Both machines
are played here by two contexts on one store; S3 itself is never reached (each cache already holds
its copy, the endpoint is unreachable), and the API's cache is removed once the model is registered.
On main the job read the image processor from the record's ``path`` and failed (``… has no
preprocessor_config.json``) although the worker had checked the model's files and loaded them.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engram_fixtures.live import free_port
from engram_fixtures.vision import make_tiny_resnet
from service.config import Settings
from service.context import Context
from service.evaluation import classifier_run
from service.evaluation.classifier_run import Classifier, load_retrained, run_classifier
from service.evaluation.retain_model import RetainModelRef
from service.models.inspection import register_model
from service.models.loaded import loaded_model
from service.models.record import ModelRecord
from service.storage.local import LocalStorage
from tests.helpers.images import digit_indices, digit_record

pytestmark = pytest.mark.fast

MODEL, SOURCE = "cls/remote-resnet", "s3://bucket/models/resnet/"
PROBES = [digit_record(i) for i in digit_indices(None, 0, 6)]


def _context(cache: Path, store: LocalStorage) -> Context:
    unreachable = f"http://127.0.0.1:{free_port()}"  # the cached copy is used: S3 is never asked
    settings = Settings(cache_dir=cache, s3_endpoint_url=unreachable, model_buckets="bucket", device="cpu")
    return Context(settings=settings, storage=store, jobs=None, dispatch=None, lock=threading.RLock())  # type: ignore[arg-type]


def _private_copy(folder: Path, cache: Path) -> Path:
    """``folder`` as a machine's download of :data:`SOURCE` into its cache (where the download puts it)."""
    copy = cache / "s3" / hashlib.sha256(SOURCE.encode()).hexdigest()
    shutil.copytree(folder, copy)
    return copy


@pytest.fixture
def worker(tmp_path: Path) -> tuple[Context, ModelRecord, Path, Path]:
    """The worker's context, the registration the API machine made, the worker's copy and the original."""
    torch.set_num_threads(1)
    original = make_tiny_resnet(tmp_path / "resnet", num_labels=10, seed=0)
    store = LocalStorage(tmp_path / "store")
    api_cache = tmp_path / "api-cache"
    _private_copy(original, api_cache)
    manifest, created = register_model(_context(api_cache, store), MODEL, SOURCE)
    assert created and manifest.kind == "image" and Path(manifest.path).is_relative_to(api_cache)
    shutil.rmtree(api_cache)  # the registering machine's copy: not on the worker
    worker_cache = tmp_path / "worker-cache"
    return _context(worker_cache, store), manifest, _private_copy(original, worker_cache), original


def _logits(classifier: Classifier) -> torch.Tensor:
    labels = [int(p["label"]) for p in PROBES]  # type: ignore[call-overload]
    outputs = run_classifier(classifier, PROBES, labels, "forget", batch_size=4, max_pixels=1 << 20, advance=lambda _: None)
    return outputs.logits


def test_every_classifier_reads_its_processor_from_the_workers_checked_copy(
    worker: tuple[Context, ModelRecord, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx, manifest, copy, original = worker
    assert not Path(manifest.path).exists()
    # the variant's request names its base model (the stored request's one field read here)
    monkeypatch.setattr(classifier_run, "find_variant_request", lambda _ctx, _id: SimpleNamespace(model_id=MODEL))

    def load_variant(ctx: Context, _variant_id: str) -> tuple[Any, Any, Any]:
        model, tokenizer = loaded_model(ctx, manifest, "cpu")
        return model, model, tokenizer

    retrained = RetainModelRef(id=MODEL, kind="model", digest=manifest.digest)
    job = classifier_run._classifiers(ctx, "variant-1", retrained, load_variant)  # base, variant, retrained
    classifiers: dict[str, Classifier] = {str(name): classifier for name, classifier in job.items()}
    classifiers["retrained-variant"] = load_retrained(ctx, RetainModelRef(id="v2", kind="variant", digest="-"), load_variant)
    # the same model, its images read by the processor saved beside it, in the original folder
    expected = _logits(Classifier(classifiers["base"].model, original))
    for name, classifier in classifiers.items():
        assert torch.equal(_logits(classifier), expected), name  # on main: JobFailed, no preprocessor_config.json
        assert classifier.folder == copy and classifier.processor is not None, name
