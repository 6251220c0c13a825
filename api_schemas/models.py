"""Model registration: ``POST /models`` and the registered model."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from api_schemas.common import MODEL_ID_PATTERN, SOURCE_PATTERN, Strict
from api_schemas.provenance import CreationMetadata, MetadataFields


class ModelCreate(Strict, MetadataFields):
    model_id: str = Field(pattern=MODEL_ID_PATTERN, max_length=200, examples=["demo/tiny-llama"])
    source: str = Field(
        max_length=2000,
        description=(
            "file:///abs/dir (inside ENGRAM_MODEL_ROOTS), s3://bucket/prefix/ or hf://org/name[@rev]; a GGUF model "
            "as file:///abs/model.gguf, s3://bucket/key.gguf or hf://org/name/file.gguf[@rev], or a folder, prefix or "
            "repo holding one .gguf and no config.json (dequantized once at registration)"
        ),
        # The pattern is published in the schema but checked by _known_scheme: pydantic's own refusal
        # quotes the regular expression, which tells a caller nothing about what to send.
        json_schema_extra={"pattern": SOURCE_PATTERN},
    )

    @field_validator("model_id")
    @classmethod
    def _no_dot_segments(cls, value: str) -> str:
        # "." and ".." are not names: URL normalisation would make such a model unreachable.
        if any(part in {".", ".."} for part in value.split("/")):
            raise ValueError("model_id parts must not be '.' or '..'")
        return value

    @field_validator("source")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        if re.search(SOURCE_PATTERN, value) is None:
            raise PydanticCustomError(
                "source_scheme", "source must be file:///absolute/dir, s3://bucket/prefix or hf://org/name[@revision]"
            )
        return value


class Kernel(BaseModel):
    """How a convolution reads its input: its layer's ``in_features`` is the patch width
    ``in_channels / groups · Π kernel_size``."""

    kind: Literal["conv1d", "conv2d"]
    in_channels: int
    kernel_size: list[int]
    stride: list[int]
    padding: list[list[int]] = Field(description="per spatial dimension: [before, after]")
    dilation: list[int]
    groups: int = 1


class Layer(BaseModel):
    name: str
    in_features: int
    out_features: int
    bias: bool
    kernel: Kernel | None = Field(
        default=None, description="a convolution's kernel; absent for a Linear layer", exclude_if=lambda v: v is None
    )


class Model(CreationMetadata):
    model_id: str
    source: str
    digest: str
    architecture: str
    num_parameters: int
    quantization: str | None = Field(
        None,
        description=(
            "the quantization type (Q4_1, Q8_0, F16...) of the GGUF file the model was registered from, "
            "dequantized once at registration; null for a safetensors checkpoint"
        ),
    )
    layers: list[Layer]
    layers_not_in_checkpoint: list[str] = Field(
        default_factory=list,
        description=(
            "editable layers of the architecture whose weight the checkpoint does not store under any name "
            "transformers loads (it initialises them at random on load): never edited"
        ),
    )
    refused_layers: dict[str, str] = Field(
        default_factory=dict,
        description="layers of the architecture the service does not edit -> why (a grouped or depthwise conv)",
    )
    kind: Literal["text", "image"] = Field(
        default="text", description='"image": an image classifier, whose concepts take image records'
    )
