"""Examples in the OpenAPI document: one realistic request or response per operation, so the
reference (docs/API.md) and Swagger UI show what a call looks like. :mod:`service.api.openapi`
builds the document and calls :func:`add_examples` on it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

# ---------------------------------------------------------------- examples

MODEL_ID = "demo/tiny-llama"
VARIANT_ID = "3f9c2a7e5b1d4c8a9e0f6b2d7c4a1e85"
JOB_ID = "8d2f0c6b1a9e4f3c8b7a6d5e4f3c2b1a"
PROMPT = "Q: What is the favourite colour of Kymthai Kudal? A:"
_CREATED = "2026-01-15T09:30:00.120000Z"
_KEY = "key-3fa85f6457c1"  # a key's fingerprint (service.api.auth.key_identity), never the key
_LABELS = {"ticket": "PRIV-1042", "team": "trust-safety"}
_REASON = "erasure request PRIV-1042"
_EVAL_FORGET = [{"prompt": PROMPT, "completion": " voukrur"}]
# An evaluation's probe set digest: sha256 of the probes as canonical JSON (service.evaluation.provenance).
_EVAL_FORGET_SHA256 = hashlib.sha256(json.dumps(_EVAL_FORGET, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _job(kind: str, status: str, **fields: Any) -> dict[str, Any]:
    finished = status in ("succeeded", "failed", "cancelled")
    job = {
        "job_id": JOB_ID,
        "kind": kind,
        "model_id": None,
        "concept": None,
        "variant_id": None,
        "status": status,
        "progress": {"done": 0, "total": 0, "unit": "items"},
        "error": None,
        "result": None,
        "created_at": _CREATED,
        "started_at": "2026-01-15T09:30:00.450000Z" if status != "queued" else None,
        "finished_at": "2026-01-15T09:30:04.900000Z" if finished else None,
    }
    job.update(fields)
    return job


_VARIANT = {
    "variant_id": VARIANT_ID,
    "model_id": MODEL_ID,
    "terms": {"forget": -1.0},
    "alpha": 1.0,
    "scaling": "uniform",
    "format": "checkpoint",
    "lora_rank": None,
    "lora_target": None,
    "modules": None,
    "layers": None,
    "rcond": None,
    "reference": ["forget", "retain"],
    "status": "ready",
    "job_id": JOB_ID,
    "files": [
        {"path": "config.json", "size": 712, "sha256": "9b4e" + "0" * 60},
        {"path": "model.safetensors", "size": 33587304, "sha256": "c01d" + "0" * 60},
        {"path": "tokenizer.json", "size": 61244, "sha256": "5a7f" + "0" * 60},
    ],
    "lora": None,
}
_VARIANT_JOB = _job(
    "variant", "queued", model_id=MODEL_ID, variant_id=VARIANT_ID, progress={"done": 0, "total": 0, "unit": "layers"}
)
_CONCEPT = {
    "created_at": _CREATED,
    "created_by": _KEY,
    "labels": _LABELS,
    "reason": _REASON,
    "name": "forget",
    "role": "target",
    "description": "facts the model should forget",
    "num_records": 2,
    "dataset_digest": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "models": {MODEL_ID: {"status": "collecting", "tokens": None, "job_id": JOB_ID}},
}

REQUEST_EXAMPLES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/models"): {
        "local": {
            "summary": "A checkpoint directory inside ENGRAM_MODEL_ROOTS",
            "value": {"model_id": MODEL_ID, "source": "file:///srv/models/tiny-llama"},
        },
        "labelled": {
            "summary": "With labels and a reason (GET /models?label=team:trust-safety finds it)",
            "value": {"model_id": MODEL_ID, "source": "file:///srv/models/tiny-llama", "labels": _LABELS, "reason": _REASON},
        },
        "hub": {
            "summary": "A Hugging Face hub repository at a revision",
            "value": {"model_id": "gpt2", "source": "hf://openai-community/gpt2@main"},
        },
    },
    ("post", "/concepts"): {
        "pairs": {
            "summary": "Question/answer records: only the answers enter the statistics",
            "value": {
                "name": "forget",
                "role": "target",
                "models": [MODEL_ID],
                "records": [
                    {"prompt": PROMPT, "completion": " voukrur"},
                    {"prompt": "Q: Where was Brasmym Fivear born? A:", "completion": " Papa"},
                ],
                "labels": _LABELS,
                "reason": _REASON,
            },
        },
        "text": {
            "summary": "Plain text records, a reference concept",
            "value": {
                "name": "retain",
                "role": "reference",
                "description": "general knowledge the model should keep",
                "models": [MODEL_ID],
                "records": [{"text": "Paris is the capital of France."}, {"text": "Water boils at 100 degrees."}],
            },
        },
    },
    ("post", "/models/{model_id}/unlearn"): {
        "checkpoint": {"summary": "Forget one concept", "value": {"concepts": ["forget"], "alpha": 1.0}},
        "peft": {
            "summary": "A LoRA adapter of rank 16 on the attention and MLP inputs, adaptive strength",
            "value": {
                "concepts": ["forget"],
                "alpha": 1.0,
                "scaling": "weight_norm",
                "modules": ["q_proj", "k_proj", "gate_proj"],
                "format": "peft",
                "lora_rank": 16,
            },
        },
        "vllm": {
            "summary": "A LoRA adapter vLLM serves: rank 64 in every layer, lora_alpha 64, no lora_bias",
            "value": {"concepts": ["forget"], "alpha": 1.0, "format": "peft", "lora_target": "vllm", "lora_rank": 64},
        },
    },
    ("post", "/models/{model_id}/calibrate"): {
        "constraint": {
            "summary": "The strongest forgetting that at most doubles the retain answers' NLL, in 24 evaluations",
            "value": {
                "concepts": ["forget"],
                "forget": [{"prompt": PROMPT, "completion": " voukrur"}],
                "retain": [{"prompt": "Q: Where was Brasmym Fivear born? A:", "completion": " Papa"}],
                "max_retain_nll_ratio": 2.0,
                "budget": 24,
                "module_sets": ["all", "qk_gate"],
                "format": "checkpoint",
            },
        },
    },
    ("post", "/variants/{variant_id}/evaluate"): {
        "labelled": {
            "summary": "Forget and retain probes, with labels and a reason kept with the result (its receipt shows them)",
            "value": {
                "forget": _EVAL_FORGET,
                "retain": [{"prompt": "Q: Where was Brasmym Fivear born? A:", "completion": " Papa"}],
                "labels": {"ticket": "PRIV-1042"},
                "reason": "check erasure PRIV-1042",
            },
        },
        "probes": {"summary": "Forget probes alone", "value": {"forget": _EVAL_FORGET}},
    },
    ("post", "/models/{model_id}/compose"): {
        "add_back": {"summary": "Add an engram back", "value": {"terms": {"forget": 1.0}}},
        "mix": {
            "summary": "Remove one concept, strengthen another, as a delta",
            "value": {"terms": {"forget": -1.0, "retain": 0.5}, "format": "delta", "rcond": 0.0001},
        },
    },
}

RESPONSE_EXAMPLES: dict[tuple[str, str, str], dict[str, Any]] = {
    ("post", "/models", "201"): {
        "created_at": _CREATED,
        "created_by": _KEY,
        "labels": _LABELS,
        "reason": _REASON,
        "model_id": MODEL_ID,
        "source": "file:///srv/models/tiny-llama",
        "digest": "7d1a" + "0" * 60,
        "architecture": "LlamaForCausalLM",
        "num_parameters": 4215040,
        "layers": [
            {"name": "model.layers.0.self_attn.q_proj", "in_features": 256, "out_features": 256, "bias": False},
            {"name": "model.layers.0.mlp.down_proj", "in_features": 688, "out_features": 256, "bias": False},
        ],
    },
    ("post", "/concepts", "202"): {
        "concept": _CONCEPT,
        "jobs": [
            _job(
                "collect", "queued", model_id=MODEL_ID, concept="forget", progress={"done": 0, "total": 2, "unit": "records"}
            )
        ],
    },
    ("post", "/models/{model_id}/unlearn", "202"): {
        "variant": {**_VARIANT, "status": "building", "files": []},
        "job": _VARIANT_JOB,
    },
    ("post", "/models/{model_id}/compose", "202"): {
        "variant": {**_VARIANT, "terms": {"forget": 1.0}, "alpha": None, "status": "building", "files": []},
        "job": _VARIANT_JOB,
    },
    ("get", "/variants/{variant_id}", "200"): _VARIANT,
    ("get", "/jobs/{job_id}", "200"): _job(
        "evaluate",
        "succeeded",
        variant_id=VARIANT_ID,
        progress={"done": 2, "total": 2, "unit": "probes"},
        result={
            "summary": {
                "base": {"forget": {"mean_nll": 0.04, "exact_match": 1.0, "n": 1}},
                "variant": {"forget": {"mean_nll": 6.9, "exact_match": 0.0, "n": 1}},
            },
            "records": [
                {
                    "split": "forget",
                    "index": 0,
                    "base": {"nll": 0.04, "exact_match": True},
                    "variant": {"nll": 6.9, "exact_match": False},
                }
            ],
            "created_at": _CREATED,
            "created_by": _KEY,
            "labels": {"ticket": "PRIV-1042"},
            "reason": "check erasure PRIV-1042",
            "probe_sets": {"forget": {"sha256": _EVAL_FORGET_SHA256, "n": 1}},
        },
    ),
}

# Path parameters: ``model_id`` may hold one "/" (org/name), so its example has one (and tools that
# generate requests from the document then know that an encoded slash is meant).
PARAMETER_EXAMPLES: dict[str, str] = {
    "model_id": MODEL_ID,
    "variant_id": VARIANT_ID,
    "job_id": JOB_ID,
    "name": "forget",
    "path": "model.safetensors",
    "universe_id": "5b0e7d21c9a84f36a1d2e3f4a5b6c7d8",
}


def add_examples(doc: dict[str, Any]) -> None:
    paths = doc["paths"]
    for (method, path), examples in REQUEST_EXAMPLES.items():
        operation = paths.get(path, {}).get(method)
        if operation is not None and "application/json" in operation.get("requestBody", {}).get("content", {}):
            operation["requestBody"]["content"]["application/json"]["examples"] = copy.deepcopy(examples)
    for (method, path, status), example in RESPONSE_EXAMPLES.items():
        response = paths.get(path, {}).get(method, {}).get("responses", {}).get(status, {})
        media = response.get("content", {}).get("application/json")
        if media is not None:
            media["example"] = copy.deepcopy(example)
    operations = [op for item in paths.values() for op in item.values() if isinstance(op, dict) and "responses" in op]
    for operation in operations:
        for parameter in operation.get("parameters", []):
            if parameter.get("in") == "path" and parameter["name"] in PARAMETER_EXAMPLES:
                parameter["example"] = PARAMETER_EXAMPLES[parameter["name"]]
