"""The edit options, spelled once: ``unlearn`` and ``compose`` requests are :class:`EditOptions` plus their terms."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from api_schemas.common import Strict
from api_schemas.provenance import VariantMetadataFields

# The values vLLM's --max-lora-rank accepts. vLLM refuses an adapter whose r exceeds the server's
# max_lora_rank, and loads no lora_B.bias; lora_target "vllm" writes one of these ranks for every layer.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


# The largest per-module strength factor (module_strengths): beyond it an edit is no longer a
# strength adjustment but a different edit, and a typo (40 for 0.4) would pass silently.
MAX_MODULE_STRENGTH = 4.0


# The JSON Schema of the adapter options' rules (lora_rank and lora_target "vllm" shape a peft adapter
# only; with lora_target "vllm", lora_rank is one of VLLM_LORA_RANKS): EditOptions and
# CalibrateRequest publish the same rules.
ADAPTER_OPTION_RULES: dict[str, Any] = {
    "if": {"required": ["lora_rank"], "properties": {"lora_rank": {"type": "integer"}}},
    "then": {"required": ["format"], "properties": {"format": {"const": "peft"}}},
    "allOf": [
        {
            "if": {"required": ["lora_target"], "properties": {"lora_target": {"const": "vllm"}}},
            "then": {
                "required": ["format"],
                "properties": {
                    "format": {"const": "peft"},
                    "lora_rank": {"anyOf": [{"enum": list(VLLM_LORA_RANKS)}, {"type": "null"}]},
                },
            },
        }
    ],
}


# adapter_base_model names the base of a peft adapter only: unlike lora_rank it has no calibrate twin.
BASE_MODEL_RULE: dict[str, Any] = {
    "if": {"required": ["adapter_base_model"], "properties": {"adapter_base_model": {"type": "string"}}},
    "then": {"required": ["format"], "properties": {"format": {"const": "peft"}}},
}

# gguf_quantization shapes a format "gguf" variant only.
GGUF_QUANTIZATION_RULE: dict[str, Any] = {
    "if": {"required": ["gguf_quantization"], "properties": {"gguf_quantization": {"type": "string"}}},
    "then": {"required": ["format"], "properties": {"format": {"const": "gguf"}}},
}

# A folder path or a hub name as peft writes it into adapter_config.json: printable, one line.
ADAPTER_BASE_MODEL_MAX = 1000
ADAPTER_BASE_MODEL_PATTERN = r"^[^\x00-\x1f\x7f]+$"

# The GGUF types a variant can be written in (service.engine.gguf_write.GGUF_QUANTIZATIONS): what
# the gguf package quantizes and llama.cpp and transformers' GGUF loader read.
GgufQuantization = Literal["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


class EditOptions(Strict):
    # lora_rank and lora_target "vllm" shape a peft adapter only (the service refuses them with
    # another format); with lora_target "vllm", lora_rank is one of VLLM_LORA_RANKS.
    model_config = ConfigDict(
        json_schema_extra={
            **ADAPTER_OPTION_RULES,
            "allOf": [*ADAPTER_OPTION_RULES["allOf"], BASE_MODEL_RULE, GGUF_QUANTIZATION_RULE],
        }
    )

    scaling: Literal["uniform", "weight_norm"] = "uniform"
    modules: list[str] | None = Field(default=None, min_length=1, description="module-name suffixes")
    layers: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1, description="block indices")
    module_strengths: (
        dict[
            Annotated[str, Field(min_length=1, max_length=200)],
            Annotated[float, Field(gt=0.0, le=MAX_MODULE_STRENGTH, allow_inf_nan=False)],
        ]
        | None
    ) = Field(
        default=None,
        max_length=64,
        description=(
            "per module type, a factor on the edit strength: a layer whose name ends with a listed suffix "
            "(q_proj, mlp.gate_proj…; the longest matching suffix wins) is edited with α·f_l·s, others with "
            f"α·f_l (s = 1); 0 < s ≤ {MAX_MODULE_STRENGTH:g}. A suffix matching no edited layer is a 422. "
            "Absent or all 1: the same variant as without it"
        ),
    )
    rcond: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False, description="keep λ > rcond·λmax")
    reference: list[str] | None = Field(
        default=None, description="the universe is reference ∪ concepts (default: the model's current universe)"
    )
    universe: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{32}$",
        description="a universe of this model (GET /models/{id}/universes); default: the model's current universe",
    )
    format: Literal["checkpoint", "delta", "peft", "gguf"] = Field(
        default="checkpoint",
        description=(
            "checkpoint (safetensors folder), delta (the changed tensors), peft (a LoRA adapter) or gguf (one .gguf "
            "file for llama.cpp and transformers' GGUF loader: a LlamaForCausalLM with a byte-level BPE tokenizer "
            "only, other models are a 422 naming why)"
        ),
    )
    gguf_quantization: GgufQuantization | None = Field(
        default=None,
        description=(
            'format "gguf": the type its matrices are stored in (vectors, and matrices whose rows do not split '
            "into whole blocks, stay F32). Default: the model's own type when it was registered from a .gguf of a "
            "type listed here, else F16"
        ),
    )
    lora_rank: int | None = Field(
        default=None,
        ge=1,
        le=65536,
        description=(
            'format "peft": the largest LoRA rank (default: each layer\'s exact rank); with lora_target "vllm", '
            "the one rank of every layer, one of " + ", ".join(map(str, VLLM_LORA_RANKS)) + " (default: the smallest "
            "of these that holds every layer's edit whole, at most 512)"
        ),
    )
    lora_target: Literal["peft", "vllm"] = Field(
        default="peft",
        description=(
            'format "peft": what will load the adapter. "peft": PeftModel.from_pretrained, each layer at its own '
            'rank, bias edits in lora_bias. "vllm": servable by vLLM (--enable-lora --max-lora-rank r): one rank r '
            "for every layer, lora_alpha = r (scaling 1), no lora_bias, so a selected layer with a bias (Qwen2's "
            "q/k/v, GPT-2, BERT) is a 422 naming it; the variant's lora report gives each layer's kept energy"
        ),
    )
    adapter_base_model: str | None = Field(
        default=None,
        min_length=1,
        max_length=ADAPTER_BASE_MODEL_MAX,
        json_schema_extra={"pattern": ADAPTER_BASE_MODEL_PATTERN},  # checked by _printable, which says why
        description=(
            'format "peft": the adapter\'s base_model_name_or_path, what AutoPeftModelForCausalLM.from_pretrained'
            "(adapter_dir) loads the base model from: a folder path or a hub name as the loading machine sees it "
            "(printable, one line). Default: the hub name (and revision) of a model registered from hf://, else "
            "the service's model ID, which the adapter's lora_report.json notes is neither"
        ),
    )
    callback_url: str | None = Field(
        default=None, max_length=2000, description="POSTed the build job when it ends (host must be allowlisted)"
    )

    @field_validator("adapter_base_model")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        if value is not None and re.search(r"[\x00-\x1f\x7f]", value):
            raise ValueError(
                "adapter_base_model must be one printable line (no newline, tab or other control character): "
                "a folder path or a hub name such as org/name"
            )
        return value

    @model_validator(mode="after")
    def _base_model_of_an_adapter(self) -> EditOptions:
        if self.adapter_base_model is not None and self.format != "peft":
            raise ValueError(f'adapter_base_model names the base of format "peft" only, not {self.format!r}')
        return self

    @model_validator(mode="after")
    def _quantization_of_a_gguf(self) -> EditOptions:
        if self.gguf_quantization is not None and self.format != "gguf":
            raise ValueError(f'gguf_quantization applies to format "gguf" only, not {self.format!r}')
        return self

    @model_validator(mode="after")
    def _servable_rank(self) -> EditOptions:
        if self.lora_target == "vllm" and self.lora_rank is not None and self.lora_rank not in VLLM_LORA_RANKS:
            allowed = ", ".join(map(str, VLLM_LORA_RANKS))
            rank = self.lora_rank
            raise ValueError(f'lora_rank {rank} is not a rank vLLM serves: with lora_target "vllm", one of {allowed}')
        return self


class UnlearnRequest(EditOptions, VariantMetadataFields):
    concepts: list[str] = Field(min_length=1, max_length=256)
    alpha: Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)] | SkipJsonSchema[None] = Field(
        default=None,
        description=(
            "the strength α in W − α Σ_k f_l W_k⁺. Omitted: the recommendation of the model's last calibration "
            "of the same concepts in the same universe (with its scaling, modules, layers and module_strengths "
            "where the request names none, and only when those it names agree), else a conservative 0.25; "
            "the answer's warnings say which (α = 1 can destroy a pretrained model)"
        ),
    )

    @field_validator("alpha", mode="before")
    @classmethod
    def _a_number_when_given(cls, value: Any) -> Any:
        # Absent means "choose for me"; an explicit null is refused as the schema says (a number), so
        # that no client sends null believing it means something else.
        if value is None:
            raise ValueError("alpha must be a number in (0, 100]: omit it to have the service choose one")
        return value


Coefficient = Annotated[
    float,
    Field(gt=-1e6, lt=1e6, allow_inf_nan=False, json_schema_extra={"not": {"const": 0}}),
]


class ComposeRequest(EditOptions, VariantMetadataFields):
    terms: dict[str, Coefficient] = Field(min_length=1, max_length=256, description="concept -> coefficient")

    @field_validator("terms")
    @classmethod
    def _finite(cls, value: dict[str, float]) -> dict[str, float]:
        bad = [k for k, c in value.items() if not (abs(c) < 1e6) or c == 0]
        if bad:
            raise ValueError(f"coefficients must be finite, non-zero and |c| < 1e6: {bad}")
        return value
