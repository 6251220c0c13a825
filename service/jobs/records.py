"""A job's record and its payload as frozen pydantic models, and the one reader of their stored form.

A record is stored (object storage, Redis, the embedded mode's SQLite file) as
``record.model_dump(mode="json")`` and read back only through :func:`read_job_record`, which
upgrades what an older version wrote (records without ``format_version``: the step registered with
the other stored records' in :mod:`service.storage.records`) and refuses, naming the job, a record
it cannot read. Every other module gets a :class:`JobRecord`, never the dict. The record, its
payloads and what they hold are :class:`~service.storage.records.StoredRecord` objects.

Each kind's payload (the IDs its body needs) is a model of its own, chosen by the record's kind;
a body reads it with :meth:`JobRecord.payload_of`. The payloads hold only IDs, digests and records:
a collection's settings are a :class:`CollectionSettings` (the record the statistics floor, above
this one, turns into a key: ``service.statistics.spec.CollectionSpec`` is a subclass), and a dataset
reference a :class:`StoredReference` (the datasets floor opens it).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, TypeVar

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from service.errors import ProblemDetails, ServiceUnavailable
from service.jobs.collect_plan import CollectionPlan
from service.storage.records import StoredRecord, UnmigratedRecord, upgrade_step

JobKind = Literal["collect", "variant", "universe", "evaluate", "generate", "calibrate", "map", "register"]
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
FORMAT_VERSION = 1  # of the stored record; bump it with an upgrade_step from the version before


class JobPayload(StoredRecord):
    """What a job's body needs, by ID: the base of every kind's payload."""

    kind: ClassVar[JobKind]


def _absent(value: Any) -> bool:
    return value is None


class CollectionSettings(StoredRecord):
    """The collect job's configuration: everything that changes a concept's statistics.

    ``None`` means "not part of the key": the default (every module, no template, float64 sums, the
    model's stored dtype), spelled by absence in the stored form (:meth:`dump`), so that a record
    stored before a field existed reads the same and every statistics key stays what it was. The
    statistics floor turns it into a key (``service.statistics.spec.CollectionSpec``, a subclass).
    """

    max_length: int
    engine: str
    # sorted, each suffix once (canonical_modules)
    modules: tuple[str, ...] | None = Field(default=None, exclude_if=_absent)
    # digest of the collected layers, when they include a renamed one
    layers: str | None = Field(default=None, exclude_if=_absent)
    # "chat": prompt/completion records rendered as one-turn chats
    template: str | None = Field(default=None, exclude_if=_absent)
    # the stored sums' dtype, when not float64
    stats_dtype: str | None = Field(default=None, exclude_if=_absent)
    # the dtype the model runs in, when not the stored one
    collect_dtype: str | None = Field(default=None, exclude_if=_absent)

    def dump(self) -> dict[str, Any]:
        """The stored form: the fields that are set (a job payload's and a statistics manifest's ``settings``)."""
        return self.model_dump(mode="json", exclude_none=True)


class ReferenceRows(StoredRecord):
    """A reference's row range as stored: ``start`` always, ``stop`` only when given."""

    start: int = 0
    stop: int | None = Field(default=None, exclude_if=lambda v: v is None)


class StoredReference(StoredRecord):
    """A dataset reference as a concept stores it and its collection job reads it
    (``service.datasets.refs.submitted_reference`` makes it: checked, its format resolved, and
    fingerprinted). Here, on the job records' floor, because a collect job's payload carries it;
    :mod:`service.datasets.refs` opens it.

    Dumped in the form references were always stored in: ``{"uri", "format", "columns"?, "rows"?,
    "fingerprint"}``, absent options left out, and no ``fingerprint`` in one stored before
    fingerprints existed (read as ``None``: other content than any fingerprinted post).
    """

    uri: str
    format: str
    columns: dict[str, str] | None = Field(default=None, exclude_if=lambda v: v is None)
    rows: ReferenceRows | None = Field(default=None, exclude_if=lambda v: v is None)
    # A Fingerprint, in the order its source gave its keys (a TypedDict would reorder them).
    fingerprint: dict[str, str | int] | None = None

    @model_serializer(mode="wrap")
    def _as_stored(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if "fingerprint" not in self.model_fields_set:
            data.pop("fingerprint", None)
        return data

    @property
    def start(self) -> int:
        """The first row kept (0 without a row range)."""
        return self.rows.start if self.rows is not None else 0

    @property
    def stop(self) -> int | None:
        """The row the range stops before (None: the end)."""
        return self.rows.stop if self.rows is not None else None


class CollectPayload(JobPayload):
    """A concept's statistics on one model. ``dataset_digest`` is None while the concept's dataset
    is a reference (``dataset``) the job resolves first."""

    kind: ClassVar[JobKind] = "collect"
    model_id: str
    model_digest: str
    dataset_digest: str | None
    settings: CollectionSettings  # stored as its dump()
    concept: str
    dataset: StoredReference | None = None  # a reference the job resolves first
    # What the submission resolved (service.jobs.collect_plan); None in a payload queued before plans
    plan: CollectionPlan | None = Field(default=None, exclude_if=_absent)


class VariantPayload(JobPayload):
    """``queue``: "gpu" where the variant builds its universe first (far more than a copy)."""

    kind: ClassVar[JobKind] = "variant"
    variant_id: str
    model_id: str
    queue: Literal["gpu", "cpu"] | None = None


class UniversePayload(JobPayload):
    kind: ClassVar[JobKind] = "universe"
    universe_id: str
    model_id: str


class EvaluatePayload(JobPayload):
    kind: ClassVar[JobKind] = "evaluate"
    variant_id: str
    probes_digest: str
    evaluation_id: str
    # The request's labels and reason, stored with the result (never its identity); written only when
    # given, so a job without them keeps its stored bytes (and an older job loads).
    labels: dict[str, str] = Field(default_factory=dict, exclude_if=lambda v: not v)
    reason: str | None = Field(default=None, exclude_if=_absent)


class GeneratePayload(JobPayload):
    """``prompt``: text or token IDs; ``messages``: a chat, rendered by the model's template."""

    kind: ClassVar[JobKind] = "generate"
    variant_id: str
    prompt: str | list[int] | None  # None: the messages are the prompt
    max_new_tokens: int
    models: list[str]
    messages: list[dict[str, Any]] | None = None


class CalibratePayload(JobPayload):
    kind: ClassVar[JobKind] = "calibrate"
    calibration_id: str
    model_id: str


class MapPayload(JobPayload):
    kind: ClassVar[JobKind] = "map"
    map_id: str
    model_id: str


class RegisterPayload(JobPayload):
    kind: ClassVar[JobKind] = "register"
    model_id: str
    source: str


PAYLOADS: dict[JobKind, type[JobPayload]] = {
    p.kind: p
    for p in (
        CollectPayload,
        VariantPayload,
        UniversePayload,
        EvaluatePayload,
        GeneratePayload,
        CalibratePayload,
        MapPayload,
        RegisterPayload,
    )
}
AnyPayload = (
    CollectPayload
    | VariantPayload
    | UniversePayload
    | EvaluatePayload
    | GeneratePayload
    | CalibratePayload
    | MapPayload
    | RegisterPayload
)
P = TypeVar("P", bound=JobPayload)


class GroupsProgress(StoredRecord):
    """A job that builds its universe's input groups: those it builds for itself (the groups of the
    layers it edits that were not built yet) and those it leaves for a later request."""

    built: tuple[str, ...] = ()
    deferred: tuple[str, ...] = ()


class ProgressCounts(StoredRecord):
    done: int = 0
    total: int = 0
    unit: str = "items"
    groups: GroupsProgress | None = Field(default=None, exclude_if=lambda v: v is None)


class JobRecord(StoredRecord):
    """One job: what it is (kind, payload), where it stands (status, progress, timestamps as ISO
    8601 strings), how it ended (``error``: the problem, stored as the API answered it; ``result``:
    the API's answer, a JSON object), who asked (``owner``: the API key, None for a job's own
    follow-up work) and who hears of its end (``callbacks``). ``dispatch_epoch``: the Redis
    incarnation its message was queued in."""

    record_name: ClassVar[str] = "job record"

    format_version: Literal[1] = 1  # FORMAT_VERSION
    job_id: str
    kind: JobKind
    status: JobStatus = "queued"
    progress: ProgressCounts
    error: ProblemDetails | None = None
    result: dict[str, Any] | None = None
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    payload: AnyPayload
    cancel_requested: bool = False
    callbacks: tuple[str, ...] = ()
    owner: str | None = None
    dispatch_epoch: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _payload_of_its_kind(cls, data: Any) -> Any:
        """The payload model is the kind's (two kinds' payloads can share a shape)."""
        if isinstance(data, dict) and isinstance(data.get("payload"), dict) and data.get("kind") in PAYLOADS:
            try:
                return {**data, "payload": PAYLOADS[data["kind"]].model_validate(data["payload"])}
            except ValidationError as exc:  # raised as is, its fields would not say they are the payload's
                raise ValueError(_described(exc, "payload.")) from None
        return data

    @model_validator(mode="after")
    def _payload_matches_kind(self) -> JobRecord:
        if self.payload.kind != self.kind:
            raise ValueError(f"a {self.kind} job cannot carry a {type(self.payload).__name__}")
        return self

    def payload_of(self, model: type[P]) -> P:
        """The payload as the model its body expects (a job of another kind is refused, naming both)."""
        if not isinstance(self.payload, model):
            raise TypeError(f"job {self.job_id} is a {self.kind} job, not a {model.kind} job")
        return self.payload

    def updated(self, **fields: Any) -> JobRecord:
        """A copy with ``fields`` set, each checked as a stored record's would be (``model_copy(update=...)``
        checks nothing: a dict put in ``progress`` would be stored as one)."""
        unknown = sorted(fields.keys() - type(self).model_fields.keys())
        if unknown:
            raise TypeError(f"a job record has no field {', '.join(unknown)}")
        return type(self).model_validate({**dict(self), **fields})


class UnreadableJobRecord(ServiceUnavailable):
    """A stored job record this version cannot read (written by a newer version, or damaged).

    A 503, like every other stored record the service cannot read (an unmigrated model or concept, a
    malformed statistics or universe manifest): the request was fine, the store needs an operator.
    """

    title, slug = "Unreadable job record", "unreadable-job-record"

    def __init__(self, job_id: str, why: str) -> None:
        super().__init__(f"the stored record of job {job_id} cannot be read: {why}")
        self.job_id = job_id


def read_job_record(stored: Any, job_id: str = "?") -> JobRecord:
    """The record from its stored form, any version this one reads: the only reader of stored jobs.

    Args:
        stored: the JSON object as stored (a dict; anything else is refused).
        job_id: the ID it was stored under, to name it when it cannot be read.

    Raises:
        UnreadableJobRecord: a format version this one does not know, or fields that do not fit.
    """
    if not isinstance(stored, dict):
        raise UnreadableJobRecord(job_id, f"a JSON {type(stored).__name__}, not an object")
    job_id = str(stored.get("job_id", job_id))
    try:
        stored = JobRecord.upgraded(job_id, stored)
    except UnmigratedRecord as exc:  # named as the job's: its stores hold no key ``migrate`` rewrites
        raise UnreadableJobRecord(job_id, f"format_version {exc.found!r}; this version reads {exc.current}") from None
    try:
        return JobRecord.model_validate(stored)
    except ValidationError as exc:
        raise UnreadableJobRecord(job_id, _described(exc)) from None


def _described(exc: ValidationError, prefix: str = "") -> str:
    """``field.path: what is wrong`` for each error (a validator's own message as it wrote it)."""
    return "; ".join(
        f"{prefix}{'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"] else e["msg"].removeprefix("Value error, ")
        for e in exc.errors()
    )


@upgrade_step("job record", None)
def _unversioned_to_1(stored: dict[str, Any]) -> dict[str, Any]:
    """A record as ``new_job`` wrote it before ``format_version`` (0.1.0 up to d1c47c7): the same
    fields, with ``callbacks`` and ``owner`` absent in the oldest ones (their defaults hold). Kept:
    ``engram-service migrate`` does not rewrite job records (Redis, the embedded SQLite file)."""
    return {**stored, "format_version": 1}
