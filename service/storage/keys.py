"""Every storage key of the service, spelled once (content-addressed where the content determines it).

- ``models/<quoted id>.json``: registration and checkpoint layout
- ``datasets/<sha256>.jsonl``: the records a user sent, byte for byte as normalised JSON lines
- ``concepts/<name>.json``: name, role, dataset digest, and one collection job per model
- ``stats/<model digest>/<dataset digest>/<settings digest>/``: a concept's statistics on a model
  (:mod:`service.statistics.key` spells the prefix and its files: storage knows no statistics format)
- ``variants/<variant id>/request.json`` at submission, ``files/...``, ``manifest.json`` last
  (then ``tracking.json``: its MLflow run, when tracking is on and the run was logged)
- ``variant-plans/<variant id>.json``: the variant's plan, what its job runs
- ``universes/<universe id>/``: ``request.json``, ``plan.json``, ``groups/<group>.safetensors``,
  ``engrams/<member>.safetensors`` (and ``.json``), ``parts/<kind>-<name>.json``, ``manifest.json``
  last, ``usage.json``, ``pairs/<member>+<member>.json`` (engram inner products, on first need);
  ``model-universes/<quoted model id>/``: ``current.json`` and ``known/<id>``
  (:mod:`service.universes.service` says what each holds)
- ``probes/<sha256>.json`` and ``evaluations/<evaluation id>.json``: evaluation's inputs and results;
  ``evaluations/<evaluation id>.request.json`` and ``generations/<generation id>.request.json``: the
  job last started for an identical request (:func:`service.jobs.submit.follow_or_start`)
- ``jobs/<job id>.json``, and ``jobs/open/<job id>`` while the job is unfinished
- ``callbacks/pending/...`` and ``callbacks/failed/...``: the completion callbacks' outbox
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Any
from urllib.parse import quote

# Part of every statistics key and variant identity: a change of what the engine computes changes it.
ENGINE_VERSION = "engram-service/1"

MODELS = "models/"
MODEL_UNIVERSES = "model-universes/"
CONCEPTS = "concepts/"
VARIANTS = "variants/"
JOBS = "jobs/"
OPEN_JOBS = "jobs/open/"
PENDING_CALLBACKS = "callbacks/pending/"
FAILED_CALLBACKS = "callbacks/failed/"


def canonical_digest(value: Any) -> str:
    """The SHA-256 of ``value`` as canonical JSON (sorted keys, no spaces): what content addresses are made of."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def model_key(model_id: str) -> str:
    return f"{MODELS}{quote(model_id, safe='')}.json"


def dataset_key(digest: str) -> str:
    return f"datasets/{digest}.jsonl"


def concept_key(name: str) -> str:
    return f"{CONCEPTS}{name}.json"


def variant_request_key(variant_id: str) -> str:
    return f"{VARIANTS}{variant_id}/request.json"


def variant_manifest_key(variant_id: str) -> str:
    return f"{VARIANTS}{variant_id}/manifest.json"


def variant_file_key(variant_id: str, path: str) -> str:
    return f"{variant_files_prefix(variant_id)}{path}"


def variant_tracking_key(variant_id: str) -> str:
    """Where the variant's MLflow run is recorded once logged (an evaluation's run is nested under it)."""
    return f"{VARIANTS}{variant_id}/tracking.json"


def variant_files_prefix(variant_id: str) -> str:
    """Where a variant's files are (published before its manifest; removed when publishing fails)."""
    return f"{VARIANTS}{variant_id}/files/"


def probes_key(digest: str) -> str:
    return f"probes/{digest}.json"


def evaluation_key(evaluation_id: str) -> str:
    return f"evaluations/{evaluation_id}.json"


def evaluation_request_key(evaluation_id: str) -> str:
    """The job last started for an evaluation: identical requests follow it."""
    return f"evaluations/{evaluation_id}.request.json"


def generation_request_key(generation_id: str) -> str:
    """The job last started for a generation (``generation_id``: the digest of its payload)."""
    return f"generations/{generation_id}.request.json"


CALIBRATIONS = "calibrations/"


def calibration_prefix(calibration_id: str) -> str:
    """Where a calibration's records are: its request, its result and its drawn front."""
    return f"{CALIBRATIONS}{calibration_id}/"


