"""Subprocess entry points, so each memory measurement starts from a fresh interpreter.

    python -m bench.child idle [--bare]
    python -m bench.child collect --model DIR --records N --facts F --seed S
    python -m bench.child compose --model DIR --terms F1,F2 --universe F1,F2,F3 --out DIR [--warm-terms F3]

Each prints one JSON line (last line of stdout) with its timings and its own peak RSS (VmHWM of
this process's fresh address space; see ``bench.run.run_child`` for why not ``ru_maxrss``).
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any


def _top_functions(profile: cProfile.Profile, limit: int = 12) -> list[dict[str, Any]]:
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = []
    for (file, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({func})" if line else func,
                "calls": ncalls,
                "tottime_s": round(tottime, 3),
                "cumtime_s": round(cumtime, 3),
            }
        )
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:limit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.child")
    sub = parser.add_subparsers(dest="command", required=True)
    idle = sub.add_parser("idle")
    idle.add_argument("--bare", action="store_true", help="import torch only (not transformers/the engine)")
    collect = sub.add_parser("collect")
    collect.add_argument("--model", type=Path, required=True)
    collect.add_argument("--records", type=int, required=True)
    collect.add_argument("--facts", type=int, required=True)
    collect.add_argument("--seed", type=int, default=7)
    collect.add_argument("--batch-size", type=int, default=8)
    compose = sub.add_parser("compose")
    compose.add_argument("--model", type=Path, required=True)
    compose.add_argument("--terms", required=True)
    compose.add_argument("--universe", required=True)
    compose.add_argument("--out", type=Path, required=True)
    compose.add_argument("--scaling", default="uniform")
    compose.add_argument("--profile", action="store_true", help="cProfile the compose, report top functions")
    compose.add_argument("--warm-terms", default="", help="then build a second variant of the same universe")
    args = parser.parse_args(argv)

    import torch

    from bench.common import current_rss_bytes, peak_rss_bytes, set_threads

    set_threads()
    result: dict[str, Any] = {"command": args.command}
    if args.command == "idle":
        if not args.bare:
            import transformers  # noqa: F401

            import service.engine.checkpoint  # noqa: F401
            import service.engine.collect  # noqa: F401
            import service.engine.compose  # noqa: F401
        _ = torch.zeros(1) + 1  # touch the allocator once
    elif args.command == "collect":
        from bench.common import batches_of, counted_tokens, encode, text_records
        from service.engine.checkpoint import inspect_model_dir, load_model, load_tokenizer
        from service.engine.collect import collect_statistics

        layout = inspect_model_dir(args.model)
        result["rss_before_bytes"] = current_rss_bytes()
        t0 = time.perf_counter()
        model = load_model(args.model)
        tokenizer = load_tokenizer(args.model)
        t1 = time.perf_counter()
        batches = batches_of(
            tokenizer, encode(tokenizer, text_records(args.records, args.facts, args.seed)), args.batch_size
        )
        t2 = time.perf_counter()
        stats = collect_statistics(model, batches, layout.layers)
        t3 = time.perf_counter()
        result.update(
            load_model_s=t1 - t0,
            collect_s=t3 - t2,
            tokens=counted_tokens(batches),
            stats_bytes_in_memory=sum(s.numel() * s.element_size() for s in stats.sums.values()),
        )
    else:
        import shutil

        from bench.compose import compose_variant, service_caches
        from service.engine.checkpoint import inspect_model_dir

        layout = inspect_model_dir(args.model)  # the service keeps this in the model's manifest
        caches = service_caches()  # this fresh process is a fresh worker: the caches are empty
        terms = [Path(p) for p in args.terms.split(",") if p]
        universe = [Path(p) for p in args.universe.split(",") if p]
        profile = cProfile.Profile() if args.profile else None
        result["rss_before_bytes"] = current_rss_bytes()
        if profile is not None:
            profile.enable()
        phases = compose_variant(args.model, layout, terms, universe, args.out, scaling=args.scaling, caches=caches)
        if profile is not None:
            profile.disable()
            result["top_functions"] = _top_functions(profile)
        result.update(phases)
        result["peak_rss_cold_bytes"] = peak_rss_bytes()
        result["terms"] = len(terms)
        result["universe"] = len(universe)
        result["service_caches"] = caches is not None
        if args.warm_terms:
            # a second variant of the same universe in the same worker: what the caches save
            warm_terms = [Path(p) for p in args.warm_terms.split(",") if p]
            out = args.out.with_name(args.out.name + "-warm")
            warm = compose_variant(args.model, layout, warm_terms, universe, out, scaling=args.scaling, caches=caches)
            shutil.rmtree(out, ignore_errors=True)
            result["warm"] = warm
            result["cache_bytes_after"] = [getattr(c, "bytes", None) for c in caches or ()]
    result["peak_rss_bytes"] = peak_rss_bytes()
    sys.stdout.flush()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
