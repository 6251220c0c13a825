"""The engram store, measured with the functions the workers run (no mirror of them).

    python -m bench.universe                        # the ~100M Llama (about 2-3 minutes on 2 cores)
    python -m bench.universe --profile tiny         # the tiny Llama (seconds)
    python -m bench.universe --profile 1b-slice     # Llama-3.2-1B's shapes, 2 of 16 layers, bf16 (~15 min)
    python -m bench.universe setup --profile 1b-slice --root DIR    # the setup alone, kept in DIR
    python -m bench.universe variants --root DIR                    # then the variants, as often as you like

Setup, in this process, on file storage in a temporary directory: the model is registered and its
concepts submitted and collected (``registry.submit_concept`` + ``tasks.run_job``: the collection
job body); ``universes.service.submit_universe`` + ``run_job`` builds a universe of every concept
once (decomposition, engrams, bytes, from its manifest).

Variants, in a fresh interpreter on the same storage (the service restarted: nothing in memory,
``python -m bench.universe variants``). The setup's writes are flushed first (``os.sync``): a
universe is built long before a restart, and without the flush the first variant is throttled by
the kernel writing back the setup's gigabytes (measured: 0.9 s instead of 0.4 s on the 100M model),
which is the bench's artefact, not the service's; so is the virtual machine's first touch of memory
it never used (:func:`prime_memory`). The page cache stays warm, as on a worker that has served
this model before. In the fresh process the copy floor is timed cold first (its first
run), then the first variant after the restart alone, then
variants of 1 and 3 concepts are built by ``variants.build.build_variant_files`` (what the variant
job runs before uploading the files), interleaved with the copy floor (``load_file`` + ``save_file``
of every shard) measured in the same run. The whole variant job (upload and SHA-256 of the files
included) is reported too.

Float32 engram storage (not for 1b-slice: the float64 path costs minutes there): the 1-concept
variant's checkpoint is compared, tensor by tensor, with the float64 statistics path
(``bench.compose.compose_variant``: ``EngramAlgebra``, what variants did before engrams were
stored) on the same statistics and universe.
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
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    LLAMA_1B_SLICE,
    LLAMA_100M,
    LLAMA_TINY,
    Profile,
    interleaved,
    median,
    set_threads,
    text_records,
)

REPO = Path(__file__).resolve().parent.parent
MODEL_ID = "bench/llama"
CONCEPTS = 4
VARIANT_SIZES = (1, 3)
PROFILES = {"100m": LLAMA_100M, "tiny": LLAMA_TINY, "1b-slice": LLAMA_1B_SLICE}


def service_context(root: Path) -> Any:
    """A service context on file storage under ``root`` (jobs are run by the caller, in process)."""
    from service.config import Settings
    from service.context import Context
    from service.jobs.store import JobStore
    from service.storage.local import LocalStorage

    settings = Settings(storage_url=f"file://{root / 'store'}", model_roots=str(root), cache_dir=root / "cache")
    storage = LocalStorage(root / "store")
    pending: list[dict[str, Any]] = []
    ctx = Context(
        settings=settings, storage=storage, jobs=JobStore(storage), dispatch=pending.append, lock=threading.RLock()
    )
    ctx.pending = pending  # type: ignore[attr-defined]
    return ctx


def run_pending(ctx: Any) -> list[Any]:
    """Run every job the service dispatched, with the workers' own ``run_job``."""
    from service.execution.runner import run_job

    finished = []
    while ctx.pending:
        job = ctx.pending.pop(0)
        run_job(ctx, job.job_id)
        finished.append(ctx.jobs.get(job.job_id))
        if finished[-1].status != "succeeded":
            raise RuntimeError(f"{job.kind} job failed: {finished[-1].error}")
    return finished


def submit_concepts(ctx: Any, profile: Profile, scratch: Path) -> list[str]:
    """``CONCEPTS`` concepts of the compose benchmarks' size, submitted and collected on the model."""
    from service.concepts.service import submit_concept
    from service.datasets.spool import spool_records

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
    from service.universes.records import find_manifest
    from service.universes.service import submit_universe

    view, _ = submit_universe(ctx, MODEL_ID, names, None)
    started = time.perf_counter()
    run_pending(ctx)
    wall = time.perf_counter() - started
    manifest = find_manifest(ctx, view.universe_id)
    assert manifest is not None
    return {"manifest": manifest.to_json(), "job_wall_s": wall}


