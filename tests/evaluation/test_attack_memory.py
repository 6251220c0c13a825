"""An attack's copy is checked against the job's memory budget before it is made (issue 37): relearning
holds the weights, their gradients and AdamW's two moments (4x the weights), a quantized copy 1x.

The job process's data limit (``RLIMIT_DATA``, set from ENGRAM_JOB_MEMORY_BYTES) is read with
``resource.getrlimit``; here it is stood in for (monkeypatched) by what the process holds plus a margin
between 1x and 4x a small model's weights, so that nothing is allocated: relearning is refused naming
the attack, the bytes and the setting, and a quantized copy passes.
"""

from __future__ import annotations

import resource

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from service.errors import JobFailed
from service.evaluation import attacks


def _model() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    return LlamaForCausalLM(config)


def test_relearning_that_cannot_fit_the_budget_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # ~5 MB
    held = attacks._data_bytes()
    assert held is not None and held > 0
    limit = held + 2 * weights  # room for one copy, not for four
    monkeypatch.setattr(attacks.resource, "getrlimit", lambda _kind: (limit, resource.RLIM_INFINITY))
    monkeypatch.setattr(attacks, "_data_bytes", lambda: held)
    with pytest.raises(JobFailed, match="attack relearn needs") as caught:
        attacks._check_memory("relearn", model, copies=4)
    message = str(caught.value)
    assert "ENGRAM_JOB_MEMORY_BYTES" in message and "gradients and AdamW" in message, message
    assert f"~{4 * weights >> 20} MiB" in message, message
    attacks._check_memory("quantize:Q4_1", model, copies=1)  # one copy fits


def test_no_limit_means_no_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attacks.resource, "getrlimit", lambda _kind: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    attacks._check_memory("relearn", _model(), copies=4)
