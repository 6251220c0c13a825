"""A variant's receipt: one record that chains it to what made it, signed with the operator's key.

The record (``GET /variants/{id}/receipt``) names the request (concepts, coefficients, options, who,
when, reason, labels, the variant it reverts), each concept's dataset sha256 and the digest of its
statistics' manifest on the model, the universe, the base model's files and identity, every output
file's sha256 (from the variant's manifest) and the evaluations stored for it (with any attack
reports, and who asked for each, when, why and on which probe sets' digests; per-probe records are
left out: they are the probes' content). It is made from storage on
each request, so it grows with each evaluation; nothing in it is a time of reading, so the same
stored state gives the same bytes, hence the same digest and signature.

Signed with Ed25519 (the ``cryptography`` package) over :func:`api_schemas.variants.canonical_receipt_bytes`
when ``ENGRAM_RECEIPT_SIGNING_KEY`` names a private key (a PEM file's path or the PEM itself); the
public key is published at ``GET /receipt-key`` and carried in the receipt. Without a key the
receipt is served unsigned and says so: its digest still lets a reader check the files, not who
issued it.
"""

from __future__ import annotations

import base64
import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from api_schemas import Variant
from api_schemas.variants import ReceiptKey, VariantReceipt, canonical_receipt_bytes
from service.concepts.service import find_concept
from service.context import Context
from service.errors import Conflict, NotFound, ServiceUnavailable
from service.models.registry import find_model
from service.statistics.key import manifest_key
from service.storage.keys import canonical_digest, variant_plan_key
from service.variants.deletion import evaluation_keys
from service.variants.plan import VariantPlan
from service.variants.provenance import find_provenance
from service.variants.service import find_variant_request, variant_view

RECEIPT_FORMAT = "engram-receipt/1"
UNSIGNED_NOTE = "unsigned: the service has no ENGRAM_RECEIPT_SIGNING_KEY; the digest proves integrity only"
# Options of the request that shape the weights (the rest of the view is status).
OPTION_FIELDS = (
    "scaling",
    "format",
    "lora_rank",
    "lora_target",
    "gguf_quantization",
    "modules",
    "layers",
    "module_strengths",
    "rcond",
    "reference",
)


def variant_receipt(ctx: Context, variant_id: str) -> VariantReceipt:
    """The signed (or explicitly unsigned) receipt of a ready variant (404 unknown, 409 not ready)."""
    view = variant_view(ctx, variant_id)
    if view.status != "ready":
        raise Conflict(f"variant {variant_id} is {view.status}: a receipt names its files, so only a ready one has one")
    receipt = receipt_record(ctx, view)
    body = canonical_receipt_bytes(receipt)
    digest = hashlib.sha256(body).hexdigest()
    key = signing_key(ctx.settings.receipt_signing_key)
    if key is None:
        return VariantReceipt(receipt=receipt, digest=digest, signed=False, note=UNSIGNED_NOTE)
    signature = base64.b64encode(key.sign(body)).decode("ascii")
    return VariantReceipt(
        receipt=receipt,
        digest=digest,
        signed=True,
        algorithm="Ed25519",
        signature=signature,
        public_key=_public_pem(key),
    )


def receipt_key(ctx: Context) -> ReceiptKey:
    """The public key receipts are signed with (404 when none is configured)."""
    key = signing_key(ctx.settings.receipt_signing_key)
    if key is None:
        raise NotFound("no receipt signing key is configured (ENGRAM_RECEIPT_SIGNING_KEY): receipts are unsigned")
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return ReceiptKey(public_key=_public_pem(key), fingerprint=hashlib.sha256(raw).hexdigest())