def variant_request(ctx: Any, names: list[str], universe_id: str, scaling: str = "uniform") -> dict[str, Any]:
    """The stored plan of an unlearn variant of ``names`` in the universe (submitted, not run)."""
    from api_schemas import EditOptions
    from service.variants.build import find_variant_plan
    from service.variants.service import submit_variant

    options = EditOptions(scaling=scaling, format="checkpoint", universe=universe_id)
    view, job = submit_variant(ctx, MODEL_ID, dict.fromkeys(names, -1.0), 1.0, options)
    return {"request": find_variant_plan(ctx, view.variant_id), "job": job}


def float32_storage_effect(ctx: Any, variant_id: str, layout: Any, model_dir: Path, out: Path) -> dict[str, Any]:
    """The stored-engram variant against the float64 statistics path, tensor by tensor."""
    from safetensors.torch import load_file

    from bench.compose import clear, compose_variant
    from service.statistics.local import local_statistics_file
    from service.variants.build import build_variant_files, find_variant_plan

    plan = find_variant_plan(ctx, variant_id)
    (out / "stored").mkdir(parents=True)
    build_variant_files(ctx, plan, out / "stored")
    terms = [local_statistics_file(ctx, p) for p in plan.request.term_stats.values()]
    universe = [local_statistics_file(ctx, p) for p in plan.request.universe_stats]
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


def setup(profile: Profile, root: Path) -> dict[str, Any]:
    """Model, concepts and universe under ``root``; returns what the variant phase needs and the
    universe's one-time build (from its manifest)."""
    from bench.common import build_model, checkpoint_bytes
    from service.models.inspection import register_model

    model_dir = build_model(profile, root / "model")
    ctx = service_context(root)
    register_model(ctx, MODEL_ID, f"file://{model_dir}")
    names = submit_concepts(ctx, profile, root)
    universe = build_universe(ctx, names)
    built = universe["manifest"]
    return {
        "profile": profile.name,
        "model_dir": str(model_dir),
        "names": names,
        "universe_id": built["universe_id"],
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
    }


def flush_writes() -> None:
    """Wait until the kernel has written back every dirty page (see the module's docstring)."""
    os.sync()


