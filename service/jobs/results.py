"""A finished job's result per kind, as the body returns it to the runner: frozen pydantic models.

A body returns its kind's model; the runner (:func:`service.execution.runner.run_job`) dumps it once,
``model_dump(mode="json", exclude_unset=True)``, adds the worker's name and stores it as the job's
``result``: the fields a body set are the fields stored, as when bodies returned the JSON object
itself (a reused collection, for one, has no ``seconds``). The kinds whose result the contract
describes use its models (:mod:`api_schemas.job_kinds`: evaluate, generate, calibrate); the others
are described here, where every domain's body can import them (this package is the lowest floor).

Numbers keep their JSON type: a field that holds seconds is ``float`` because a body always rounds
a float into it; a count is ``int``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from api_schemas.calibration import CalibrationJobResult
from api_schemas.evaluation import EvaluationResult, GenerationResult
from api_schemas.jobs import TrackingRun
from service.jobs.records import JobKind


class _Result(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TruncatedCount(_Result):
    """What ``max_length`` cut: records and tokens, and the first records' indices."""

    max_length: int | None = None
    records: int
    tokens: int
    first: tuple[int, ...]


class UncountedCount(_Result):
    """Records with no token that enters the statistics, and the first ones' indices."""

    records: int
    first: tuple[int, ...]


class CollectResult(_Result):
    """A ``collect`` job: the statistics' tokens and prefix, and what ``max_length`` did to the
    dataset (``records``, ``truncated``, ``uncounted``: absent on a reuse of statistics published
    before it was reported). ``seconds``: absent on a reuse."""

    # A reuse repeats the truncation report stored in the statistics' manifest as it was stored:
    # a key an older version reported is kept, not refused.
    model_config = ConfigDict(frozen=True, extra="allow")

    tokens: int
    stats: str
    reused: bool
    seconds: float | None = None
    records: int | None = None
    truncated: TruncatedCount | None = None
    uncounted: UncountedCount | None = None


class VariantResult(_Result):
    """A ``variant`` job: the variant, and on a build its layers, seconds, the seconds its universe
    took when the job built it first (None: it was built already) and each step's seconds; with
    ENGRAM_MLFLOW_TRACKING_URI, its MLflow run (or why it could not be logged)."""

    variant_id: str
    reused: bool
    layers: int | None = None
    seconds: float | None = None
    universe_built_s: float | None = None
    steps: dict[str, float] | None = None
    tracking: TrackingRun | None = None


class UniverseResult(_Result):
    """A ``universe`` job: the universe, its bytes and the seconds of each build phase."""

    universe_id: str
    reused: bool
    bytes: int
    seconds: dict[str, float]


class MapResult(_Result):
    map_id: str
    model_id: str
    concepts: tuple[str, ...]
    reused: bool


class RegisterResult(_Result):
    """A ``register`` job: the model and its digest; ``created``: False when it was registered already."""

    model_id: str
    digest: str
    created: bool


RESULTS: dict[JobKind, type[BaseModel]] = {
    "collect": CollectResult,
    "variant": VariantResult,
    "universe": UniverseResult,
    "evaluate": EvaluationResult,
    "generate": GenerationResult,
    "calibrate": CalibrationJobResult,
    "map": MapResult,
    "register": RegisterResult,
}
"""Each kind's result model: what its body returns."""

AnyJobResult = (
    CollectResult
    | VariantResult
    | UniverseResult
    | EvaluationResult
    | GenerationResult
    | CalibrationJobResult
    | MapResult
    | RegisterResult
)
