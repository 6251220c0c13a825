"""Where the time goes (not part of ``make bench``; for diagnosing a failed goal).

python -m bench.profile collection [--model 100m|tiny] [--records 16]
    torch.profiler over a plain forward and over collect_statistics on the same batches;
    prints the self-CPU time per aten op side by side, and the difference.
python -m bench.profile compose [--model 100m|tiny] [--concepts 8] [--terms 1]
    cProfile of one variant build (compose_variant), top functions by own time.
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TQDM_DISABLE", "1")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench.common import LLAMA_100M, LLAMA_TINY, batches_of, build_model, counted_tokens, encode, set_threads, text_records  # noqa: E402


def _op_times(fn: Any) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}


def profile_collection(model_dir: Path, records: int, facts: int) -> None:
    from service.engine.checkpoint import inspect_model_dir, load_model, load_tokenizer
    from service.engine.collect import collect_statistics

    layout = inspect_model_dir(model_dir)
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    batches = batches_of(tokenizer, encode(tokenizer, text_records(records, facts, seed=1)))

    def forward() -> None:
        with torch.inference_mode():
            for b in batches:
                model(input_ids=b.input_ids, attention_mask=b.attention_mask)

    def collect() -> None:
        collect_statistics(model, batches, layout.layers)

    forward()  # warm-up
    fwd, col = _op_times(forward), _op_times(collect)
    print(f"{counted_tokens(batches)} tokens, {len(batches)} batches")
    print(f"{'op':48s} {'forward s':>10s} {'collect s':>10s} {'extra s':>9s}")
    for op in sorted(set(fwd) | set(col), key=lambda k: -(col.get(k, 0.0)))[:15]:
        f, c = fwd.get(op, 0.0), col.get(op, 0.0)
        print(f"{op[:48]:48s} {f:10.3f} {c:10.3f} {c - f:9.3f}")
    print(f"{'total':48s} {sum(fwd.values()):10.3f} {sum(col.values()):10.3f} {sum(col.values()) - sum(fwd.values()):9.3f}")
    per_token = {
        "forward_macs": sum(s.in_features * s.out_features for s in layout.layers),
        "covariance_macs": sum(d * d for d in dict(_groups(layout)).values()),
    }
    print(
        f"per counted token: linear-layer MACs {per_token['forward_macs'] / 1e6:.1f}M, "
        f"X^T X MACs (one full GEMM per input group) {per_token['covariance_macs'] / 1e6:.1f}M "
        f"-> {per_token['covariance_macs'] / per_token['forward_macs']:.2f}x of the linear layers"
    )


def _groups(layout: Any) -> list[tuple[str, int]]:
    """Input groups as the engine forms them: q/k/v share one input, gate/up another."""
    groups = []
    for spec in layout.layers:
        parent, _, leaf = spec.name.rpartition(".")
        key = parent + (
            ":attn_in"
            if leaf in ("q_proj", "k_proj", "v_proj")
            else ":mlp_in"
            if leaf in ("gate_proj", "up_proj")
            else ":" + leaf
        )
        groups.append((key, spec.stat_dim))
    return groups


def profile_compose(model_dir: Path, root: Path, concepts: int, terms: int, records: int, facts: int) -> None:
    from bench.compose import compose_variant
    from service.engine.checkpoint import inspect_model_dir, load_model, load_tokenizer
    from service.engine.collect import collect_statistics
    from service.engine.stats_io import save_statistics

    layout = inspect_model_dir(model_dir)
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    files = []
    for k in range(concepts):
        batches = batches_of(tokenizer, encode(tokenizer, text_records(records, facts, seed=100 + k)))
        files.append(root / f"c{k}.safetensors")
        save_statistics(collect_statistics(model, batches, layout.layers), files[-1])
    del model
    profiler = cProfile.Profile()
    profiler.enable()
    phases = compose_variant(model_dir, layout, files[:terms], files, root / "out")
    profiler.disable()
    print({k: round(v, 3) for k, v in phases.items()})
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["collection", "compose"])
    parser.add_argument("--model", choices=["tiny", "100m"], default="100m")
    parser.add_argument("--records", type=int, default=16)
    parser.add_argument("--concepts", type=int, default=8)
    parser.add_argument("--terms", type=int, default=1)
    args = parser.parse_args(argv)
    set_threads()
    profile = LLAMA_100M if args.model == "100m" else LLAMA_TINY
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        model_dir = build_model(profile, Path(tmp) / "model")
        if args.what == "collection":
            profile_collection(model_dir, args.records, profile.facts_per_record)
        else:
            profile_compose(
                model_dir, Path(tmp), args.concepts, args.terms, profile.concept_records, profile.facts_per_record
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
