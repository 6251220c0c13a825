"""``engram variants receipt | delete`` and ``engram verify`` as real processes against the live
server (which has no receipt signing key: its receipts say they are unsigned)."""

from __future__ import annotations

import json
from pathlib import Path

from engram_client import EngramClient
from tests.client.conftest import ReadyVariant
from tests.helpers.cli import failed, ok, run_cli, says


def test_a_saved_receipt_verifies_the_downloaded_folder(cli2: ReadyVariant, tmp_path: Path) -> None:
    saved, folder = tmp_path / "receipt.json", tmp_path / "variant"
    printed = ok(run_cli(cli2.url, "variants", "receipt", cli2.variant_id, "--out", saved)).stdout
    assert says(printed, "UNSIGNED")
    document = json.loads(saved.read_text())
    assert document["receipt"]["variant_id"] == cli2.variant_id and document["signed"] is False
    ok(run_cli(cli2.url, "variants", "download", cli2.variant_id, "--out", folder))
    checked = ok(run_cli(cli2.url, "verify", saved, folder))
    assert says(checked.stdout, f"{len(document['receipt']['files'])} files match")
    assert says(checked.stderr, "unsigned")
    (folder / "notes.txt").write_text("mine")
    failed(run_cli(cli2.url, "verify", saved, folder), "notes.txt", "not in the receipt")


def test_variants_delete_removes_a_variant_and_a_second_delete_says_it_is_gone(cli2: ReadyVariant) -> None:
    with EngramClient(cli2.url) as engram:
        submission = engram.compose(cli2.model, {"cli2-forget": -0.25})
        variant_id = engram.wait_for_variant(submission.variant.variant_id, poll_s=0.1).variant_id
    assert variant_id != cli2.variant_id
    assert says(ok(run_cli(cli2.url, "variants", "delete", variant_id)).stdout, "deleted")
    failed(run_cli(cli2.url, "variants", "show", variant_id), "does not exist")
    failed(run_cli(cli2.url, "variants", "delete", variant_id), "does not exist")
    ok(run_cli(cli2.url, "variants", "show", cli2.variant_id))  # the other variant of the model is untouched
