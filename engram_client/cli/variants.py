"""``engram variants list | show | download | receipt | delete``: the edited models the service has built."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from engram_client.cli.files import write_atomically
from engram_client.cli.options import CursorOpt, Force, JsonFlag, LimitOpt
from engram_client.cli.output import emit, note_next_page, stdout
from engram_client.cli.progress import download
from engram_client.cli.render import render_variant, render_variants
from engram_client.cli.root import session

variants_app = typer.Typer(help="List, inspect, download, get receipts of and delete variants.", no_args_is_help=True)


@variants_app.command("list")
def variants_list(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only the variants of this model.")] = None,
    limit: LimitOpt = None,
    cursor: CursorOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """Variants by ID (or one model's) with their terms, options and status (every page unless
    --limit/--cursor)."""
    with session(ctx) as client:
        variants = client.list_variants(model, limit=limit, cursor=cursor)
    emit(ctx, as_json, variants, lambda: render_variants(variants))
    note_next_page(variants.next_cursor)


@variants_app.command("show")
def variants_show(ctx: typer.Context, variant_id: str, as_json: JsonFlag = False) -> None:
    """A variant: terms, options, status and files."""
    with session(ctx) as client:
        variant = client.get_variant(variant_id)
    emit(ctx, as_json, variant, lambda: render_variant(variant))


@variants_app.command("download")
def variants_download(
    ctx: typer.Context,
    variant_id: str,
    out: Annotated[Path, typer.Option("--out", "-o", help="A new directory for the variant's files.")],
    force: Force = False,
    as_json: JsonFlag = False,
) -> None:
    """Download a ready variant; every file's size and sha256 is verified before the directory appears."""
    with session(ctx) as client:
        variant = client.get_variant(variant_id)
        download(client, variant, out, force)
    emit(ctx, as_json, variant, lambda: None)


@variants_app.command("receipt")
def variants_receipt(
    ctx: typer.Context,
    variant_id: str,
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to save the receipt (JSON), for `engram verify`.")],
) -> None:
    """Save a ready variant's receipt: what made it and every file's sha256, signed by the service."""
    with session(ctx) as client:
        answer = client.variant_receipt(variant_id)
    write_atomically(out, (answer.model_dump_json(indent=2) + "\n").encode("utf-8"))
    state = "signed (Ed25519)" if answer.signed else "UNSIGNED: " + (answer.note or "")
    stdout.print(f"receipt of variant {variant_id} saved to {out}: {state}; digest {answer.digest}")


@variants_app.command("delete")
def variants_delete(ctx: typer.Context, variant_id: str) -> None:
    """Delete a variant and everything it owns (the key that created it, or an admin key)."""
    with session(ctx) as client:
        client.delete_variant(variant_id)
    stdout.print(f"variant {variant_id} deleted")
