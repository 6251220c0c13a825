"""Options that several commands share, as ``Annotated`` aliases, and the choices they take.

One definition per option keeps its flag, help text and choices the same wherever it appears
(``unlearn``, ``compose``, ``calibrate``, ``map`` ...) and the command signatures short.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args, get_origin

import typer
from pydantic import BaseModel

from api_schemas import MAX_PAGE_SIZE, ConceptCreate, DatasetReference, EditOptions, GenerateRequest


def contract_choices(model: type[BaseModel], field: str) -> type[Enum]:
    """The values of a ``Literal`` field of the wire contract as an Enum, the choices of a flag: a value
    the contract gains is a choice of the CLI with no change here."""
    values = _literal_values(model.model_fields[field].annotation)
    if not values or not all(isinstance(v, str) for v in values):
        raise TypeError(f"{model.__name__}.{field} is not a Literal of strings: its flag cannot list its choices")
    return Enum(field, {v: v for v in values}, type=str)  # type: ignore[return-value]  # mypy reads only literals


def _literal_values(annotation: Any) -> tuple[Any, ...]:
    """The values of the ``Literal`` in an annotation, also inside ``| None`` or ``list[...]``."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return tuple(value for arg in get_args(annotation) for value in _literal_values(arg))


if TYPE_CHECKING:  # mypy cannot see the members of an Enum made at import time; the commands read only .value
    Scaling = Enum
    Format = Enum
    LoraTarget = Enum
    GgufQuantization = Enum
    Role = Enum
    Template = Enum
    DatasetFormat = Enum
    Generator = Enum
else:
    Scaling = contract_choices(EditOptions, "scaling")
    Format = contract_choices(EditOptions, "format")
    LoraTarget = contract_choices(EditOptions, "lora_target")
    GgufQuantization = contract_choices(EditOptions, "gguf_quantization")
    Role = contract_choices(ConceptCreate, "role")
    Template = contract_choices(ConceptCreate, "template")
    DatasetFormat = contract_choices(DatasetReference, "format")
    Generator = contract_choices(GenerateRequest, "models")


JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
# Lists: every page by default; --limit (or --cursor) shows one page, and stderr says how to get the next.
LimitOpt = Annotated[
    int | None,
    typer.Option("--limit", min=1, max=MAX_PAGE_SIZE, help="Show one page of at most N items (default: all of them)."),
]
CursorOpt = Annotated[
    str | None, typer.Option("--cursor", help="Show the page that starts here: the cursor a previous page printed.")
]
NoWait = Annotated[bool, typer.Option("--no-wait", help="Submit and return at once; do not watch the job.")]
OutDir = Annotated[Path | None, typer.Option("--out", "-o", help="Download the variant into this new directory.")]
Force = Annotated[bool, typer.Option("--force", help="Replace a non-empty --out directory (only once all files verified).")]
ScalingOpt = Annotated[Scaling | None, typer.Option(help="Per-layer strength (weight_norm: the paper's W-Norm).")]
ModuleOpt = Annotated[list[str] | None, typer.Option("--module", help="Edit only modules with this name suffix (repeat).")]
LayerOpt = Annotated[list[int] | None, typer.Option("--layer", help="Edit only this block index (repeat).")]
RcondOpt = Annotated[float | None, typer.Option(help="Pseudo-inverse cut: keep eigenvalues above rcond·λmax.")]
ReferenceOpt = Annotated[
    list[str] | None, typer.Option("--reference", help="Reference concept (repeat; default: the model's current universe).")
]
FormatOpt = Annotated[
    Format | None,
    typer.Option("--format", help="checkpoint, delta (changed tensors), peft (LoRA) or gguf (one .gguf file, Llama only)."),
]
GgufQuantizationOpt = Annotated[
    GgufQuantization | None,
    typer.Option(help="Format gguf: the type its matrices are written in (default: the model's own .gguf type, else F16)."),
]
LoraRankOpt = Annotated[int | None, typer.Option(help="Format peft: the largest LoRA rank.")]
CallbackOpt = Annotated[str | None, typer.Option(help="URL the service POSTs the job to when it ends.")]
StrengthOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--strength",
        help="SUFFIX=S: edit modules ending in SUFFIX at S times the strength, 0 < S ≤ 4 (repeat; longest suffix wins).",
    ),
]
LoraTargetOpt = Annotated[
    LoraTarget | None, typer.Option(help="Format peft: vllm writes an adapter at a rank vLLM serves, without bias edits.")
]
UniverseOpt = Annotated[str | None, typer.Option(help="Edit relative to this built universe (its ID).")]
AdapterBaseModelOpt = Annotated[
    str | None,
    typer.Option(
        help="Format peft: the base_model_name_or_path written into the adapter (a folder or hub name as the "
        "loading machine sees it), so AutoPeftModelForCausalLM.from_pretrained(adapter_dir) finds the base."
    ),
]
