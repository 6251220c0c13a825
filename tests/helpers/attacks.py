"""Independent computations of an evaluation's attacks (issue 37), for the tests of the HTTP API.

Written without the service's attack code: the gguf package's round trip applied to the tensors
llama.cpp quantizes for Q4_x (every 2-D weight under ``model.layers.``, and an untied token embedding;
the head, or an embedding tied to it, is Q6_K in llama.cpp, which gguf 0.19.0 cannot quantize, so it
stays; a tensor whose rows are not whole 32-value blocks stays too), and a plain torch
fine-tuning loop. Scoring uses the library's ``answer_nll`` and
``greedy_exact_match`` (the scoring is not what these tests are about; the tests of
:mod:`service.engine.evaluate` are), batched as the job batches (16 probes).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from service.engine.evaluate import TextProbe, answer_nll, greedy_exact_match

JOB_BATCH = 16


def summary(model: Any, tokenizer: Any, records: list[dict[str, str]]) -> dict[str, float]:
    """``{"mean_nll", "exact_match", "n"}`` of prompt/completion records, in chunks of 16 as the job."""
    nll: list[float] = []
    em: list[bool] = []
    for start in range(0, len(records), JOB_BATCH):
        probes = [TextProbe(r["prompt"], r["completion"]) for r in records[start : start + JOB_BATCH]]
        nll += answer_nll(model, tokenizer, probes, batch_size=JOB_BATCH)
        em += greedy_exact_match(model, tokenizer, probes, batch_size=JOB_BATCH)
    return {"mean_nll": sum(nll) / len(nll), "exact_match": sum(em) / len(em), "n": len(em)}


def q4_round_trip(model: Any, qtype: str = "Q4_1") -> Any:
    """A copy of ``model`` whose decoder 2-D weights (and untied embedding) went through gguf's ``qtype``."""
    kind = GGMLQuantizationType[qtype]
    attacked = copy.deepcopy(model)
    tied = bool(model.config.tie_word_embeddings)
    with torch.no_grad():
        for name, param in attacked.named_parameters():
            decoder = name.startswith("model.layers.") and param.dim() == 2
            embedding = name == "model.embed_tokens.weight" and not tied
            whole_blocks = param.shape[-1] % 32 == 0  # else llama.cpp refuses the type; the service keeps it
            if (decoder or embedding) and whole_blocks:
                back = quants.dequantize(quants.quantize(param.detach().float().numpy(), kind), kind)
                param.copy_(torch.from_numpy(np.array(back)).to(param.dtype))
    return attacked


def fine_tuned(model: Any, tokenizer: Any, records: list[dict[str, str]], steps: int, lr: float, seed: int) -> Any:
    """A copy of ``model`` after ``steps`` AdamW steps (no weight decay) on all ``records`` at once: the
    answer tokens learned (prompt and padding labelled -100), the model's own loss."""
    rows = []
    for record in records:
        prompt = tokenizer(record["prompt"], add_special_tokens=True)["input_ids"]
        answer = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return fine_tuned_rows(model, rows, pad, steps, lr, seed)


def fine_tuned_rows(model: Any, rows: list[tuple[list[int], list[int]]], pad: int, steps: int, lr: float, seed: int) -> Any:
    """What a customer writes: a copy of ``model`` after ``steps`` AdamW steps (no weight decay) on every
    ``(input ids, labels)`` row at once, padded on the right with ``pad`` (labels -100 there)."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    tuned = copy.deepcopy(model)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(tuned.parameters(), lr=lr, weight_decay=0.0)
    tuned.train()
    for _ in range(steps):
        optimizer.zero_grad()
        tuned(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
    return tuned.eval()


def assert_summaries_equal(job: dict[str, Any], expected: dict[str, float], where: str, nll_tolerance: float) -> None:
    """The job's summary equals the independent one: exact match exactly, NLL within ``nll_tolerance``."""
    assert job["n"] == expected["n"], where
    assert job["exact_match"] == expected["exact_match"], (where, job, expected)
    assert abs(job["mean_nll"] - expected["mean_nll"]) <= nll_tolerance, (where, job, expected)


def attack_table(result: dict[str, Any]) -> str:
    """An evaluation's figures, one row per attack and model: forget and retain exact match and NLL,
    the retain perplexity (exp of its mean NLL), and relearn's recovered fraction."""
    rows = [("unattacked", result["summary"])] + [(name, report["summary"]) for name, report in result["attacks"].items()]
    lines = ["attack                 model    forget EM  retain EM  forget NLL  retain NLL  retain ppl"]
    for name, per_model in rows:
        for model in ("base", "variant"):
            f, r = per_model[model]["forget"], per_model[model]["retain"]
            figures = f"{f['exact_match']:9.2f}  {r['exact_match']:9.2f}  {f['mean_nll']:10.3f}  {r['mean_nll']:10.3f}"
            lines.append(f"{name:22} {model:8} {figures}  {math.exp(r['mean_nll']):10.2f}")
    if "relearn" in result["attacks"]:
        lines.append(f"relearn recovered fraction: {result['attacks']['relearn'].get('recovered_fraction')}")
    return "\n".join(lines)


def int8_linears(model: Any) -> Any:
    """A copy of ``model`` whose Linear weights (not the head's) went through per-row absmax int8."""
    attacked = copy.deepcopy(model)
    head = attacked.get_output_embeddings()
    with torch.no_grad():
        for module in attacked.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                scale = module.weight.abs().amax(dim=1, keepdim=True) / 127
                module.weight.copy_(torch.round(module.weight / scale).clamp(-127, 127) * scale)
    return attacked
