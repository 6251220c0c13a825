"""A built variant as an MLflow run (with ``ENGRAM_MLFLOW_TRACKING_URI``): what it is and why it was made.

The run holds the request as params (model, concepts with their coefficients, α, every edit option,
universe, the creating key's fingerprint, reason, labels), tags to find it by (its ID, model, labels)
and to reach it here (the variant, receipt and model card URLs), a few metrics of the build, and two
artifacts: its receipt (``receipt.json``, as ``GET /variants/{id}/receipt`` serves it, so
``engram verify`` reads it) and its model card (``README.md``). Never the checkpoint: the run points
to the service that holds it.

Logged once per tracking server and experiment: the run's record (``variants/<id>/tracking.json``,
deleted with the variant, naming both) is written after the run is logged, so a redelivered job or a
later evaluation finds it and logs no second run, and an evaluation whose variant's run could not be
logged (or was logged to another server) logs it first, to be nested under it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from api_schemas.jobs import TrackingRun
from service.context import Context
from service.jobs.tracking import RunRecord, log_run, tracking_enabled
from service.storage.base import StorageUnavailable
from service.storage.keys import variant_tracking_key
from service.variants.model_card import model_card
from service.variants.receipt import variant_receipt

log = logging.getLogger("engram.variants")


def track_variant(ctx: Context, variant_id: str, metrics: dict[str, float] | None = None) -> TrackingRun | None:
    """The variant's MLflow run: the one recorded, else logged now (None: tracking is off).

    Args:
        variant_id: a ready variant (its manifest published).
        metrics: the build's own figures (seconds, layers) when the caller has them.
    """
    if not tracking_enabled(ctx.settings):
        return None
    # Where the run went: a record of another tracking server or experiment (the settings changed) is not this one's.
    where = {"tracking_uri": ctx.settings.mlflow_tracking_uri, "experiment": ctx.settings.mlflow_experiment}
    stored = ctx.storage.find_json(variant_tracking_key(variant_id))
    if stored is not None and all(stored.get(k) == v for k, v in where.items()):
        return TrackingRun.model_validate(stored)
    tracked = log_run(ctx.settings, f"variant {variant_id}", lambda: variant_run(ctx, variant_id, metrics or {}))
    if tracked is not None and tracked.logged:
        try:
            ctx.storage.put_json(variant_tracking_key(variant_id), {**tracked.model_dump(mode="json"), **where})
        except StorageUnavailable:  # the run exists; only its record is missing: a later evaluation runs unnested
            log.warning("variant %s: MLflow run %s logged, but its record could not be stored", variant_id, tracked.run_id)
    return tracked


def variant_run(ctx: Context, variant_id: str, metrics: dict[str, float]) -> RunRecord:
    """The run's content, from the variant's receipt (what it chains is what the run shows)."""
    answer = variant_receipt(ctx, variant_id)
    receipt = answer.receipt
    files_bytes = sum(int(f["size"]) for f in receipt["files"])
    edited = len((receipt.get("plan") or {}).get("edited_layers") or [])
    return RunRecord(
        name=f"variant {variant_id[:12]}",
        params=variant_params(receipt),
        tags=variant_tags(ctx, receipt, answer.digest, answer.signed),
        metrics={"files_bytes": float(files_bytes), "edited_layers": float(edited), **metrics},
        artifacts={
            "receipt.json": json.dumps(answer.model_dump(mode="json"), indent=2, sort_keys=True).encode(),
            "README.md": model_card(answer).encode(),
        },
    )


def variant_params(receipt: dict[str, Any]) -> dict[str, str]:
    """The request as params: each option and each label its own, so MLflow compares runs by them."""
    request = receipt["request"]
    params = {
        "model_id": str(request["model_id"]),
        "concepts": ",".join(sorted(request["terms"])),
        "terms": json.dumps(request["terms"], sort_keys=True),
        "alpha": _text(request["alpha"]),
        "universe_id": str(receipt["universe"]["universe_id"]),
        "created_by": _text(request.get("created_by")),
        "reason": _text(request.get("reason")),
        "reverts": _text(request.get("reverts")),
    }
    params |= {f"option.{name}": _text(value) for name, value in request["options"].items()}
    params |= {f"label.{key}": str(value) for key, value in (request.get("labels") or {}).items()}
    return params


def variant_tags(ctx: Context, receipt: dict[str, Any], digest: str, signed: bool) -> dict[str, str]:
    """What finds the run (IDs, labels) and what reaches the variant from it (this service's URLs)."""
    variant_id, request = receipt["variant_id"], receipt["request"]
    base = f"{ctx.settings.public_url or ''}/variants/{variant_id}"
    tags = {
        "engram.kind": "variant",
        "engram.variant_id": variant_id,
        "engram.model_id": str(request["model_id"]),
        "engram.universe_id": str(receipt["universe"]["universe_id"]),
        "engram.receipt_digest": digest,
        "engram.receipt_signed": str(signed).lower(),
        "engram.variant_url": base,
        "engram.receipt_url": f"{base}/receipt",
        "engram.model_card_url": f"{base}/model-card",
    }
    return tags | {f"label.{key}": str(value) for key, value in (request.get("labels") or {}).items()}


def _text(value: Any) -> str:
    """A param's text: strings as they are, anything else as JSON (``null`` for unset)."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
