"""An evaluation as an MLflow run (with ``ENGRAM_MLFLOW_TRACKING_URI``), nested under its variant's run.

Its metrics are every number of the stored evaluation, named by their path in it: per model and
split the answer NLL and exact match (``summary.variant.forget.exact_match``), TOFU's values
(``tofu.variant.forget_quality``), a classifier's accuracies, DA, NMI, ToW and CKA, and per attack
the same under ``attacks.<attack>.`` (``attacks.quantize_Q4_1.summary.variant.forget.exact_match``:
a character MLflow refuses in a name becomes ``_``). Not metrics: the per-probe records (in the
artifact), the attacks' own settings (params), the probe sets' digests and sizes (params
``probes.<set>``) and the forgotten class IDs. Who asked, when and why are tags (``engram.created_by``,
``engram.created_at``, ``engram.reason``, ``engram.label.<key>``). The stored evaluation
itself is the artifact ``evaluation.json``. The run is nested under its variant's run (the MLflow
tag ``mlflow.parentRunId``), logged first when it was not (the tracking server was down then), and
tagged with the variant's ID either way.
"""

from __future__ import annotations

import json
from typing import Any

from api_schemas.jobs import TrackingRun
from service.context import Context
from service.jobs.tracking import RunRecord, log_run, numeric_leaves, tracking_enabled
from service.variants.tracking import track_variant

# Keys of a stored evaluation that hold no score (at any depth): records and IDs, an attack's settings.
NOT_METRICS = frozenset(
    {"records", "reused", "variant_id", "retain_model", "forgotten_classes", "attack", "probe_sets", "labels"}
)


def track_evaluation(ctx: Context, evaluation_id: str, job_id: str, stored: dict[str, Any]) -> TrackingRun | None:
    """Log the evaluation ``stored`` (as ``evaluations/<id>.json`` holds it) as a run (None: tracking is off)."""
    if not tracking_enabled(ctx.settings):
        return None
    variant_run = track_variant(ctx, str(stored["variant_id"]))
    parent = variant_run.run_id if variant_run is not None and variant_run.logged else None
    name = f"evaluation {evaluation_id[:12]}"
    return log_run(ctx.settings, name, lambda: evaluation_run(ctx, name, evaluation_id, job_id, stored, parent))


def evaluation_run(
    ctx: Context, name: str, evaluation_id: str, job_id: str, stored: dict[str, Any], parent: str | None
) -> RunRecord:
    variant_id = str(stored["variant_id"])
    base = ctx.settings.public_url or ""
    params = {
        "variant_id": variant_id,
        "evaluation_id": evaluation_id,
        "retain_model": json.dumps(stored.get("retain_model")),
    }
    attacks = stored.get("attacks") or {}
    params |= {f"attack.{attack}": json.dumps(report.get("attack"), sort_keys=True) for attack, report in attacks.items()}
    probe_sets = stored.get("probe_sets") or {}
    params |= {f"probes.{name}": f"{entry['sha256']} ({entry['n']})" for name, entry in probe_sets.items()}
    tags = {
        "engram.kind": "evaluation",
        "engram.variant_id": variant_id,
        "engram.evaluation_id": evaluation_id,
        "engram.job_url": f"{base}/jobs/{job_id}",
        "engram.variant_url": f"{base}/variants/{variant_id}",
        **({"engram.variant_run_id": parent} if parent else {}),
        **_provenance_tags(stored),
    }
    return RunRecord(
        name=name,
        params=params,
        tags=tags,
        metrics=numeric_leaves(stored, skip=NOT_METRICS),
        artifacts={"evaluation.json": json.dumps(stored, indent=2, sort_keys=True).encode()},
        parent_run_id=parent,
    )


def _provenance_tags(stored: dict[str, Any]) -> dict[str, str]:
    """Who asked, when and why (absent in an evaluation stored before they were recorded)."""
    tags = {f"engram.{field}": str(stored[field]) for field in ("created_at", "created_by", "reason") if stored.get(field)}
    return tags | {f"engram.label.{key}": value for key, value in (stored.get("labels") or {}).items()}
