"""Shared pieces of the benchmarks: model profiles, synthetic data, timing and memory helpers.

Everything here builds on the engine (``service.engine``) exactly as the service uses it; nothing
in ``service/`` is modified or monkey-patched.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

THREADS = 2


def set_threads() -> None:
    """The benchmark box has 2 cores: pin torch (intra-op) to 2 threads, inter-op to 1."""
    torch.set_num_threads(THREADS)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process
        pass


# ---------------------------------------------------------------- model profiles


@dataclass(frozen=True)
class Profile:
    """One Llama-shaped random model and the data sizes used with it."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    vocab: int
    collect_records: int  # records of the collection benchmark (text records of several facts)
    facts_per_record: int
    concept_records: int  # records of each concept used by the compose benchmarks
    compose_concepts: tuple[int, ...]  # numbers of concepts in a variant
    compose_reps: int
    collect_reps: int
    ai_collect_records: int  # records for the ai-engram collection comparison (prefix of the above)
    subsets: bool  # run the 2^n-1 subsets benchmark on this model
    subset_reps: int = 1
    kv_heads: int | None = None  # grouped-query attention (None: as many as heads)
    tied: bool = False  # lm_head shares the embedding
    dtype: str = "float32"  # the checkpoint's dtype

    @property
    def num_parameters_estimate(self) -> int:
        per_layer = 4 * self.hidden * self.hidden + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + 2 * self.vocab * self.hidden


# hidden 768, 12 layers, MLP 2048, vocab 8000, untied head: 97.3M parameters (389 MB in float32).
LLAMA_100M = Profile(
    name="llama-100m",
    hidden=768,
    layers=12,
    intermediate=2048,
    heads=12,
    vocab=8000,
    collect_records=32,
    facts_per_record=8,
    concept_records=4,
    compose_concepts=(1, 4, 8),
    compose_reps=1,
    collect_reps=3,
    ai_collect_records=32,
    subsets=False,
)

# the tests' tiny Llama shape (hidden 64, 2 layers, MLP 2x hidden)
LLAMA_TINY = Profile(
    name="llama-tiny",
    hidden=64,
    layers=2,
    intermediate=128,
    heads=4,
    vocab=512,
    collect_records=256,
    facts_per_record=8,
    concept_records=16,
    compose_concepts=(1, 4, 8),
    compose_reps=7,
    collect_reps=7,
    ai_collect_records=256,
    subsets=True,
    subset_reps=3,
)

# Llama-3.2-1B's exact shapes (hidden 2048, MLP 8192, 32 heads / 8 KV heads, vocab 128256, tied
# head, bf16) with 2 of its 16 decoder layers: 0.38B parameters here, 767 MB. Concepts of about
# 2.7k tokens each (34 records of 8 facts), the size issue 12 was measured with.
LLAMA_1B_SLICE = Profile(
    name="llama-1b-slice",
    hidden=2048,
    layers=2,
    intermediate=8192,
    heads=32,
    vocab=128256,
    collect_records=32,
    facts_per_record=8,
    concept_records=34,
    compose_concepts=(1, 3),
    compose_reps=1,
    collect_reps=1,
    ai_collect_records=32,
    subsets=False,
    kv_heads=8,
    tied=True,
    dtype="bfloat16",
)

# the same model with less data and fewer repetitions: a smoke run
LLAMA_TINY_QUICK = replace(
    LLAMA_TINY,
    collect_records=32,
    facts_per_record=4,
    concept_records=8,
    compose_reps=3,
    collect_reps=3,
    ai_collect_records=32,
    subset_reps=1,
)


def build_model(profile: Profile, path: Path, seed: int = 0) -> Path:
    """Write a random ``LlamaForCausalLM`` of ``profile`` (safetensors) with a BPE tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engram_fixtures.demo import make_facts, train_tokenizer

    corpus = [p + c for p, c in make_facts(400, seed=1000)]
    tokenizer = train_tokenizer(corpus, vocab_size=min(profile.vocab, 2048))
    config = LlamaConfig(
        vocab_size=profile.vocab,
        hidden_size=profile.hidden,
        num_hidden_layers=profile.layers,
        num_attention_heads=profile.heads,
        num_key_value_heads=profile.kv_heads or profile.heads,
        intermediate_size=profile.intermediate,
        max_position_embeddings=1024,
        tie_word_embeddings=profile.tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, profile.dtype))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the model's safetensors weights."""
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


# ---------------------------------------------------------------- data


def text_records(n: int, facts_per_record: int, seed: int) -> list[Any]:
    """``n`` text records, each ``facts_per_record`` synthetic facts (prompt + answer) in a row."""
    from engram_fixtures.demo import make_facts
    from service.engine.records import Record

    facts = make_facts(n * facts_per_record, seed=seed)
    texts = [p + c + "." for p, c in facts]
    return [Record(text=" ".join(texts[i * facts_per_record : (i + 1) * facts_per_record])) for i in range(n)]


def encode(tokenizer: Any, records: Sequence[Any], max_length: int = 512) -> list[Any]:
    from service.engine.records import encode_record

    return [encode_record(tokenizer, r, max_length) for r in records]


def batches_of(tokenizer: Any, examples: Sequence[Any], batch_size: int = 8) -> list[Any]:
    """The engine's right-padded batches (the service's default batch size is 8), materialised."""
    from service.engine.records import make_batches, pad_token_id

    return list(make_batches(examples, batch_size, pad_token_id(tokenizer)))


def counted_tokens(batches: Sequence[Any]) -> int:
    return sum(b.num_counted for b in batches)


def padded_tokens(batches: Sequence[Any]) -> int:
    return sum(int(b.input_ids.numel()) for b in batches)


# ---------------------------------------------------------------- timing


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def interleaved(
    fns: dict[str, Callable[[], Any]], reps: int, before: Callable[[], Any] | None = None
) -> dict[str, list[float]]:
    """Run every function ``reps`` times, interleaved (A B C, B C A, C A B, ...) so that slow
    phases of a noisy machine hit every contender alike; returns the seconds of each run.
    ``before`` runs, untimed, before each call (e.g. flushing the previous call's writes)."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            if before is not None:
                before()
            seconds, _ = timed(fns[name])
            times[name].append(seconds)
    return times


# ---------------------------------------------------------------- memory


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class CpuMonitor:
    """Share of the machine's CPU capacity used by *other* processes while a block ran.

    ``/proc/stat`` gives the busy time of every CPU; this process's own (and its waited-for
    children's) CPU time comes from ``os.times()``. The difference is what other tenants of the
    box used: a large share means the timings of that block were taken under contention.
    """

    def __enter__(self) -> CpuMonitor:
        self._start = (_proc_stat(), _own_cpu_s())
        self.share: float | None = None
        return self

    def __exit__(self, *exc: Any) -> None:
        (busy0, total0), own0 = self._start
        (busy1, total1), own1 = _proc_stat(), _own_cpu_s()
        if total1 <= total0:
            return
        tick = os.sysconf("SC_CLK_TCK")
        other = (busy1 - busy0) / tick - (own1 - own0)
        self.share = max(0.0, other / ((total1 - total0) / tick))


def _proc_stat() -> tuple[int, int]:
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user/nice
    return total - idle, total


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def environment() -> dict[str, Any]:
    import platform

    import safetensors
    import transformers

    try:
        import engram

        engram_version = getattr(engram, "__version__", "?")
    except ImportError:  # pragma: no cover
        engram_version = None
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "ai_engram": engram_version,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
