"""``engram verify RECEIPT DIR``: a downloaded variant folder against its receipt, offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from engram_client.cli.output import stdout
from engram_client.receipts import verify_folder


def verify_command(
    receipt: Annotated[Path, typer.Argument(help="the receipt, saved from GET /variants/{id}/receipt", exists=True)],
    folder: Annotated[Path, typer.Argument(help="the downloaded variant folder")],
    public_key: Annotated[
        Path | None,
        typer.Option("--public-key", help="the service's PEM public key (GET /receipt-key), to check who signed"),
    ] = None,
) -> None:
    """Check every file of a downloaded variant against its receipt (sha256, nothing missing or extra)
    and the receipt's signature; exit 1 naming each difference. Needs no server."""
    try:
        document = json.loads(receipt.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        typer.secho(f"{receipt}: not a JSON receipt ({exc})", fg="red", err=True)
        raise typer.Exit(1) from None
    key = public_key.read_bytes() if public_key is not None else None
    verdict = verify_folder(document if isinstance(document, dict) else {}, folder, key)
    for warning in verdict.warnings:
        typer.secho(f"warning: {warning}", fg="yellow", err=True)
    for difference in verdict.differences:
        typer.secho(f"DIFFERS {difference}", fg="red", err=True)
    if not verdict.ok:
        raise typer.Exit(1)
    stdout.print(f"OK: {verdict.checked_files} files match the receipt of variant {document['receipt'].get('variant_id')}")
