"""The engram store, measured with the functions the workers run (no mirror of them).

    python -m bench.universe                 # the ~100M Llama (about 2-3 minutes on 2 cores)
    python -m bench.universe --profile tiny  # the tiny Llama (seconds)

In one process, on file storage in a temporary directory: the model is registered and its
concepts submitted and collected (``registry.submit_concept`` + ``tasks.run_job``: the collection
job body); ``universes.service.submit_universe`` + ``run_job`` builds a universe of every concept
once (decomposition, engrams, bytes, from its manifest); then variants of 1 and 3 concepts are
built by ``variants.build.build_variant_files`` (what the variant job runs before uploading the
files), interleaved with the copy floor (``load_file`` + ``save_file`` of every shard) measured in
the same run. The whole variant job (upload and SHA-256 of the files included) is reported too.

Float32 engram storage: the 1-concept variant's checkpoint is compared, tensor by tensor, with the
float64 statistics path (``bench.compose.compose_variant``: ``EngramAlgebra``, what variants did
before engrams were stored) on the same statistics and universe.
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench.common import LLAMA_100M, LLAMA_TINY, Profile, interleaved, median, set_threads, text_records  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL_ID = "bench/llama"
CONCEPTS = 4
VARIANT_SIZES = (1, 3)


def service_context(root: Path) -> Any:
    """A service context on file storage under ``root`` (jobs are run by the caller, in process)."""
    from service.config import Settings
    from service.jobs import JobStore
    from service.registry import Context
    from service.storage import LocalStorage

    settings = Settings(storage_url=f"file://{root / 'store'}", model_roots=str(root), cache_dir=root / "cache")
    storage = LocalStorage(root / "store")
    pending: list[dict[str, Any]] = []
    ctx = Context(
        settings=settings, storage=storage, jobs=JobStore(storage), dispatch=pending.append, lock=threading.RLock()
    )
    ctx.pending = pending  # type: ignore[attr-defined]
    return ctx


def run_pending(ctx: Any) -> list[dict[str, Any]]:
    """Run every job the service dispatched, with the workers' own ``run_job``."""
    from service.tasks import run_job

    finished = []
    while ctx.pending:
        job = ctx.pending.pop(0)
        run_job(ctx, job["job_id"])
        finished.append(ctx.jobs.get(job["job_id"]))
        if finished[-1]["status"] != "succeeded":
            raise RuntimeError(f"{job['kind']} job failed: {finished[-1]['error']}")
    return finished


def submit_concepts(ctx: Any, profile: Profile, scratch: Path) -> list[str]:
    """``CONCEPTS`` concepts of the compose benchmarks' size, submitted and collected on the model."""
    from service.datasets import spool_records
    from service.registry import submit_concept

    names = []
    for k in range(CONCEPTS):
        records = [r.to_json() for r in text_records(profile.concept_records, profile.facts_per_record, seed=100 + k)]
        dataset = spool_records(records, scratch / f"concept{k}.jsonl", ctx.settings.max_records)
        submit_concept(ctx, name=f"concept{k}", role=None, description=None, dataset=dataset, models=[MODEL_ID])
        names.append(f"concept{k}")
    run_pending(ctx)
    return names


def build_universe(ctx: Any, names: list[str]) -> dict[str, Any]:
    """``POST /models/{id}/universes`` and its job; returns the manifest and the job's wall time."""
    from service.universes.service import find_manifest, submit_universe

    view, _ = submit_universe(ctx, MODEL_ID, names, None)
    started = time.perf_counter()
    run_pending(ctx)
    wall = time.perf_counter() - started
    manifest = find_manifest(ctx, view["universe_id"])
    assert manifest is not None
    return {"manifest": manifest, "job_wall_s": wall}


def variant_request(ctx: Any, names: list[str], universe_id: str, scaling: str = "uniform") -> dict[str, Any]:
    """The stored request of an unlearn variant of ``names`` in the universe (submitted, not run)."""
    from service.variants.service import submit_variant

    options = {"scaling": scaling, "format": "checkpoint", "universe": universe_id}
    view, job = submit_variant(ctx, MODEL_ID, dict.fromkeys(names, -1.0), 1.0, options)
    request = ctx.storage.get_json(f"variants/{view['variant_id']}/request.json")
    return {"request": request, "job": job}


