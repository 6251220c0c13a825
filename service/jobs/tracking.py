"""A job's outcome logged to an experiment tracker (MLflow), where platform teams already look.

On when ``ENGRAM_MLFLOW_TRACKING_URI`` is set: the domains describe a run (:class:`RunRecord`: params,
tags, metrics and small artifacts) and :func:`log_run` logs it to the experiment
``ENGRAM_MLFLOW_EXPERIMENT`` through ``MlflowClient``, with explicit run IDs, never mlflow's fluent API
(its active run is process-global, and the embedded job process runs its lanes in threads). The client
is the optional extra ``engram-service[mlflow]`` (mlflow-skinny), imported only when tracking is on.

A tracker is a side channel: a run that cannot be logged (the server down or refusing a value) never
fails its job, whose output is already published. It is not silent either: a WARNING names the run
and the error, and the job's result carries a :class:`~api_schemas.jobs.TrackingRun` with ``logged``
false and that warning. A run that fails half-way is marked FAILED on the server when it can be.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api_schemas.jobs import TrackingRun
from service.config import Settings

log = logging.getLogger("engram.tracking")

# MLflow's limits on one log_batch request and on a param's value (mlflow.utils.validation).
BATCH_PARAMS, BATCH_METRICS, BATCH_TAGS = 100, 1000, 100
MAX_PARAM_VALUE = 6000
# What a metric, param or tag name may hold (mlflow.utils.validation._VALID_PARAM_AND_METRIC_NAMES).
_NAME_REFUSED = re.compile(r"[^\w\-. /]")
PARENT_TAG = "mlflow.parentRunId"  # how the MLflow UI nests a run under another


@dataclass(frozen=True)
class RunRecord:
    """One run as the tracker gets it: names are made valid by :func:`metric_name`; an artifact is a
    file name and its bytes (small records only: never a checkpoint)."""

    name: str
    params: Mapping[str, str] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    artifacts: Mapping[str, bytes] = field(default_factory=dict)
    parent_run_id: str | None = None


def tracking_enabled(settings: Settings) -> bool:
    return bool(settings.mlflow_tracking_uri)


def log_run(settings: Settings, name: str, describe: Callable[[], RunRecord]) -> TrackingRun | None:
    """Log the run ``describe`` makes (None: tracking is off).

    Args:
        name: the run's name, for the warning when ``describe`` itself fails.
        describe: the run's content, made only when tracking is on (it may read storage).

    Returns:
        where it was logged, or ``logged=False`` with the warning when anything failed (already
        logged as a WARNING here): the caller's job goes on either way.
    """
    if not tracking_enabled(settings):
        return None
    try:
        return _log(settings, describe())
    except Exception as exc:  # any failure of the side channel: reported below, never the job's failure
        detail = " ".join(str(exc).split())[:300]
        warning = (
            f"MLflow run {name!r} was not logged to {settings.mlflow_tracking_uri} ({type(exc).__name__}: {detail}); "
            "the job's output is kept: check that the MLflow server is up and reachable from the workers "
            "(ENGRAM_MLFLOW_TRACKING_URI)"
        )
        log.warning("%s", warning)
        return TrackingRun(logged=False, warning=warning)


def _log(settings: Settings, run: RunRecord) -> TrackingRun:
    client = _client(settings)
    experiment_id = _experiment_id(client, settings.mlflow_experiment)
    tags = {**run.tags, **({PARENT_TAG: run.parent_run_id} if run.parent_run_id else {})}
    run_id: str = client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id
    try:
        _log_values(client, run_id, run)
        with tempfile.TemporaryDirectory(prefix="engram-tracking-") as tmp:
            for file_name, content in run.artifacts.items():
                path = Path(tmp) / file_name
                path.write_bytes(content)
                client.log_artifact(run_id, str(path))
    except BaseException:
        _mark_failed(client, run_id)
        raise
    client.set_terminated(run_id, "FINISHED")
    url = run_url(str(settings.mlflow_tracking_uri), experiment_id, run_id)
    log.info("MLflow run %r logged: %s", run.name, url or run_id)
    return TrackingRun(logged=True, run_id=run_id, experiment_id=experiment_id, url=url, parent_run_id=run.parent_run_id)


def _client(settings: Settings) -> Any:
    # mlflow reads its HTTP bounds from the environment at each request. Its defaults (a 120 s timeout,
    # 7 retries with exponential backoff) would hold a job for minutes when the server is down; an
    # operator's own MLFLOW_HTTP_* values are kept.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, round(settings.mlflow_timeout_s))))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    # The run's URL is logged here (a JSON log line), not printed to the worker's stdout by mlflow.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    from mlflow import MlflowClient  # the optional extra: only with tracking on

    return MlflowClient(tracking_uri=settings.mlflow_tracking_uri)


def _experiment_id(client: Any, name: str) -> str:
    """The experiment's ID, created on first use (by whichever worker comes first)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name))
    except Exception:
        found = client.get_experiment_by_name(name)  # another worker created it meanwhile
        if found is None:
            raise
        return str(found.experiment_id)


def _log_values(client: Any, run_id: str, run: RunRecord) -> None:
    """Params, metrics and tags in log_batch requests within MLflow's per-request limits."""
    from mlflow.entities import Metric, Param

    params = [Param(metric_name(k), param_value(v)) for k, v in sorted(run.params.items())]
    now = int(time.time() * 1000)
    metrics = [Metric(metric_name(k), float(v), now, 0) for k, v in sorted(run.metrics.items())]
    for start in range(0, len(params), BATCH_PARAMS):
        client.log_batch(run_id, params=params[start : start + BATCH_PARAMS])
    for start in range(0, len(metrics), BATCH_METRICS):
        client.log_batch(run_id, metrics=metrics[start : start + BATCH_METRICS])


def _mark_failed(client: Any, run_id: str) -> None:
    try:
        client.set_terminated(run_id, "FAILED")
    except Exception:  # the server that failed the run may refuse this too: the caller reports the first error
        log.debug("MLflow run %s could not be marked FAILED", run_id, exc_info=True)


def metric_name(name: str) -> str:
    """``name`` with each character MLflow refuses in a name (``:`` of ``quantize:Q4_1``) as ``_``."""
    return _NAME_REFUSED.sub("_", name)[:250]


def param_value(value: str) -> str:
    """A param within MLflow's length limit; a longer one says where the whole value is."""
    if len(value) <= MAX_PARAM_VALUE:
        return value
    note = f"... ({len(value)} characters: the whole value is in the run's artifacts)"
    return value[: MAX_PARAM_VALUE - len(note)] + note


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI of an HTTP tracking server (None for other stores)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def numeric_leaves(value: Any, prefix: str = "", *, skip: frozenset[str] = frozenset()) -> dict[str, float]:
    """Every number in a JSON value, named by its path (``variant.forget.exact_match``; a list item by
    its index); booleans as 0/1; None, strings and the keys in ``skip`` (at any depth) left out."""
    if isinstance(value, bool):
        return {prefix: float(value)}
    if isinstance(value, int | float):
        return {prefix: float(value)}
    items: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        items = [(str(k), v) for k, v in value.items() if str(k) not in skip]
    elif isinstance(value, list):
        items = [(str(i), v) for i, v in enumerate(value)]
    found: dict[str, float] = {}
    for key, item in items:
        found |= numeric_leaves(item, f"{prefix}.{key}" if prefix else key, skip=skip)
    return found
