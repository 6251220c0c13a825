"""Variants: the edited checkpoint (or delta, or LoRA adapter) and its files."""

from __future__ import annotations

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