def float32_storage_effect(ctx: Any, request: dict[str, Any], layout: Any, model_dir: Path, out: Path) -> dict[str, Any]:
    """The stored-engram variant against the float64 statistics path, tensor by tensor."""
    from safetensors.torch import load_file

    from bench.compose import clear, compose_variant
    from service.local_copies import local_statistics_file
    from service.variants.build import build_variant_files

    (out / "stored").mkdir(parents=True)
    build_variant_files(ctx, request, out / "stored")
    terms = [local_statistics_file(ctx, p) for p in request["term_stats"].values()]
    universe = [local_statistics_file(ctx, p) for p in request["universe_stats"]]
    compose_variant(model_dir, layout, terms, universe, out / "float64")
    ours, theirs = (
        load_file(str(out / "stored" / "model.safetensors")),
        load_file(str(out / "float64" / "model.safetensors")),
    )
    base = load_file(str(model_dir / "model.safetensors"))
    worst_rel, worst_delta, differing, total = 0.0, 0.0, 0, 0
    for spec in layout.layers:
        key = layout.weight_keys[spec.name]
        a, b, w = ours[key].double(), theirs[key].double(), base[key].double()
        worst_rel = max(worst_rel, float((a - b).norm() / b.norm()))
        worst_delta = max(worst_delta, float(((a - w) - (b - w)).norm() / (b - w).norm()))
        differing += int((ours[key] != theirs[key]).sum())
        total += ours[key].numel()
    clear(out)
    return {
        "max_rel_weight_diff": worst_rel,
        "max_rel_edit_diff": worst_delta,
        "values_differing_share": differing / total,
        "note": "per layer, Frobenius: stored float32 engrams vs the float64 product (EngramAlgebra), both cast to float32",
    }


def measure(profile: Profile, root: Path, reps: int = 3) -> dict[str, Any]:
    """Everything this module measures, on ``profile``'s model built under ``root``."""
    from bench.common import build_model, checkpoint_bytes
    from bench.compose import clear, copy_floor
    from service.engine.checkpoint import ModelLayout
    from service.registry import register_model
    from service.variants.build import build_variant_files, run_variant

    model_dir = build_model(profile, root / "model")
    ctx = service_context(root)
    manifest, _ = register_model(ctx, MODEL_ID, f"file://{model_dir}")
    layout = ModelLayout.from_json(manifest["layout"])
    names = submit_concepts(ctx, profile, root)
    universe = build_universe(ctx, names)
    uid = universe["manifest"]["universe_id"]
    requests = {k: variant_request(ctx, names[:k], uid) for k in VARIANT_SIZES}
    weight_norm = variant_request(ctx, names[:3], uid, "weight_norm")
    out = root / "out"

    def variant(request: dict[str, Any]) -> None:
        (out / "variant").mkdir(parents=True)
        build_variant_files(ctx, request, out / "variant")
        clear(out / "variant")

    def floor() -> None:
        copy_floor(model_dir, out / "floor")
        clear(out / "floor")

    variant(requests[1]["request"])  # warm-up: page cache, first-call allocations
    fns = {"copy_floor": floor, **{f"variant_{k}": (lambda r=requests[k]["request"]: variant(r)) for k in VARIANT_SIZES}}
    fns["variant_3_weight_norm"] = lambda: variant(weight_norm["request"])
    times = interleaved(fns, reps)
    started = time.perf_counter()
    run_variant(ctx, ctx.jobs.get(requests[1]["job"]["job_id"]))  # the whole job: files uploaded, hashed, manifest
    job_s = time.perf_counter() - started
    effect = float32_storage_effect(ctx, requests[1]["request"], layout, model_dir, out)
    built = universe["manifest"]
    return {
        "profile": profile.name,
        "checkpoint_bytes": checkpoint_bytes(model_dir),
        "universe": {
            "members": len(built["members"]),
            "tokens": [m["tokens"] for m in built["members"]],
            "groups": len(built["groups"]),
            "layers": len(built["layers"]),
            "seconds": built["seconds"],
            "job_wall_s": round(universe["job_wall_s"], 3),
            "bytes": built["bytes"],
        },
        "times_s": {k: [round(t, 4) for t in v] for k, v in times.items()},
        "median_s": {k: round(median(v), 4) for k, v in times.items()},
        "ratio_to_copy_floor": {k: round(median(v) / median(times["copy_floor"]), 3) for k, v in times.items()},
        "variant_1_job_with_upload_s": round(job_s, 3),
        "float32_storage": effect,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.universe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", choices=("100m", "tiny"), default="100m")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "universe.json")
    args = parser.parse_args(argv)
    set_threads()
    torch.manual_seed(0)
    profile = LLAMA_100M if args.profile == "100m" else LLAMA_TINY
    with tempfile.TemporaryDirectory(prefix="engram-bench-universe-") as tmp:
        result = measure(profile, Path(tmp), args.reps)
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
