"""``engram models add | list | show``: register model checkpoints and look at their editable layers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from engram_client.cli.options import CursorOpt, JsonFlag, LimitOpt
from engram_client.cli.output import emit, note_next_page, stdout
from engram_client.cli.render import render_model, render_models
from engram_client.cli.root import session

models_app = typer.Typer(help="Register and inspect models.", no_args_is_help=True)


def _source_uri(source: str) -> str:
    """A bare local directory becomes ``file:///abs/dir``; URIs pass unchanged; anything else is a usage error."""
    if "://" in source:
        return source
    if not Path(source).is_dir():
        raise typer.BadParameter(
            f"{source} is no directory here; give a local checkpoint directory or a URI "
            "(file:///abs/dir, s3://bucket/prefix/, hf://org/name)",
            param_hint="SOURCE",
        )
    return Path(source).resolve().as_uri()


@models_app.command("add")
def models_add(
    ctx: typer.Context,
    model_id: Annotated[str, typer.Argument(help="Hugging Face style ID: name or org/name.")],
    source: Annotated[
        str, typer.Argument(help="file:///abs/dir, s3://bucket/prefix/, hf://org/name\\[@rev] or a local dir.")
    ],
    as_json: JsonFlag = False,
) -> None:
    """Register a model checkpoint (the same registration again is a no-op)."""
    uri = _source_uri(source)
    with session(ctx) as client:
        model = client.register_model(model_id, uri)
    emit(
        ctx,
        as_json,
        model,
        lambda: stdout.print(
            f"model {model.model_id}: {model.architecture}, {model.num_parameters:,} parameters, "
            f"{len(model.layers)} editable layers"
        ),
    )


@models_app.command("list")
def models_list(ctx: typer.Context, limit: LimitOpt = None, cursor: CursorOpt = None, as_json: JsonFlag = False) -> None:
    """Registered models by ID (every page unless --limit/--cursor)."""
    with session(ctx) as client:
        models = client.list_models(limit=limit, cursor=cursor)
    emit(ctx, as_json, models, lambda: render_models(models))
    note_next_page(models.next_cursor)


@models_app.command("show")
def models_show(ctx: typer.Context, model_id: str, as_json: JsonFlag = False) -> None:
    """One model and its editable layers."""
    with session(ctx) as client:
        model = client.get_model(model_id)
    emit(ctx, as_json, model, lambda: render_model(model))