def calibration_request_key(calibration_id: str) -> str:
    """What a calibration job reads, and the job that answers it."""
    return f"{calibration_prefix(calibration_id)}request.json"


def calibration_result_key(calibration_id: str) -> str:
    """The calibration's answer: every candidate, the Pareto front, the recommendation (written last)."""
    return f"{calibration_prefix(calibration_id)}result.json"


def calibration_front_key(calibration_id: str) -> str:
    """The calibration's front, drawn."""
    return f"{calibration_prefix(calibration_id)}front.png"


def map_key(map_id: str) -> str:
    """A computed memory-trace map (``map_id``: the digest of everything that determines it)."""
    return f"maps/{map_id}.json"


def map_request_key(map_id: str) -> str:
    """What a ``map`` job reads, and the job that computes it."""
    return f"maps/{map_id}.request.json"


def registration_key(model_id: str) -> str:
    """A remote model's registration in progress: its source and the job that registers it."""
    return f"registrations/{quote(model_id, safe='')}.json"


def job_key(job_id: str) -> str:
    return f"{JOBS}{job_id}.json"


def universe_prefix(universe_id: str) -> str:
    return f"universes/{universe_id}/"


def universe_request_key(universe_id: str) -> str:
    return universe_prefix(universe_id) + "request.json"


def universe_plan_key(universe_id: str) -> str:
    return universe_prefix(universe_id) + "plan.json"


def universe_manifest_key(universe_id: str) -> str:
    return universe_prefix(universe_id) + "manifest.json"


def usage_key(universe_id: str) -> str:
    return universe_prefix(universe_id) + "usage.json"


def group_key(universe_id: str, group: str) -> str:
    return f"{universe_prefix(universe_id)}groups/{quote(group, safe='')}.safetensors"


def engram_key(universe_id: str, member: str, suffix: str = ".safetensors") -> str:
    return f"{universe_prefix(universe_id)}engrams/{member}{suffix}"


def engram_pair_key(universe_id: str, first: str, second: str) -> str:
    """Two members' engram inner products per layer (W-Norm of several terms): one key per pair."""
    low, high = sorted((first, second))
    return f"{universe_prefix(universe_id)}pairs/{low}+{high}.json"


def part_key(universe_id: str, kind: str, name: str) -> str:
    """Where the record of who computed a part is kept (``kind``: ``group`` or ``member``)."""
    return f"{universe_prefix(universe_id)}parts/{kind}-{quote(name, safe='')}.json"


def model_universes_prefix(model_id: str) -> str:
    return f"{MODEL_UNIVERSES}{quote(model_id, safe='')}/"


def current_pointer_key(model_id: str) -> str:
    return model_universes_prefix(model_id) + "current.json"


def known_universe_key(model_id: str, universe_id: str) -> str:
    return f"{model_universes_prefix(model_id)}known/{universe_id}"


VARIANT_PLANS = "variant-plans/"


def variant_plan_key(variant_id: str) -> str:
    """``variant-plans/<variant id>.json``: the request resolved at submit, what the variant job runs
    (:mod:`service.variants.plan`); written before the request. Outside ``variants/<id>/``, which
    holds the request and, once built, the files and manifest: nothing else (a failed build leaves
    the request alone there)."""
    return f"{VARIANT_PLANS}{variant_id}.json"


AUDIT = "audit/"


def audit_key(at: datetime, request_id: str, nonce: str) -> str:
    """``audit/<date>/<HHMMSS.ffffff>Z-<request id>-<nonce>.json``: one immutable object per audited request.

    ``at`` is in UTC; the time of day is fixed width, so the keys sort as the times do, and the nonce
    keeps two requests sent with the same ``X-Request-ID`` in the same microsecond apart.
    ``request_id`` must already be safe in a key (:func:`service.api.audit.key_safe`)."""
    return f"{AUDIT}{at:%Y-%m-%d}/{at:%H%M%S.%f}Z-{request_id}-{nonce}.json"


def audit_day_prefix(date: str) -> str:
    """The audit objects of one UTC day (``YYYY-MM-DD``)."""
    return f"{AUDIT}{date}/"
