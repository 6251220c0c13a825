"""A variant's model card: ``README.md`` in the Hugging Face convention, made from its receipt.

Served at ``GET /variants/{id}/model-card`` rather than written into the variant's files: a file
added to every variant would change every manifest (and the file lists clients and tests pin), and
its content (evaluations, the receipt's digest) changes after the variant is built, while a
variant's files never do. Saved as ``README.md`` beside the weights, it is what the Hub shows; a
folder checked with ``engram verify`` names it as a file the receipt does not list, so check the
folder first, then add the card.
"""

from __future__ import annotations

from typing import Any

from api_schemas.variants import VariantReceipt

HF_SOURCE = "hf:"


def model_card(answer: VariantReceipt) -> str:
    """The card's Markdown: YAML front matter (``base_model``, ``tags``), then what was removed,
    how, the evaluation figures and the receipt's digest."""
    receipt = answer.receipt
    request, base = receipt["request"], receipt["base_model"]
    lines = [
        "---",
        f"base_model: {_yaml_string(_base_model_name(base))}",
        "tags: [unlearning, engram]",
        "---",
        "",
        f"# Variant {receipt['variant_id']}",
        "",
        f"An edit of `{request['model_id']}` made by Engram Service: `W' = W + Σ_k c_k f_l W_k⁺` over the "
        f"engrams of universe `{receipt['universe']['universe_id']}`.",
        "",
        "## What was removed or added",
        "",
        "| concept | coefficient | dataset sha256 | records |",
        "|---|---|---|---|",
        *(
            f"| {c['name']} | {c['coefficient']:g} | `{c['dataset_sha256']}` | {c['num_records']} |"
            for c in receipt["concepts"]
        ),
        "",
        "## How",
        "",
        *(f"- {name}: `{value}`" for name, value in sorted(request["options"].items()) if value is not None),
        *([f"- reason: {request['reason']}"] if request.get("reason") else []),
        *([f"- reverts: `{receipt['reverts']}`"] if receipt.get("reverts") else []),
        *([f"- requested by `{request['created_by']}` at {request['created_at']}"] if request.get("created_at") else []),
        "",
        "## Evaluations",
        "",
        *_evaluation_lines(receipt["evaluations"]),
        "",
        "## Receipt",
        "",
        f"sha256 `{answer.digest}` ({'Ed25519-signed' if answer.signed else 'unsigned'}): "
        "`engram verify receipt.json FOLDER` checks the files against it.",
        "",
    ]
    return "\n".join(lines)


def _base_model_name(base: dict[str, Any]) -> str:
    """The hub name for a model registered from the Hub (``hf:org/name``), else its ID here."""
    source = str(base.get("source") or "")
    return source[len(HF_SOURCE) :].split("@")[0] if source.startswith(HF_SOURCE) else str(base["model_id"])


def _evaluation_lines(evaluations: list[dict[str, Any]]) -> list[str]:
    if not evaluations:
        return ["None stored yet (`POST /variants/{id}/evaluate`)."]
    lines = ["| evaluation | model | split | mean NLL | exact match | probes |", "|---|---|---|---|---|---|"]
    for evaluation in evaluations:
        for model, splits in sorted((evaluation.get("summary") or {}).items()):
            for split, s in sorted(splits.items()):
                row = f"{s['mean_nll']:.4f} | {s['exact_match']:.3f} | {s['n']}"
                lines.append(f"| {evaluation['evaluation_id'][:12]} | {model} | {split} | {row} |")
    provenance = [line for evaluation in evaluations if (line := _evaluation_provenance(evaluation))]
    return [*lines, *([""] if provenance else []), *provenance]


def _evaluation_provenance(evaluation: dict[str, Any]) -> str | None:
    """Who asked for an evaluation, when and why, and its probe sets' digests (None: an evaluation
    stored before they were recorded)."""
    if not evaluation.get("created_at"):
        return None
    parts = [f"requested by `{evaluation.get('created_by')}` at {evaluation['created_at']}"]
    if evaluation.get("reason"):
        parts.append(f"reason: {evaluation['reason']}")
    if evaluation.get("labels"):
        parts.append("labels: " + ", ".join(f"`{k}:{v}`" for k, v in sorted(evaluation["labels"].items())))
    sets = evaluation.get("probe_sets") or {}
    if sets:
        parts.append("probes: " + ", ".join(f"{name} `{s['sha256'][:12]}` ({s['n']})" for name, s in sets.items()))
    return f"- {evaluation['evaluation_id'][:12]}: " + "; ".join(parts)


def _yaml_string(value: str) -> str:
    """A double-quoted YAML scalar (a model ID may hold ``:`` or ``#``)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
