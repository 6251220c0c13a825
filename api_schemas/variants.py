"""Variants: the edited checkpoint (or delta, or LoRA adapter) and its files."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from api_schemas.jobs import Job


class VariantFile(BaseModel):
    path: str
    size: int
    sha256: str


class Variant(BaseModel):
    variant_id: str
    model_id: str
    terms: dict[str, float]
    alpha: float | None
    scaling: str
    format: str
    lora_rank: int | None = None
    lora_target: Literal["peft", "vllm"] | None = Field(
        default=None, description='format "peft": what the adapter is written for (null: "peft")'
    )
    gguf_quantization: str | None = Field(default=None, description='format "gguf": the type it is written in')
    modules: list[str] | None = None
    layers: list[int] | None = None
    module_strengths: dict[str, float] | None = None
    rcond: float | None = None
    reference: list[str]
    universe_id: str | None = Field(default=None, description="the universe the engrams are measured against")
    status: Literal["building", "ready", "failed"]
    job_id: str | None = None
    files: list[VariantFile] = []
    unreached_layers: list[str] = Field(
        default_factory=list,
        description=(
            "once ready: selected layers no concept of the universe reached (their forward pass never ran them, "
            "e.g. a vision tower under text concepts): their edit is zero, and they are written as they were"
        ),
    )
    lora: dict[str, Any] | None = Field(
        default=None,
        description=(
            'format "peft", once ready: per layer its rank, kept rank, relative error and kept energy (the share '
            "of the edit's squared Frobenius norm the rank keeps), and totals"
        ),
    )
    created_at: str | None = Field(default=None, description="when the request that created it was made (UTC, ISO 8601)")
    created_by: str | None = Field(
        default=None, description="the fingerprint of the key that created it (key-<12 hex>; anonymous without auth)"
    )
    labels: dict[str, str] = Field(default_factory=dict, description="the creating request's labels")
    reason: str | None = Field(default=None, description="the creating request's reason")
    reverts: str | None = Field(default=None, description="the variant the creating request said it reverts")


class VariantSubmission(BaseModel):
    variant: Variant
    job: Job | None = None
    warnings: list[str] = Field(
        default_factory=list,
        description=(
            "what the answer should not hide: the α an unlearn without alpha was given and why, and a universe "
            "with no general-text reference (the edit is less selective), each with its fix"
        ),
    )


class VariantReceipt(BaseModel):
    """``GET /variants/{id}/receipt``: the record that chains a variant to what made it, signed."""

    receipt: dict[str, Any] = Field(
        description=(
            "the request (concepts, options, who, when, reason, labels, reverts), each concept's dataset sha256 and "
            "statistics, the universe, the base model's files and identity, every output file's sha256 and the "
            "evaluations run on the variant"
        )
    )
    digest: str = Field(
        description="sha256 of the canonical JSON of receipt (sorted keys, no spaces, ASCII with \\u escapes)"
    )
    signed: bool
    algorithm: Literal["Ed25519"] | None = None
    signature: str | None = Field(default=None, description="base64 Ed25519 signature of the canonical JSON of receipt")
    public_key: str | None = Field(
        default=None,
        description="the PEM public key it was signed with (also at GET /receipt-key); a key read from here proves "
        "only integrity: verify with the key the operator publishes",
    )
    note: str | None = Field(default=None, description="unsigned: why (no ENGRAM_RECEIPT_SIGNING_KEY configured)")


class ReceiptKey(BaseModel):
    """``GET /receipt-key``: the public key receipts are signed with."""

    algorithm: Literal["Ed25519"] = "Ed25519"
    public_key: str = Field(description="PEM (SubjectPublicKeyInfo)")
    fingerprint: str = Field(description="sha256 of the raw 32-byte public key, hex")


def canonical_receipt_bytes(receipt: dict[str, Any]) -> bytes:
    """What a receipt's signature and digest are of: its JSON with sorted keys, no spaces, ASCII only
    (the service and ``engram verify`` make the same bytes of the same record)."""
    return json.dumps(receipt, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
