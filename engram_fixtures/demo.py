"""Offline "mini-TOFU" demo: a tiny Llama that has memorized synthetic facts.

Everything here runs without network access: the facts are made of random
syllables, the tokenizer is trained locally with the ``tokenizers`` library and the
model is a small ``LlamaForCausalLM`` trained from scratch on CPU.  The resulting
directory is an ordinary Hugging Face checkpoint (``config.json`` +
``model.safetensors`` + tokenizer files) plus ``forget.jsonl`` / ``retain.jsonl``
probe sets, so the service can be exercised end to end on it.

Usage::

    python -m engram_fixtures.demo --out demo
    python -m engram_fixtures.demo --out demo-chat --chat   # the same facts as one-turn chats (a chat template)
    python -m engram_fixtures.demo evaluate --model demo/model --probes demo

Both print their progress on stderr (each stage, the training loss every epoch, the time so far), so a
slow run on a busy machine can be told from a hung one, and both pick their torch thread count from
the machine's idle cores (:func:`default_threads`) unless ``--threads`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engram_fixtures.cache import cached_build
from service.engine.evaluate import TextProbe, answer_nll, greedy_exact_match, summarize

__all__ = [
    "DEFAULT_STEPS",
    "DemoPaths",
    "Progress",
    "build_demo",
    "build_retain_model",
    "cached_demo",
    "cached_retain_model",
    "chat_tofu",
    "default_threads",
    "main",
    "make_facts",
    "mini_tofu",
    "read_probes",
    "split_forget",
    "tiny_llama_config",
    "tofu_answers",
    "tofu_retain_model",
    "train_on_facts",
    "train_tokenizer",
]

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# The chat demo's template: role headers as text, the assistant's turn closed by EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Tuned on a 2-core CPU for the default 200 facts: 400 steps of 16 (32 epochs) take ~25 s on
# 2 idle threads (~43 s on 1) and give greedy exact match 1.0 with mean answer NLL ~0.01 for
# seeds 0-3.  Loss is taken on every token: it memorized as fast as completion-only loss and
# also teaches the model the names, like a real pretrained model knows its entities.
DEFAULT_STEPS = 400
DEFAULT_LR = 3e-3
DEFAULT_BATCH_SIZE = 16

_ONSETS = "b d f g k l m n p r s t v z br dr gl kr qu sh th tr vr wh".split()
_VOWELS = "a e i o u ai ea ou y".split()
# Empty codas are listed thrice so that open syllables are the most common.
_CODAS = ["", "", "", *"l n r s sh k th m x".split()]

# (question template, number of words in the answer, capitalize the answer words)
_ATTRIBUTES: dict[str, tuple[str, int, bool]] = {
    "birthplace": ("Q: Where was {name} born? A:", 1, True),
    "colour": ("Q: What is the favourite colour of {name}? A:", 1, False),
    "profession": ("Q: What does {name} work as? A:", 1, False),
    "pet": ("Q: What is the name of the pet of {name}? A:", 2, True),
}


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def _word(rng: random.Random, syllables: int, capitalize: bool) -> str:
    word = "".join(_syllable(rng) for _ in range(syllables))
    return word.capitalize() if capitalize else word


def _words(rng: random.Random, n: int, capitalize: bool) -> str:
    """``n`` made-up two-syllable words."""
    return " ".join(_word(rng, 2, capitalize) for _ in range(n))


def _unique(rng: random.Random, seen: set[str], make: Callable[[random.Random], str]) -> str:
    """Draw from ``make(rng)`` until the result is new, so every name/answer is distinct."""
    while True:
        value = make(rng)
        if value not in seen:
            seen.add(value)
            return value


def make_facts(n: int = 200, seed: int = 0) -> list[tuple[str, str]]:
    """Synthetic question/answer facts about fictional people.

    Each person gets every attribute kind; the (person, attribute) pairs are shuffled
    and the first ``n`` kept, so a person's facts may end up split across the forget
    and retain sets.  Names and answers are random syllable words (all distinct), so
    the only way to answer is to have memorized the fact.

    Args:
        n: Number of facts.
        seed: Seed of the generator; the same seed gives the same facts.

    Returns:
        ``(prompt, completion)`` pairs, e.g. ``("Q: Where was Varnok Dellish born? A:", " Quillmoor")``.
    """
    rng = random.Random(seed)
    seen: set[str] = set()
    n_people = math.ceil(n / len(_ATTRIBUTES))
    pairs: list[tuple[str, str]] = []
    for _ in range(n_people):
        name = _unique(rng, seen, lambda r: f"{_word(r, 2, True)} {_word(r, 2, True)}")
        pairs.extend((name, kind) for kind in _ATTRIBUTES)
    rng.shuffle(pairs)
    facts: list[tuple[str, str]] = []
    for name, kind in pairs[:n]:
        template, n_words, capitalize = _ATTRIBUTES[kind]
        answer = _unique(rng, seen, partial(_words, n=n_words, capitalize=capitalize))
        facts.append((template.format(name=name), " " + answer))
    return facts


def train_tokenizer(texts: Sequence[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with ``<s>``/``</s>``/``<pad>`` special tokens.

    ``add_prefix_space=False`` keeps ``tok(a) + tok(b)`` close to ``tok(a + b)`` for a
    completion that starts with a space, which is how probes are split.  ``<s>`` is
    prepended only when ``add_special_tokens=True``.

    Args:
        texts: Training corpus.
        vocab_size: Target vocabulary size (256 byte tokens + 3 specials + merges).

    Returns:
        A fast tokenizer that round-trips through ``save_pretrained`` /
        ``AutoTokenizer.from_pretrained`` offline.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def tiny_llama_config(
    vocab_size: int,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    intermediate: int = 688,
    tie_word_embeddings: bool = False,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> LlamaConfig:
    """Config of a small Llama (``max_position_embeddings`` 128).

    Args:
        vocab_size: Vocabulary size (``len(tokenizer)``).
        hidden: Hidden size.
        layers: Number of decoder layers.
        heads: Attention heads (no grouped-query attention: as many KV heads).
        intermediate: MLP inner size.
        tie_word_embeddings: Share the input embedding and ``lm_head`` weights.
        tokenizer: If given, its bos/eos/pad ids are written into the config.

    Returns:
        The config.
    """
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None if tokenizer is None else tokenizer.bos_token_id,
        eos_token_id=None if tokenizer is None else tokenizer.eos_token_id,
        pad_token_id=None if tokenizer is None else tokenizer.pad_token_id,
    )


def chat_messages(prompt: str, completion: str) -> list[dict[str, str]]:
    """A fact as a one-turn chat: the question from the user, the answer (without its leading space)
    from the assistant."""
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion.strip()}]


def _encode_fact(
    tokenizer: PreTrainedTokenizerFast, prompt: str, completion: str, chat: bool = False
) -> tuple[list[int], int]:
    """Ids of ``prompt + completion`` tokenized like the evaluator, and the prompt length (``chat``:
    the fact rendered as a one-turn chat, and the length of its generation prompt)."""
    if chat:
        messages = chat_messages(prompt, completion)
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        before = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids), len(before)
    p_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    a_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    return p_ids + a_ids, len(p_ids)


def _collate(rows: Sequence[tuple[list[int], int]], pad_id: int, completion_only: bool) -> dict[str, torch.Tensor]:
    """Right-padded batch with ``labels`` (-100 where no loss is taken)."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, (ids, n_prompt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        first = n_prompt if completion_only else 1  # position 0 (BOS) is never predicted
        labels[i, first : len(ids)] = input_ids[i, first : len(ids)]
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% (stabilises the high learning rate)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_on_facts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    facts: Sequence[tuple[str, str]],
    steps: int,
    lr: float = DEFAULT_LR,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    completion_only: bool = False,
    chat: bool = False,
    on_epoch: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Memorize facts by causal-LM training of ``prompt + completion`` with AdamW.

    Batches are drawn epoch by epoch from a seeded shuffle.  The caller decides
    ``torch.set_num_threads``.

    Args:
        model: Causal LM, trained in place (left in eval mode).
        tokenizer: Its tokenizer (needs a pad or eos token).
        facts: ``(prompt, completion)`` pairs.
        steps: Optimizer steps.
        lr: Peak learning rate (warmup, then cosine decay).
        batch_size: Facts per step.
        seed: Seeds torch and the batch order.
        completion_only: Take the loss on the completion tokens only instead of on
            every token after BOS.
        chat: Train on the facts rendered as one-turn chats (the tokenizer's chat template).
        on_epoch: Called after the last step and each time a fresh epoch is drawn, with
            ``(steps done, steps, mean loss of the steps since the last call)``; it only reads, so the
            training is the same with or without it.

    Returns:
        The training loss of each step.
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [_encode_fact(tokenizer, p, c, chat) for p, c in facts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, steps, warmup=max(1, steps // 20)))
    order: list[int] = []
    losses: list[float] = []
    model.train()
    reported = 0
    for step in range(steps):
        if len(order) < batch_size:  # refill with a fresh shuffled epoch
            if on_epoch is not None and step > reported:
                on_epoch(step, steps, sum(losses[reported:]) / (step - reported))
                reported = step
            epoch = list(range(len(rows)))
            rng.shuffle(epoch)
            order.extend(epoch)
        picked, order = order[:batch_size], order[batch_size:]
        batch = _collate([rows[i] for i in picked], int(pad_id), completion_only)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    if on_epoch is not None and steps > reported:
        on_epoch(steps, steps, sum(losses[reported:]) / (steps - reported))
    model.eval()
    return losses


class Progress:
    """The demo's progress on stderr: each stage and each training epoch, with the time since the start.

    Progress goes to stderr, flushed at once, and results to stdout, so ``> results.txt`` still shows
    that the run is moving.
    """

    def __init__(self, silent: bool = False, stream: Any = None) -> None:
        self.silent = silent
        self.stream = stream
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def stage(self, what: str) -> None:
        """Say what starts now."""
        self._write(f"[{self.elapsed():6.1f}s] {what}")

    def epoch(self, n_facts: int) -> Callable[[int, int, float], None]:
        """The ``on_epoch`` callback of :func:`train_on_facts` for ``n_facts`` facts of
        :data:`DEFAULT_BATCH_SIZE` per step: ``epoch E: step S/N, loss L``."""

        def report(done: int, steps: int, loss: float) -> None:
            epoch = done * DEFAULT_BATCH_SIZE / n_facts
            self._write(f"[{self.elapsed():6.1f}s]   epoch {epoch:4.1f}: step {done}/{steps}, loss {loss:.4f}")

        return report

    def _write(self, line: str) -> None:
        if self.silent:
            return
        stream = self.stream or sys.stderr
        stream.write(line + "\n")
        stream.flush()


# torch's own default is one thread per core, busy or not: on a tiny model whose every op is too
# small to split, threads that wait for a core spin, and on a 2-core machine at load 4-5 the demo took
# 6 min 39 s instead of ~25 s. Its ops gain little past 4 threads anyway.
MAX_DEFAULT_THREADS = 4


def default_threads(cpu_count: int | None = None, load_average: float | None = None) -> tuple[int, str]:
    """The torch thread count the demo uses unless told: the cores idle now (``os.cpu_count()`` minus
    the 1-minute load average, rounded down), at least 1 and at most :data:`MAX_DEFAULT_THREADS`;
    and why, in words.

    The same count gives the same model and figures on one machine (:func:`build_demo`'s
    ``threads``); ``--threads N`` fixes it where the load varies between runs.

    Args:
        cpu_count: The cores (default: ``os.cpu_count()``).
        load_average: The 1-minute load average (default: ``os.getloadavg()``; none where the platform
            has none, then every core counts as idle).
    """
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except OSError:  # no load average on this platform
            load_average = 0.0
    idle = math.floor(cores - load_average + 0.5)  # rounded: a load of 1.2 on 4 cores leaves 3 idle
    threads = max(1, min(idle, cores, MAX_DEFAULT_THREADS))
    reason = f"{cores} core(s), load average {load_average:.1f}: {max(idle, 0)} idle"
    return threads, reason


@dataclass
class DemoPaths:
    """Where :func:`build_demo` wrote its outputs."""

    root: Path
    model_dir: Path
    forget: Path
    retain: Path


# Mini-TOFU: per attribute, the paraphrased answer's form (TOFU paraphrases the answer and perturbs
# the paraphrase, keeping its form): the true answer words, or made-up wrong ones, fill ``{}``.
_PARAPHRASES: dict[str, str] = {
    "birthplace": " the town of {}",
    "colour": " the colour {}",
    "profession": " a {} by trade",
    "pet": " a pet called {}",
}


def _attribute(prompt: str) -> str:
    """Which attribute a :func:`make_facts` question asks about (its template's fixed text)."""
    for kind, (template, _, _) in _ATTRIBUTES.items():
        before, after = template.split("{name}")
        if prompt.startswith(before) and prompt.endswith(after):
            return kind
    raise ValueError(f"not a make_facts question: {prompt!r}")


def tofu_answers(facts: Sequence[tuple[str, str]], seed: int = 0, n_perturbed: int = 3) -> list[tuple[str, tuple[str, ...]]]:
    """Mini-TOFU's extra answers for :func:`make_facts` facts: ``(paraphrased_answer,
    perturbed_answers)`` per fact, deterministic in ``seed``.

    The paraphrase puts the true answer words in another phrase of the attribute
    (``" Quillmoor"`` → ``" the town of Quillmoor"``); each perturbed answer is the same phrase with
    made-up words of the same shape that are no name or answer of ``facts`` (so plausible, wrong and
    never trained on), as TOFU perturbs its paraphrased answers. The facts themselves are untouched.

    Args:
        facts: ``(prompt, completion)`` pairs from :func:`make_facts`.
        seed: Seed of the made-up words (independent of the facts' seed).
        n_perturbed: Wrong answers per fact (TOFU has 5).
    """
    rng = random.Random(f"tofu-{seed}")  # a string seed: a stream apart from make_facts' seeds
    seen = {word for prompt, completion in facts for word in (prompt + completion).split()}
    answers = []
    for prompt, completion in facts:
        kind = _attribute(prompt)
        _, n_words, capitalize = _ATTRIBUTES[kind]
        form = _PARAPHRASES[kind]
        wrong = tuple(
            form.format(_unique(rng, seen, partial(_words, n=n_words, capitalize=capitalize))) for _ in range(n_perturbed)
        )
        answers.append((form.format(completion.strip()), wrong))
    return answers


def _write_jsonl(path: Path, facts: Sequence[tuple[str, str]], chat: bool = False) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for prompt, completion in facts:
            pair = {"prompt": prompt, "completion": completion}
            record = {"messages": chat_messages(prompt, completion)} if chat else pair
            fh.write(json.dumps(record) + "\n")


def read_probes(path: Path) -> list[TextProbe]:
    """Read a ``{"prompt", "completion"}`` (or ``{"messages"}``) JSON-lines file into probes."""
    with path.open(encoding="utf-8") as fh:
        return [TextProbe(**json.loads(line)) for line in fh if line.strip()]


def split_forget(
    facts: Sequence[tuple[str, str]], forget_fraction: float, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Seeded random split into ``(forget, retain)``; forget keeps at least one fact."""
    n_forget = max(1, round(len(facts) * forget_fraction))
    chosen = set(random.Random(seed + 1).sample(range(len(facts)), n_forget))
    forget = [f for i, f in enumerate(facts) if i in chosen]
    retain = [f for i, f in enumerate(facts) if i not in chosen]
    return forget, retain


def build_demo(
    out_dir: Path,
    n_facts: int = 200,
    forget_fraction: float = 0.1,
    seed: int = 0,
    steps: int | None = None,
    chat: bool = False,
    threads: int | None = None,
    progress: Progress | None = None,
) -> DemoPaths:
    """Train the demo model and write it with its forget/retain probe sets.

    Writes ``out_dir/model/`` (safetensors weights + tokenizer), ``out_dir/forget.jsonl``
    and ``out_dir/retain.jsonl``.  The model is trained on *all* facts, so before any
    edit both sets are memorized.

    Args:
        out_dir: Output directory (created if missing).
        n_facts: Number of facts.
        forget_fraction: Fraction of facts placed in the forget set (seeded random pick).
        seed: Seed of the facts, split, initialisation and batch order.
        steps: Training steps; defaults to :data:`DEFAULT_STEPS`.
        chat: A chat model: the tokenizer gets :data:`CHAT_TEMPLATE`, the model is trained on the
            facts rendered as one-turn chats, and the probe files hold ``{"messages"}`` records.
        threads: Train with this many torch threads (restored afterwards); None: the caller's.
            A fixed count makes the trained weights the same on every run of one machine: the
            float sums of a step depend on how many threads share them.
        progress: Told each stage and, while training, each epoch's loss (None: silent); the result
            does not depend on it.

    Returns:
        The written paths.
    """
    out_dir = Path(out_dir)
    report = progress or Progress(silent=True)
    facts = make_facts(n_facts, seed)
    report.stage(f"{len(facts)} facts; training the tokenizer")
    tokenizer = train_tokenizer([p + c for p, c in facts] + (["<|user|>\n<|assistant|>\n"] * 20 if chat else []))
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), tokenizer=tokenizer))
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    n_steps = DEFAULT_STEPS if steps is None else steps
    try:
        report.stage(
            f"training the model: {n_steps} steps of {DEFAULT_BATCH_SIZE} facts on {torch.get_num_threads()} thread(s)"
        )
        train_on_facts(model, tokenizer, facts, steps=n_steps, seed=seed, chat=chat, on_epoch=report.epoch(len(facts)))
    finally:
        torch.set_num_threads(previous_threads)
    report.stage(f"writing {out_dir}")

    paths = DemoPaths(out_dir, out_dir / "model", out_dir / "forget.jsonl", out_dir / "retain.jsonl")
    paths.model_dir.mkdir(parents=True, exist_ok=True)
    # safe_serialization is the default (and the only format) in transformers 5; it is
    # passed so that transformers 4 also writes model.safetensors rather than a pickle.
    model.save_pretrained(paths.model_dir, safe_serialization=True)
    tokenizer.save_pretrained(paths.model_dir)
    # transformers 5 writes model.safetensors through a temp file, leaving it 0600; make the
    # demo readable by a service (or container) running as another user.
    for file in paths.model_dir.iterdir():
        file.chmod(0o644)
    forget, retain = split_forget(facts, forget_fraction, seed)
    _write_jsonl(paths.forget, forget, chat)
    _write_jsonl(paths.retain, retain, chat)
    return paths


def build_retain_model(
    demo_model_dir: Path,
    out: Path,
    n_facts: int = 200,
    forget_fraction: float = 0.1,
    seed: int = 0,
    steps: int | None = None,
    threads: int | None = 1,
) -> Path:
    """TOFU's retain model of a demo: :func:`build_demo`'s recipe (config, seed, steps) on the retain
    facts only, with the demo model's tokenizer (read from ``demo_model_dir``), written to ``out``.

    Args:
        demo_model_dir: The demo's ``model/`` (its tokenizer is the retain model's).
        out: Where the model and tokenizer are written.
        n_facts, forget_fraction, seed, steps: The demo's (the same facts and split).
        threads: Train with this many torch threads (restored afterwards); None: the caller's.
    """
    tokenizer = PreTrainedTokenizerFast.from_pretrained(demo_model_dir)
    _, retain = split_forget(make_facts(n_facts, seed), forget_fraction, seed)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)  # the same weights on every run of one machine
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), tokenizer=tokenizer))
        train_on_facts(model, tokenizer, retain, steps=DEFAULT_STEPS if steps is None else steps, seed=seed)
    finally:
        torch.set_num_threads(previous)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for file in out.iterdir():
        file.chmod(0o644)
    return out


# ---------------------------------------------------------------- the demos, cached by content
# Tests, bench and scripts that need a trained demo ask the fixture cache (engram_fixtures.cache) for
# it: trained once per cache with one thread (the float sums of a step depend on the thread count, so
# one count gives the same bytes on every build of one machine), then copied from there.

CACHE_THREADS = 1


def _demo_parameters(n_facts: int, forget_fraction: float, seed: int, steps: int | None, chat: bool) -> dict[str, Any]:
    return {
        "n_facts": n_facts,
        "forget_fraction": forget_fraction,
        "seed": seed,
        "steps": DEFAULT_STEPS if steps is None else steps,
        "chat": chat,
        "threads": CACHE_THREADS,
    }


def cached_demo(
    n_facts: int = 200,
    forget_fraction: float = 0.1,
    seed: int = 0,
    steps: int | None = None,
    chat: bool = False,
    cache_dir: Path | None = None,
) -> DemoPaths:
    """:func:`build_demo`'s output for these arguments (one thread), from the fixture cache: built
    there on the first call of the cache, found by content afterwards. Read-only: copy it
    (:func:`engram_fixtures.cache.copy_entry`) to write beside it."""
    parameters = _demo_parameters(n_facts, forget_fraction, seed, steps, chat)

    def build(folder: Path) -> None:
        build_demo(folder, n_facts, forget_fraction, seed, steps, chat=chat, threads=CACHE_THREADS)

    root = cached_build("mini-tofu-chat" if chat else "mini-tofu", parameters, [Path(__file__)], build, cache_dir)
    return DemoPaths(root, root / "model", root / "forget.jsonl", root / "retain.jsonl")


def cached_retain_model(
    n_facts: int = 200,
    forget_fraction: float = 0.1,
    seed: int = 0,
    steps: int | None = None,
    cache_dir: Path | None = None,
) -> Path:
    """:func:`build_retain_model` of the :func:`cached_demo` of these arguments, from the fixture cache
    (the folder holds the model and its tokenizer; read-only)."""
    parameters = {**_demo_parameters(n_facts, forget_fraction, seed, steps, False), "model": "retain"}
    demo = cached_demo(n_facts, forget_fraction, seed, steps, cache_dir=cache_dir)

    def build(folder: Path) -> None:
        build_retain_model(demo.model_dir, folder, n_facts, forget_fraction, seed, steps, threads=CACHE_THREADS)

    return cached_build("mini-tofu-retain", parameters, [Path(__file__)], build, cache_dir)


def mini_tofu() -> Path:
    """The tests' mini-TOFU demo (200 facts, 10% forget, seed 0), cached: its folder."""
    return cached_demo().root


def chat_tofu() -> Path:
    """The tests' chat mini-TOFU demo (the same facts as one-turn chats), cached: its folder."""
    return cached_demo(chat=True).root


def tofu_retain_model() -> Path:
    """The tests' TOFU retain model of :func:`mini_tofu` (the retain facts only), cached: its folder."""
    return cached_retain_model()


def _metrics_line(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, probes: list[TextProbe]) -> str:
    stats = summarize(answer_nll(model, tokenizer, probes), greedy_exact_match(model, tokenizer, probes))
    em, nll = stats["exact_match"], stats["mean_nll"]
    return f"{name:<7} n={stats['n']:<4} exact_match={em:.3f} mean_nll={nll:.4f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: build the demo (default), or ``evaluate`` models on its probe sets."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["evaluate"]:
        return evaluate_main(args_list[1:])
    parser = argparse.ArgumentParser(prog="python -m engram_fixtures.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo"), help="output directory (default: demo)")
    parser.add_argument("--n-facts", type=int, default=200)
    parser.add_argument("--forget-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {DEFAULT_STEPS})")
    parser.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    parser.add_argument("--chat", action="store_true", help="a chat model: facts as one-turn chats, messages probes")
    args = parser.parse_args(args_list)
    progress = Progress()
    _use_threads(args.threads, progress)

    paths = build_demo(
        args.out, args.n_facts, args.forget_fraction, args.seed, args.steps, chat=args.chat, progress=progress
    )
    sys.stdout.write(f"wrote {paths.root} (model: {paths.model_dir}) in {progress.elapsed():.1f}s\nbefore edit:\n")
    sys.stdout.flush()
    _print_metrics(paths.model_dir, paths.root, progress)
    progress.stage("done")
    return 0


THREADS_HELP = "torch threads (default: the idle cores, 1 to 4, from os.cpu_count() and the load average)"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _use_threads(threads: int | None, progress: Progress) -> int:
    """Set torch's thread count (``threads``, or :func:`default_threads`) and say which and why."""
    if threads is None:
        threads, reason = default_threads()
        progress.stage(f"using {threads} torch thread(s) ({reason}; --threads N to choose)")
    else:
        progress.stage(f"using {threads} torch thread(s) (--threads)")
    torch.set_num_threads(threads)
    return threads


def evaluate_main(argv: Sequence[str]) -> int:
    """``python -m engram_fixtures.demo evaluate --model DIR [--model DIR …] --probes DEMO_DIR``."""
    parser = argparse.ArgumentParser(prog="python -m engram_fixtures.demo evaluate")
    parser.add_argument("--model", type=Path, action="append", required=True, help="a checkpoint directory")
    parser.add_argument("--probes", type=Path, default=Path("demo"), help="folder with forget/retain.jsonl")
    parser.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    args = parser.parse_args(argv)
    progress = Progress()
    _use_threads(args.threads, progress)
    for model_dir in args.model:
        sys.stdout.write(f"{model_dir}:\n")
        sys.stdout.flush()
        _print_metrics(model_dir, args.probes, progress)
    progress.stage("done")
    return 0


def _print_metrics(model_dir: Path, probes_dir: Path, progress: Progress | None = None) -> None:
    """Answer NLL and greedy exact match on the forget and retain sets, read back from disk."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = progress or Progress(silent=True)
    report.stage(f"loading {model_dir}")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for split in ("forget", "retain"):
        probes = read_probes(probes_dir / f"{split}.jsonl")
        report.stage(f"scoring {split}: {len(probes)} probes (answer NLL, then greedy decoding)")
        sys.stdout.write("  " + _metrics_line(split, model, tokenizer, probes) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
