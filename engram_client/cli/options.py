"""Options that several commands share, as ``Annotated`` aliases, and the choices they take.

One definition per option keeps its flag, help text and choices the same wherever it appears
(``unlearn``, ``compose``, ``calibrate``, ``map`` ...) and the command signatures short.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from api_schemas.models import MAX_PAGE_SIZE


class Scaling(str, Enum):
    uniform = "uniform"
    weight_norm = "weight_norm"


class LoraTarget(str, Enum):
    peft = "peft"
    vllm = "vllm"


class Format(str, Enum):
    checkpoint = "checkpoint"
    delta = "delta"
    peft = "peft"


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
    list[str] | None, typer.Option("--reference", help="Reference concept (repeat; default: every ready concept).")
]
FormatOpt = Annotated[Format | None, typer.Option("--format", help="checkpoint, delta (changed tensors) or peft (LoRA).")]
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