def prime_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of memory once and free it.

    These machines are virtual: guest memory the VM has never used is backed by the host on first
    touch, which makes the first write of a file into that memory slow (measured: 1.3 GB of bf16
    tensors written in 1.30 s by a process's first write, 0.18 s by the next, in this process or
    another). A worker that has been running has long touched its memory; a bench run right after
    boot has not, and the first variant (which writes more than the copy floor before it: a tied
    head is written untied) would pay the host's page faults. Freed pages go back to the kernel's
    free lists and are reused for the page cache, so the file writes measured next no longer do.
    """
    chunk = 256 << 20
    held = []
    for _ in range(max(1, nbytes // chunk)):
        block = torch.empty(chunk, dtype=torch.uint8)
        block.fill_(1)
        held.append(block)
    del held


def measure_variants(root: Path, setup_info: dict[str, Any], reps: int) -> dict[str, Any]:
    """Variants of a built universe against the copy floor, in this process (a fresh one: call it
    through :func:`variants_in_fresh_process`)."""
    from bench.compose import clear, copy_floor
    from service.variants.build import build_variant_files, run_variant

    ctx = service_context(root)
    model_dir, names, uid = Path(setup_info["model_dir"]), setup_info["names"], setup_info["universe_id"]
    requests = {k: variant_request(ctx, names[:k], uid) for k in VARIANT_SIZES}
    weight_norm = variant_request(ctx, names[:3], uid, "weight_norm")
    out = root / "out"

    def variant(request: Any) -> None:
        (out / "variant").mkdir(parents=True)
        build_variant_files(ctx, request, out / "variant")
        clear(out / "variant")

    def floor() -> None:
        copy_floor(model_dir, out / "floor")
        clear(out / "floor")

    flush_writes()
    prime_memory(4 * int(setup_info["checkpoint_bytes"]))
    started = time.perf_counter()
    floor()  # the process's first copy: the floor's own cold start, for the first variant's ratio
    first_floor = time.perf_counter() - started
    started = time.perf_counter()
    variant(requests[1]["request"])  # the first variant after a restart: nothing of the universe in memory
    first = time.perf_counter() - started
    fns = {"copy_floor": floor, **{f"variant_{k}": (lambda r=requests[k]["request"]: variant(r)) for k in VARIANT_SIZES}}
    fns["variant_3_weight_norm"] = lambda: variant(weight_norm["request"])
    times = interleaved(fns, reps, before=flush_writes)  # each call starts with no dirty pages of another
    job_s = math.nan  # a root measured before already holds the variant: no job to run
    if requests[1]["job"] is not None:
        started = time.perf_counter()
        run_variant(ctx, ctx.jobs.get(requests[1]["job"].job_id))  # the whole job: files uploaded, hashed, manifest
        job_s = time.perf_counter() - started
    floor_s = median(times["copy_floor"])
    return {
        "first_variant_after_restart_s": round(first, 4),
        "first_variant_ratio_to_copy_floor": round(first / floor_s, 3),
        "first_copy_floor_s": round(first_floor, 4),
        "first_variant_ratio_to_first_copy_floor": round(first / first_floor, 3),
        "times_s": {k: [round(t, 4) for t in v] for k, v in times.items()},
        "median_s": {k: round(median(v), 4) for k, v in times.items()},
        "ratio_to_copy_floor": {k: round(median(v) / floor_s, 3) for k, v in times.items()},
        "variant_1_job_with_upload_s": round(job_s, 3),
        "variant_id_1": requests[1]["request"].variant_id,
    }


def variants_in_fresh_process(root: Path, setup_info: dict[str, Any], reps: int) -> dict[str, Any]:
    """:func:`measure_variants` in a new interpreter on the same storage: a restarted service."""
    info = root / "setup.json"
    info.write_text(json.dumps(setup_info))
    command = [sys.executable, "-m", "bench.universe", "variants", "--root", str(root), "--reps", str(reps)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench.universe variants failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(profile: Profile, root: Path, reps: int = 3, exactness: bool = True) -> dict[str, Any]:
    """Everything this module measures, on ``profile``'s model built under ``root``."""
    from service.models.registry import get_model

    info = setup(profile, root)
    variants = variants_in_fresh_process(root, info, reps)
    result = {k: v for k, v in info.items() if k not in ("model_dir", "names")}
    result.update({k: v for k, v in variants.items() if k != "variant_id_1"})
    if exactness:
        ctx = service_context(root)
        layout = get_model(ctx, MODEL_ID).layout
        result["float32_storage"] = float32_storage_effect(
            ctx, variants["variant_id_1"], layout, Path(info["model_dir"]), root / "out"
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.universe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", nargs="?", choices=("all", "setup", "variants"), default="all")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="100m")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--root", type=Path, help="setup: where to build and keep it; variants: the root a setup wrote")
    parser.add_argument("--out", type=Path, default=None, help="JSON output (default bench/results/universe-<profile>.json)")
    args = parser.parse_args(argv)
    set_threads()
    torch.manual_seed(0)
    if args.command == "variants":
        assert args.root is not None, "variants needs --root"
        print(json.dumps(measure_variants(args.root, json.loads((args.root / "setup.json").read_text()), args.reps)))
        return 0
    profile = PROFILES[args.profile]
    if args.command == "setup":
        assert args.root is not None, "setup needs --root"
        args.root.mkdir(parents=True, exist_ok=True)
        info = setup(profile, args.root)
        (args.root / "setup.json").write_text(json.dumps(info))
        flush_writes()
        print(json.dumps(info["universe"], indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-universe-") as tmp:
        result = measure(profile, Path(tmp), args.reps, exactness=profile is not LLAMA_1B_SLICE)
    print(json.dumps(result, indent=2))
    out = args.out or REPO / "bench" / "results" / f"universe-{args.profile}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
