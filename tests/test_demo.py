"""Tests of the offline tiny-model toolkit: facts, tokenizer, evaluation and fixtures."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.pytorch_utils import Conv1D

from engram_fixtures import demo
from engram_fixtures.demo import build_demo, make_facts, read_probes, tiny_llama_config, train_on_facts, train_tokenizer
from engram_fixtures.models import make_tiny_bert, make_tiny_gpt2, make_tiny_llama, make_tokenizer
from service.engine.evaluate import TextProbe, answer_nll, greedy_exact_match, greedy_tokens, summarize

PROBES = [
    TextProbe("Q: Where was Kuguk Vringem born?", " Kruxgyr"),
    TextProbe("Paris is the capital of", " France."),
    TextProbe("The", " quick brown fox jumps over the lazy dog."),
    TextProbe("Q: What does Kuguk Vringem work as? A:", " vathdrail"),
    TextProbe("Water", " boils"),
]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Run these tiny models on one thread.

    With hidden sizes of 32-64 each op is too small to split, and on a busy 2-core
    machine OpenMP's spinning threads made the training test ~10x slower (25 s vs 2 s).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama"), hidden=32, layers=2, seed=0)


@pytest.fixture(scope="module")
def llama(llama_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return AutoModelForCausalLM.from_pretrained(llama_dir), AutoTokenizer.from_pretrained(llama_dir)


def _reference_nll(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, probe: TextProbe) -> float:
    """Unbatched, unpadded NLL computed independently of the library code."""
    p_ids = tokenizer(probe.prompt, add_special_tokens=True)["input_ids"]
    a_ids = tokenizer(probe.completion, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([p_ids + a_ids])).logits[0]
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    total = sum(-logprobs[len(p_ids) + k - 1, tok].item() for k, tok in enumerate(a_ids))
    return total / len(a_ids)


def _reference_greedy(model: PreTrainedModel, ids: list[int], n: int) -> list[int]:
    """Unbatched greedy continuation, one full forward pass per token."""
    ids = list(ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
    return out


# --- facts -----------------------------------------------------------------------------------------


def test_make_facts_is_deterministic_and_seed_dependent() -> None:
    assert make_facts(60, seed=3) == make_facts(60, seed=3)
    assert make_facts(60, seed=3) != make_facts(60, seed=4)
    assert len(make_facts(7, seed=3)) == 7


def test_make_facts_are_unique_and_well_formed() -> None:
    facts = make_facts(200, seed=0)
    assert len(facts) == 200
    prompts = [p for p, _ in facts]
    answers = [c for _, c in facts]
    assert len(set(prompts)) == 200, "each (person, attribute) pair must appear once"
    assert len(set(answers)) == 200, "answers must be distinct so they have to be memorized"
    for prompt, completion in facts:
        assert prompt.startswith("Q: ")
        assert prompt.endswith(" A:")
        assert completion.startswith(" ")
        assert not completion.startswith("  ")
        assert 1 <= len(completion.split()) <= 3


# --- tokenizer -------------------------------------------------------------------------------------


def test_tokenizer_roundtrips_and_prepends_bos(tmp_path: Path) -> None:
    tok = train_tokenizer([p + c for p, c in make_facts(40)], vocab_size=300)
    text = "Q: Where was Varnok Dellish born? A: Quillmoor"
    plain = tok(text, add_special_tokens=False)["input_ids"]
    with_bos = tok(text)["input_ids"]
    assert with_bos == [tok.bos_token_id, *plain]
    assert tok.decode(plain) == text
    assert tok.decode(tok(" émigré 42!", add_special_tokens=False)["input_ids"]) == " émigré 42!"
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert len(tok) == 300

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == with_bos
    assert loaded.pad_token_id == tok.pad_token_id


# --- evaluation ------------------------------------------------------------------------------------


def test_answer_nll_is_padding_invariant(llama: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tok = llama
    one = answer_nll(model, tok, PROBES, batch_size=1)
    many = answer_nll(model, tok, PROBES, batch_size=16)
    two = answer_nll(model, tok, PROBES, batch_size=2)
    assert len(one) == len(PROBES)
    assert many == pytest.approx(one, abs=1e-4)
    assert two == pytest.approx(one, abs=1e-4)


def test_answer_nll_matches_direct_computation(llama: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tok = llama
    expected = [_reference_nll(model, tok, p) for p in PROBES]
    assert answer_nll(model, tok, PROBES) == pytest.approx(expected, abs=1e-4)
    # A random model over ~300 tokens is close to uniform: NLL near log(vocab).
    assert all(4.0 < x < 8.0 for x in expected)


def test_greedy_tokens_match_unbatched_decoding(llama: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    """Batched, right-padded decoding must reproduce unbatched greedy decoding token for token."""
    model, tok = llama
    expected = [
        _reference_greedy(
            model,
            tok(p.prompt)["input_ids"],
            len(tok(p.completion, add_special_tokens=False)["input_ids"]),
        )
        for p in PROBES
    ]
    assert greedy_tokens(model, tok, PROBES, batch_size=16) == expected
    assert greedy_tokens(model, tok, PROBES, batch_size=2) == expected
    assert [len(x) for x in greedy_tokens(model, tok, PROBES, max_new_tokens=2)] == [min(2, len(e)) for e in expected]


def test_greedy_exact_match_compares_token_ids(llama: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tok = llama
    # The random model does not produce the real answers.
    assert greedy_exact_match(model, tok, PROBES) == [False] * len(PROBES)
    # It does "know" its own first greedy token: a one-token cap compares just that.
    first = [_reference_greedy(model, tok(p.prompt)["input_ids"], 1)[0] for p in PROBES]
    own = [TextProbe(p.prompt, tok.decode([t])) for p, t in zip(PROBES, first, strict=True)]
    own = [p for p, t in zip(own, first, strict=True) if tok(p.completion, add_special_tokens=False)["input_ids"][0] == t]
    assert own, "no re-tokenizable first token to test with"
    assert greedy_exact_match(model, tok, own, max_new_tokens=1) == [True] * len(own)


def test_training_memorizes_a_few_facts() -> None:
    facts = make_facts(10, seed=5)
    tok = train_tokenizer([p + c for p, c in facts], vocab_size=300)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(tok), hidden=64, layers=2, intermediate=128, tokenizer=tok))
    probes = [TextProbe(p, c) for p, c in facts]
    before = summarize(answer_nll(model, tok, probes), greedy_exact_match(model, tok, probes))

    losses = train_on_facts(model, tok, facts, steps=150, lr=3e-3, batch_size=10, seed=0)

    after = summarize(answer_nll(model, tok, probes), greedy_exact_match(model, tok, probes))
    assert len(losses) == 150
    assert losses[-1] < losses[0] / 5
    assert before["exact_match"] == 0.0
    assert after["exact_match"] == 1.0
    assert after["mean_nll"] < 0.3 < before["mean_nll"]
    assert after["n"] == 10


def test_summarize() -> None:
    stats = summarize([1.0, 2.0, 3.0, 2.0], [True, False, True, True])
    assert stats == {"mean_nll": 2.0, "exact_match": 0.75, "n": 4}
    with pytest.raises(ValueError, match="differ in length"):
        summarize([1.0], [])


def test_empty_completion_is_rejected(llama: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tok = llama
    with pytest.raises(ValueError, match="completion"):
        answer_nll(model, tok, [TextProbe("Q:", "")])


# --- demo builder ----------------------------------------------------------------------------------


def test_build_demo_writes_safetensors_and_split(tmp_path: Path) -> None:
    # Two steps only: this checks the files, not the memorization (see the README demo for that).
    paths = build_demo(tmp_path / "demo", n_facts=20, forget_fraction=0.1, seed=1, steps=2)
    files = {p.name for p in paths.model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert not any(name.endswith((".bin", ".pt", ".pkl", ".pth")) for name in files)
    assert (paths.model_dir / "model.safetensors").stat().st_mode & 0o777 == 0o644
    forget, retain = read_probes(paths.forget), read_probes(paths.retain)
    assert (len(forget), len(retain)) == (2, 18)
    everything = {(p.prompt, p.completion) for p in forget + retain}
    assert everything == set(make_facts(20, seed=1))
    first = json.loads(paths.forget.read_text().splitlines()[0])
    assert set(first) == {"prompt", "completion"}


# --- fixtures --------------------------------------------------------------------------------------


def _assert_safetensors_only(path: Path) -> None:
    names = {p.name for p in path.iterdir()}
    assert "model.safetensors" in names
    assert not any(name.endswith((".bin", ".pt", ".pkl", ".pth")) for name in names)


@pytest.mark.parametrize("tie", [False, True])
def test_make_tiny_llama_loads(tmp_path: Path, tie: bool) -> None:
    path = make_tiny_llama(tmp_path, tie_word_embeddings=tie)
    _assert_safetensors_only(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama"
    assert model.config.hidden_size == 32
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tie
    out = model(**tok(["Paris is", "The cat sat on"], return_tensors="pt", padding=True))
    assert out.logits.shape[-1] == len(tok)
    # Same seed, same weights.
    again = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "again", tie_word_embeddings=tie))
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


def test_make_tiny_gpt2_loads(tmp_path: Path) -> None:
    path = make_tiny_gpt2(tmp_path)
    _assert_safetensors_only(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "gpt2"
    assert isinstance(model.transformer.h[0].mlp.c_fc, Conv1D)
    assert model.transformer.h[0].mlp.c_fc.bias is not None
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert len(answer_nll(model, tok, PROBES[:2])) == 2


def test_make_tiny_bert_loads(tmp_path: Path) -> None:
    path = make_tiny_bert(tmp_path)
    _assert_safetensors_only(path)
    model = AutoModelForMaskedLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "bert"
    dense = model.bert.encoder.layer[0].intermediate.dense
    assert isinstance(dense, torch.nn.Linear)
    assert dense.bias is not None
    enc = tok(["Paris is the capital of [MASK].", "Hi"], return_tensors="pt", padding=True)
    assert enc["input_ids"][0, 0].item() == tok.cls_token_id
    assert tok.pad_token_id is not None
    assert tok.mask_token_id in enc["input_ids"][0].tolist()
    assert model(**enc).logits.shape[:2] == enc["input_ids"].shape


def test_make_tokenizer_default() -> None:
    tok = make_tokenizer()
    assert len(tok) == 300
    assert tok("hello")["input_ids"][0] == tok.bos_token_id


# --- the demo's command line: progress and its thread count (issue 28) ------------------------------


@pytest.mark.parametrize(
    ("cores", "load", "threads"),
    [(2, 0.0, 2), (2, 4.6, 1), (2, 1.4, 1), (8, 1.2, 4), (16, 2.0, 4), (4, 1.6, 2), (1, 0.0, 1)],
)
def test_default_threads_are_the_idle_cores_from_1_to_4(cores: int, load: float, threads: int) -> None:
    chosen, reason = demo.default_threads(cores, load)
    assert chosen == threads
    assert f"{cores} core(s)" in reason and f"load average {load:.1f}" in reason


def test_default_threads_reads_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (4.7, 3.0, 2.0))
    assert demo.default_threads() == (1, "2 core(s), load average 4.7: 0 idle")


def test_epoch_reports_leave_the_training_unchanged() -> None:
    """The progress callback reads the losses: the same seed trains the same model with or without it."""
    facts = make_facts(12, seed=2)
    tok = train_tokenizer([p + c for p, c in facts], vocab_size=300)
    config = tiny_llama_config(len(tok), hidden=32, layers=1, intermediate=64, tokenizer=tok)
    reports: list[tuple[int, int, float]] = []
    trained = []
    for on_epoch in (None, lambda *report: reports.append(report)):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        losses = train_on_facts(model, tok, facts, steps=7, batch_size=5, seed=0, on_epoch=on_epoch)
        trained.append((losses, model.state_dict()))
    (plain, plain_weights), (reported, reported_weights) = trained
    assert plain == reported
    assert all(torch.equal(plain_weights[k], reported_weights[k]) for k in plain_weights)
    # 12 facts, 5 a step: a fresh epoch is drawn before steps 2, 4 and 7 (12 -> 7 -> 2 -> 14 ...), and the end.
    assert [(done, steps) for done, steps, _ in reports] == [(2, 7), (4, 7), (7, 7)]
    assert reports[0][2] == pytest.approx(sum(plain[:2]) / 2)
    assert reports[-1][2] == pytest.approx(sum(plain[4:]) / 3)


def test_the_demo_says_its_threads_and_progress_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (9.0, 9.0, 9.0))  # a busy machine: 1 thread
    assert demo.main(["--out", str(tmp_path / "demo"), "--n-facts", "20", "--steps", "4"]) == 0
    out, err = capsys.readouterr()
    assert "using 1 torch thread(s)" in err and "load average 9.0" in err and "--threads N" in err
    assert "training the model: 4 steps of 16 facts on 1 thread(s)" in err
    epochs = [line for line in err.splitlines() if "epoch" in line]
    assert epochs and epochs[-1].endswith(tuple("0123456789")) and "step 4/4, loss " in epochs[-1]
    assert all(line.startswith("[") and "s]" in line for line in epochs)  # the time so far
    assert "scoring forget: 2 probes" in err and "scoring retain: 18 probes" in err
    assert "forget  n=2" in out and "retain  n=18" in out  # the results stay on stdout
    assert "epoch" not in out

    # The evaluator: the same default, told by name, and its own progress.
    assert demo.main(["evaluate", "--model", str(tmp_path / "demo" / "model"), "--probes", str(tmp_path / "demo")]) == 0
    out, err = capsys.readouterr()
    assert "using 1 torch thread(s) (2 core(s), load average 9.0: 0 idle; --threads N to choose)" in err
    assert "loading" in err and "scoring retain: 18 probes" in err
    assert "retain  n=18" in out


def test_threads_given_are_used_and_a_bad_count_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    used: list[int] = []
    monkeypatch.setattr(demo.torch, "set_num_threads", used.append)
    monkeypatch.setattr(demo, "_print_metrics", lambda *args: None)
    assert demo.main(["evaluate", "--threads", "3", "--model", str(tmp_path)]) == 0
    assert used == [3]
    assert "using 3 torch thread(s) (--threads)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["evaluate", "--threads", "0", "--model", str(tmp_path)])
    assert "must be 1 or more" in capsys.readouterr().err