def receipt_record(ctx: Context, view: Variant) -> dict[str, Any]:
    """The unsigned record of a ready variant (see the module's docstring for what it chains)."""
    plan_data = ctx.storage.find_json(variant_plan_key(view.variant_id))
    plan = VariantPlan.stored(variant_plan_key(view.variant_id), plan_data) if plan_data is not None else None
    request = find_variant_request(ctx, view.variant_id)
    if request is None:  # deleted since the view was read
        raise NotFound(f"variant {view.variant_id} does not exist")
    record = find_provenance(ctx, view.variant_id)
    return {
        "format": RECEIPT_FORMAT,
        "variant_id": view.variant_id,
        "request": {
            "model_id": view.model_id,
            "terms": view.terms,
            "alpha": view.alpha,
            "options": {name: getattr(view, name) for name in OPTION_FIELDS},
            "created_at": view.created_at,
            "created_by": view.created_by,
            "labels": view.labels,
            "reason": view.reason,
            "reverts": view.reverts,
            "provenance_recorded": record is not None,
        },
        "reverts": view.reverts,
        "concepts": [_concept(ctx, view.model_id, name, request.term_stats[name], c) for name, c in view.terms.items()],
        "universe": {
            "universe_id": request.universe_id,
            "members": [list(member) for member in plan.universe] if plan is not None else None,
            "statistics": list(request.universe_stats),
        },
        "plan": None if plan is None else {"edited_layers": list(plan.edited), "unreached_layers": list(plan.unreached)},
        "base_model": _base_model(ctx, view.model_id, plan),
        "files": sorted(({"path": f.path, "size": f.size, "sha256": f.sha256} for f in view.files), key=_path),
        "evaluations": _evaluations(ctx, view.variant_id),
    }


def _concept(ctx: Context, model_id: str, name: str, stats: str, coefficient: float) -> dict[str, Any]:
    concept = find_concept(ctx, name)
    manifest = ctx.storage.find_json(manifest_key(stats))
    return {
        "name": name,
        "coefficient": coefficient,
        "dataset_sha256": concept.dataset_digest if concept is not None else None,
        "num_records": concept.num_records if concept is not None else None,
        "statistics": stats,
        "statistics_manifest_sha256": canonical_digest(manifest) if manifest is not None else None,
        "collection_job": concept.models[model_id].job_id if concept is not None and model_id in concept.models else None,
    }


def _base_model(ctx: Context, model_id: str, plan: VariantPlan | None) -> dict[str, Any]:
    model = find_model(ctx, model_id)
    return {
        "model_id": model_id,
        "planned_digest": plan.model_digest if plan is not None else None,
        "digest": model.digest if model is not None else None,
        "source": model.source if model is not None else None,
        "architecture": model.architecture if model is not None else None,
        "files": dict(sorted((model.file_sha256 or {}).items())) if model is not None else None,
        "registered": model is not None,
    }


def _evaluations(ctx: Context, variant_id: str) -> list[dict[str, Any]]:
    """Each stored evaluation of the variant, without its per-probe records."""
    found = []
    for key in evaluation_keys(ctx, variant_id):
        if key.endswith(".request.json"):
            continue
        stored = ctx.storage.find_json(key) or {}
        kept = {k: v for k, v in stored.items() if k not in ("records", "reused")}
        found.append({"evaluation_id": key.removeprefix("evaluations/").removesuffix(".json"), **kept})
    return found


def _path(entry: dict[str, Any]) -> str:
    return str(entry["path"])


def _public_pem(key: Ed25519PrivateKey) -> str:
    pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return pem.decode("ascii")


@lru_cache(maxsize=4)
def signing_key(configured: str | None) -> Ed25519PrivateKey | None:
    """The private key ``ENGRAM_RECEIPT_SIGNING_KEY`` names (None: unset).

    Raises:
        ServiceUnavailable: set but not an unencrypted Ed25519 PEM private key (named, without its content).
    """
    if not configured:
        return None
    text = configured.strip()
    try:
        pem = text.encode("ascii") if text.startswith("-----BEGIN") else Path(text).read_bytes()
        key = serialization.load_pem_private_key(pem, password=None)
    except (OSError, ValueError, TypeError) as exc:
        where = "the PEM given" if text.startswith("-----BEGIN") else f"the file {text}"
        raise ServiceUnavailable(
            f"ENGRAM_RECEIPT_SIGNING_KEY: {where} is not a readable unencrypted PEM private key ({type(exc).__name__}); "
            "make one with `openssl genpkey -algorithm ed25519`"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ServiceUnavailable("ENGRAM_RECEIPT_SIGNING_KEY is not an Ed25519 key: `openssl genpkey -algorithm ed25519`")
    return key
