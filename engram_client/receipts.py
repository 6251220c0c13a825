"""Checking a downloaded variant folder against its receipt, offline (``engram verify``).

A receipt (``GET /variants/{id}/receipt``, saved as JSON) lists every file of the variant with its
size and sha256, and is signed with Ed25519 over its canonical JSON
(:func:`api_schemas.variants.canonical_receipt_bytes`). The check reads nothing but the receipt, the
folder and optionally the operator's public key: every listed file present with its sha256, no file
that is not listed, the receipt's digest, and its signature. A key read from the receipt itself only
shows the record was not altered after signing by someone without that key; whoever could edit the
receipt could replace the key too, so the check warns unless ``--public-key`` names the operator's.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api_schemas.variants import canonical_receipt_bytes

CHUNK = 1 << 20


@dataclass
class Verdict:
    """What the check found: ``differences`` (each naming the file or part of the receipt) fail it;
    ``warnings`` do not."""

    differences: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checked_files: int = 0

    @property
    def ok(self) -> bool:
        return not self.differences


def verify_folder(document: dict[str, Any], folder: Path, public_key_pem: bytes | None = None) -> Verdict:
    """Check ``folder`` against a receipt document (the service's answer: ``receipt``, ``digest``,
    ``signature``, ``public_key``)."""
    verdict = Verdict()
    receipt = document.get("receipt")
    if not isinstance(receipt, dict) or not isinstance(receipt.get("files"), list):
        verdict.differences.append("receipt: not a variant receipt (no receipt.files): save GET /variants/{id}/receipt")
        return verdict
    body = canonical_receipt_bytes(receipt)
    if document.get("digest") != hashlib.sha256(body).hexdigest():
        verdict.differences.append("receipt: its digest does not match its content (the record was edited)")
    _check_signature(document, body, public_key_pem, verdict)
    _check_files(receipt["files"], folder, verdict)
    return verdict


def _check_signature(document: dict[str, Any], body: bytes, public_key_pem: bytes | None, verdict: Verdict) -> None:
    if not document.get("signed"):
        if public_key_pem is not None:
            verdict.differences.append("receipt: unsigned, but --public-key expects a signature from that key")
        else:
            verdict.warnings.append("the receipt is unsigned: it shows the files match it, not who issued it")
        return
    if public_key_pem is None:
        embedded = document.get("public_key")
        if not isinstance(embedded, str):
            verdict.differences.append("receipt: signed but carries no public key: pass --public-key")
            return
        public_key_pem = embedded.encode("ascii")
        verdict.warnings.append(
            "checked with the public key inside the receipt: that proves integrity only; pass --public-key "
            "with the key the service publishes (GET /receipt-key) to check who signed it"
        )
    problem = _signature_problem(public_key_pem, str(document.get("signature") or ""), body)
    if problem:
        verdict.differences.append(f"receipt: {problem}")


def _signature_problem(public_key_pem: bytes, signature: str, body: bytes) -> str | None:
    """None when ``signature`` is a valid Ed25519 signature of ``body`` by the key, else why not."""
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        from cryptography.hazmat.primitives.serialization import load_pem_public_key
    except ImportError:
        return "cannot check the signature without the cryptography package: pip install cryptography"
    try:
        key = load_pem_public_key(public_key_pem)
    except ValueError:
        return "the public key is not a PEM public key"
    if not isinstance(key, Ed25519PublicKey):
        return "the public key is not an Ed25519 key"
    try:
        key.verify(base64.b64decode(signature, validate=True), body)
    except (InvalidSignature, ValueError):
        return "the signature does not verify with this public key"
    return None


def _check_files(listed: list[dict[str, Any]], folder: Path, verdict: Verdict) -> None:
    """Every listed file with its size and sha256, and no other file, named one by one."""
    if not folder.is_dir():
        verdict.differences.append(f"{folder}: not a directory")
        return
    expected = {str(entry["path"]): entry for entry in listed}
    present = {path.relative_to(folder).as_posix(): path for path in sorted(folder.rglob("*")) if path.is_file()}
    for name in sorted(expected.keys() - present.keys()):
        verdict.differences.append(f"{name}: missing")
    for name in sorted(present.keys() - expected.keys()):
        verdict.differences.append(f"{name}: not in the receipt (an extra file)")
    for name in sorted(expected.keys() & present.keys()):
        entry, size, digest = expected[name], *_size_and_sha256(present[name])
        verdict.checked_files += 1
        if size != entry.get("size"):
            verdict.differences.append(f"{name}: {size} bytes, the receipt says {entry.get('size')}")
        elif digest != entry.get("sha256"):
            verdict.differences.append(f"{name}: sha256 {digest} differs from the receipt's {entry.get('sha256')}")


def _size_and_sha256(path: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as source:
        while chunk := source.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()
