"""TOFU's per-probe statistics (service.engine.tofu_scoring) on tiny Llamas.

The reference is a manual float64 forward: each answer scored alone (no batch, no padding) by a
float64 copy of the model, the log-softmax written out as ``x − max − log Σ exp(x − max)`` per
position, the mean and variance of the log-probabilities summed over the vocabulary in a loop.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

from engram_fixtures.demo import make_facts, tiny_llama_config, tofu_answers, train_on_facts, train_tokenizer
from engram_fixtures.models import make_tiny_chat_llama, make_tokenizer
from service.engine.evaluate import TextProbe, encode_probe
from service.engine.tofu_scoring import AnswerTokens, TofuProbe, tofu_probe, tofu_statistics, with_answer
from service.evaluation import tofu_metrics as tm

PROBES = [
    TofuProbe(TextProbe("Q: Where was Varnok Dellish born? A:", " Quillmoor"), " in Quillmoor", (" Brashvane", " Tolk")),
    TofuProbe(TextProbe("The cat sat on", " the mat today"), None, (" a dog",)),
    TofuProbe(TextProbe("Q: What does Mira work as? A:", " baker"), " a baker", None),
]


@pytest.fixture(scope="module")
def random_llama() -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = tiny_llama_config(len(tokenizer), hidden=32, layers=2, intermediate=64, tokenizer=tokenizer)
    return LlamaForCausalLM(config).eval(), tokenizer


def manual_answer_tokens(model: LlamaForCausalLM, ids: tuple[list[int], list[int]]) -> AnswerTokens:
    prompt, answer = ids
    with torch.no_grad():
        logits = model.double()(input_ids=torch.tensor([prompt + answer])).logits[0].tolist()
    logprobs, means, variances, hits = [], [], [], []
    for j, target in enumerate(answer):
        row = logits[len(prompt) - 1 + j]
        top = max(row)
        lse = top + math.log(sum(math.exp(x - top) for x in row))
        logp = [x - lse for x in row]
        mean = sum(math.exp(lp) * lp for lp in logp)
        logprobs.append(logp[target])
        means.append(mean)
        variances.append(sum(math.exp(lp) * (lp - mean) ** 2 for lp in logp))
        hits.append(row.index(top) == target)
    return AnswerTokens(tuple(logprobs), tuple(means), tuple(variances), tuple(hits))


def _close(ours: AnswerTokens, ref: AnswerTokens, tol: float) -> None:
    assert ours.argmax_hits == ref.argmax_hits
    for field in ("logprobs", "vocab_mean", "vocab_var"):
        assert getattr(ours, field) == pytest.approx(getattr(ref, field), abs=tol), field


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_token_statistics_equal_a_float64_manual_forward(
    random_llama: tuple[LlamaForCausalLM, PreTrainedTokenizerFast], dtype: torch.dtype, tol: float
) -> None:
    model, tokenizer = random_llama
    reference = LlamaForCausalLM(model.config)
    reference.load_state_dict(model.state_dict())
    stats = tofu_statistics(model.to(dtype), tokenizer, PROBES, generate=False, batch_size=2)
    for item, got in zip(PROBES, stats, strict=True):
        _close(got.answer, manual_answer_tokens(reference, encode_probe(tokenizer, item.probe)), tol)
        if item.paraphrased_answer is None:
            assert got.paraphrased is None
        else:
            assert got.paraphrased is not None
            ids = encode_probe(tokenizer, with_answer(item.probe, item.paraphrased_answer))
            _close(got.paraphrased, manual_answer_tokens(reference, ids), tol)
        if item.perturbed_answers is None:
            assert got.perturbed is None
        else:
            assert got.perturbed is not None and len(got.perturbed) == len(item.perturbed_answers)
            for wrong, scored in zip(item.perturbed_answers, got.perturbed, strict=True):
                ids = encode_probe(tokenizer, with_answer(item.probe, wrong))
                _close(scored, manual_answer_tokens(reference, ids), tol)
        assert got.answer_text == item.probe.completion.strip() or got.answer_text == item.probe.completion
        assert got.generation is None
    model.float()


def test_statistics_do_not_depend_on_the_batch_size(
    random_llama: tuple[LlamaForCausalLM, PreTrainedTokenizerFast],
) -> None:
    model, tokenizer = random_llama
    one = tofu_statistics(model.double(), tokenizer, PROBES, generate=True, batch_size=1)
    all_ = tofu_statistics(model, tokenizer, PROBES, generate=True, batch_size=16)
    for a, b in zip(one, all_, strict=True):
        _close(a.answer, b.answer, 1e-10)
        assert a.generation == b.generation
    model.float()


def test_with_answer_replaces_the_last_assistant_turn() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Where was X born?"},
        {"role": "assistant", "content": "Quillmoor"},
    ]
    replaced = with_answer(TextProbe(messages=messages), "Tolk")
    assert replaced.messages is not None
    assert [m["content"] for m in replaced.messages] == ["hi", "hello", "Where was X born?", "Tolk"]
    assert messages[-1]["content"] == "Quillmoor"  # the probe itself is untouched
    assert with_answer(TextProbe("Q:", " a"), " b") == TextProbe("Q:", " b")


def test_tofu_probe_reads_records_and_names_bad_fields() -> None:
    item = tofu_probe({"prompt": "Q:", "completion": " a", "paraphrased_answer": " an a", "perturbed_answers": [" b"]})
    assert item == TofuProbe(TextProbe("Q:", " a"), " an a", (" b",))
    with pytest.raises(ValueError, match="perturbed_answers must be a list of strings"):
        tofu_probe({"prompt": "Q:", "completion": " a", "perturbed_answers": " b"})
    with pytest.raises(ValueError, match="paraphrased_answer must be a string"):
        tofu_probe({"prompt": "Q:", "completion": " a", "paraphrased_answer": 3})


def test_a_model_that_memorised_its_answers_has_em_and_es_one() -> None:
    facts = make_facts(6, seed=3)
    tokenizer = train_tokenizer([p + c for p, c in facts], vocab_size=300)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), hidden=64, layers=2, intermediate=128, tokenizer=tokenizer))
    probes = [TofuProbe(TextProbe(p, c)) for p, c in facts]
    before = tm.model_report(tofu_statistics(model, tokenizer, probes))
    train_on_facts(model, tokenizer, facts, steps=150, lr=3e-3, batch_size=6, seed=0)
    after = tm.model_report(tofu_statistics(model, tokenizer, probes))
    assert before.values["exact_memorization"] < 0.5
    assert after.values["exact_memorization"] == 1.0
    assert after.values["extraction_strength"] == 1.0
    assert after.values["forget_Q_A_ROUGE"] == 1.0  # greedy generation reproduces every answer
    assert after.values["forget_Q_A_Prob"] > 0.8 > before.values["forget_Q_A_Prob"]


def test_mini_tofu_answers_are_deterministic_wrong_and_untrained() -> None:
    facts = make_facts(40, seed=2)
    answers = tofu_answers(facts, seed=2, n_perturbed=4)
    assert answers == tofu_answers(facts, seed=2, n_perturbed=4)
    assert answers != tofu_answers(facts, seed=3, n_perturbed=4)
    trained = {word for p, c in facts for word in (p + c).split()}
    for (_, completion), (para, wrong) in zip(facts, answers, strict=True):
        true_words = completion.strip()
        assert true_words in para and para != completion
        before, after = para.split(true_words)
        assert len(wrong) == len(set(wrong)) == 4
        for answer in wrong:
            # the paraphrase's form around other words of the same shape, none of them trained on
            assert answer.startswith(before) and answer.endswith(after)
            words = answer[len(before) : len(answer) - len(after)].split()
            assert len(words) == len(true_words.split())
            assert not set(words) & trained
    assert make_facts(40, seed=2) == facts  # the facts themselves are untouched


def test_chat_probes_score_each_answer_as_the_last_assistant_turn(tmp_path: Path) -> None:
    folder = make_tiny_chat_llama(tmp_path / "chat")
    model = AutoModelForCausalLM.from_pretrained(folder).double()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "Where was Varnok born?"}, {"role": "assistant", "content": "Quillmoor"}]
    item = TofuProbe(TextProbe(messages=messages), "the town of Quillmoor", ("the town of Tolk",))
    [got] = tofu_statistics(model, tokenizer, [item], generate=False)
    for answer, scored in [("Quillmoor", got.answer), (item.paraphrased_answer, got.paraphrased)]:
        chat = [messages[0], {"role": "assistant", "content": answer}]
        ids = encode_probe(tokenizer, TextProbe(messages=chat))
        assert scored is not None
        _close(scored, manual_answer_tokens(model, ids), 1e-10)
    assert got.perturbed is not None and len(got.perturbed) == 1
    assert got.answer_text.startswith("Quillmoor")
