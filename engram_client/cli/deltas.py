"""``engram apply-delta BASE_DIR DELTA OUT_DIR``: a delta variant applied to its base checkpoint folder,
locally (no service needed): the logic is :func:`engram_client.deltas.apply_delta`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from engram_client.cli.options import JsonFlag
from engram_client.cli.output import emit, fail, stderr, stdout
from engram_client.deltas import DeltaError, apply_delta


def apply_delta_command(
    ctx: typer.Context,
    base_dir: Annotated[Path, typer.Argument(help="The base checkpoint folder the variant was built from.")],
    delta: Annotated[Path, typer.Argument(help="The delta variant's delta.safetensors.")],
    out_dir: Annotated[Path, typer.Argument(help="A new folder for the edited checkpoint.")],
    as_json: JsonFlag = False,
) -> None:
    """Apply a delta variant to its base checkpoint: OUT_DIR gets the base's files with the changed
    tensors replaced (shards too), ready for from_pretrained. Nothing is written on failure."""
    try:
        report = apply_delta(base_dir, delta, out_dir)
    except DeltaError as exc:
        fail("Error", str(exc))
    except FileExistsError as exc:
        fail("Error", str(exc))
    except OSError as exc:
        fail("Error", f"{exc}; nothing was written to {out_dir}")

    def show() -> None:
        changed = len(report.replaced) + len(report.added)
        shards = ", ".join(report.shards_rewritten)
        stdout.print(f"wrote {out_dir}: {changed} tensor(s) replaced in {shards}", highlight=False)
        if report.untied:
            stderr.print("the delta untied the head from the embedding: config.json says tie_word_embeddings false")

    emit(ctx, as_json, dataclasses.asdict(report), show)
