"""Concepts: their records or dataset reference, submitted once and collected on each model; their views.

A concept is ``concepts/<name>.json`` (:mod:`service.storage.keys`): name, role, the digest of its
stored dataset (``datasets/<sha256>.jsonl``, or none yet for a dataset reference its collection job
resolves first) and one collection job per model, each naming the statistics it publishes
(:mod:`service.statistics`; the job body: :mod:`service.concepts.collection`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from api_schemas import Concept, DatasetReferenceView
from api_schemas.concepts import ConceptModelState as ModelStateView
from api_schemas.provenance import MetadataFields
from service.concepts.image_labels import check_records_for
from service.concepts.plan import plan_collection
from service.concepts.record import ConceptModelState, ConceptRecord, read_concept
from service.concepts.sampled import Sampling, as_sampled, drawn_digest
from service.context import Context
from service.datasets.refs import StoredReference, content_changed, same_reference
from service.datasets.spool import SpooledDataset, record_line
from service.engine.layers import unmatched_suffixes
from service.engine.records import Record
from service.errors import Conflict, InvalidInput, NotFound
from service.jobs import callbacks
from service.jobs.admission import ANONYMOUS, admit, job_owner
from service.jobs.records import CollectPayload, JobRecord
from service.jobs.store import FINISHED, new_job, utc_now
from service.jobs.submit import attach_callbacks
from service.models.record import ModelRecord
from service.models.registry import check_chat_templates, get_model
from service.statistics.manifest import StatisticsManifest, stats_manifest
from service.statistics.spec import canonical_modules
from service.storage.keys import CONCEPTS, concept_key, dataset_key
from service.storage.stored_json import find_record, skip_unreadable

KEEP: Any = object()  # an option left out of a request: an existing concept keeps its own


def dataset_bytes(records: Sequence[Record]) -> bytes:
    """The stored bytes of a dataset (what :class:`service.datasets.spool.DatasetSpool` writes, record by record)."""
    return b"".join(record_line(r) for r in records)


CHAT_KINDS = 'messages records and template "chat"'


def submit_concept(  # long: 38 lines are its signature and the docstring of every argument; the body is 25
    ctx: Context,
    *,
    name: str,
    role: str | None,
    description: str | None,
    dataset: SpooledDataset | None,
    models: Sequence[str],
    callback_url: str | None = None,
    modules: Sequence[str] | None = None,
    reference: StoredReference | None = None,
    template: str | None | Any = KEEP,
    samples: Sampling | None = None,  # texts the one model draws (service.concepts.sampled.submitted_samples)
    meta: MetadataFields | None = None,  # labels and reason: kept by the request that creates the concept
) -> tuple[Concept, list[JobRecord]]:
    """Store a concept's records (or its dataset reference) and start one collection per model that lacks one.

    Args:
        role: ``"target"`` or ``"reference"``; ``None`` keeps an existing concept's (a new one: target).
        dataset: the records, spooled and hashed (:mod:`service.datasets`), published here; ``None``
            with ``reference``.
        modules: module suffixes (as on unlearn): collect only those layers' input groups (``None``:
            every editable layer); a model collecting or collected with other modules is a 409.
        reference: a dataset reference (:func:`service.datasets.refs.submitted_reference`), resolved
            by each collection job first; the same reference with another content fingerprint is a
            new concept under the same name (the old one's unfinished jobs are cancelled).
        template: ``"chat"``: prompt/completion records rendered with the chat template; ``KEEP``
            (left out) keeps an existing concept's; another than the stored one is a 409.

    Returns:
        (concept view, the collection jobs of the listed models; each calls ``callback_url`` back).

    Raises:
        Conflict: the concept exists with other records, another reference, or the other role or template.
        InvalidInput: a suffix matching no layer of a listed model; messages records or template ``"chat"``
            on a model without a chat template; template ``"chat"`` over text records; a record of a
            kind a listed model does not read.
    """
    urls = callbacks.check_optional_url(callback_url, ctx.settings)
    manifests, modules = _checked_models(ctx, models, modules)
    kinds = _checked_kinds(manifests, dataset, reference, None if template is KEEP else template)
    digest = dataset.digest if dataset is not None else None
    with ctx.lock:
        concept = find_concept(ctx, name)
        if concept is not None:
            _check_same_concept(concept, drawn_digest(concept, samples, digest, manifests), role, reference, template)
            template = concept.template
        retired = _retired(concept, reference)
        if retired is not None:  # a new concept over the new content, its role and description kept
            concept, role = None, role or retired.role
            description = retired.description if description is None else description
        _check_chat_templates(kinds, template, concept, manifests)  # before anything is written
        admit(ctx, len(_models_to_collect(ctx, concept, manifests, modules)))
        if concept is None:
            chosen = None if template is KEEP else template
            concept = _new_concept(ctx, name, role, description, dataset, reference, chosen, meta)
            concept = as_sampled(concept, samples, role)
        concept, new_jobs = _plan_collections(ctx, concept, manifests, urls, modules)
        if retired is not None:
            _cancel_collections(ctx, retired)
        ctx.storage.put_json(concept_key(name), concept.to_json())
        ctx.reads.forget(concept_key(name))
    return concept_view(ctx, concept), _dispatched(ctx, concept, list(manifests), new_jobs, urls)


def _checked_models(
    ctx: Context, models: Sequence[str], modules: Sequence[str] | None
) -> tuple[dict[str, ModelRecord], list[str] | None]:
    """The listed models' records and the module selection in canonical form.

    Raises:
        InvalidInput: a suffix that matches no layer of a listed model.
    """
    manifests = {m: get_model(ctx, m) for m in dict.fromkeys(models)}
    if modules is None:
        return manifests, None
    chosen = canonical_modules(modules)
    for model_id, manifest in manifests.items():
        missing = unmatched_suffixes(manifest.layout.layers, chosen)
        if missing:
            raise InvalidInput(f"module suffix(es) match no layer of model {model_id}: {', '.join(missing)}")
    return manifests, chosen


def _checked_kinds(
    manifests: Mapping[str, ModelRecord],
    dataset: SpooledDataset | None,
    reference: StoredReference | None,
    template: str | None,
) -> frozenset[str]:
    """The record kinds the dataset holds (a reference mapping ``messages``: messages), checked
    against every listed model's kind and the template now, not in the job.

    Raises:
        InvalidInput: a record of the kind a model does not read, or a label it lacks; template ``"chat"`` over text.
    """
    kinds = dataset.kinds if dataset is not None else frozenset()
    if dataset is not None:
        for model_id, manifest in manifests.items():
            check_records_for(dataset, model_id, manifest)  # the kind; an image model's labels
    if reference is not None and "messages" in (reference.columns or {}):
        kinds = frozenset({"messages"})
    if template == "chat" and "text" in kinds:
        raise InvalidInput('template "chat" renders prompt/completion records as a chat; the dataset holds text records')
    return kinds


def _check_chat_templates(
    kinds: frozenset[str], template: Any, concept: ConceptRecord | None, manifests: Mapping[str, ModelRecord]
) -> None:
    """Messages records or template ``"chat"`` need a chat template on every model not collected yet.

    Raises:
        InvalidInput: a listed model without one (naming it).
    """
    if "messages" in kinds or template == "chat":
        held = concept.models if concept is not None else {}
        check_chat_templates({m: v for m, v in manifests.items() if m not in held}, CHAT_KINDS)


def _retired(concept: ConceptRecord | None, reference: StoredReference | None) -> ConceptRecord | None:
    """The stored concept when what its reference names changed since it was posted: it is replaced
    as if it were deleted first (its unfinished collections cancelled)."""
    if concept is None or reference is None or concept.dataset is None:
        return None
    return concept if content_changed(concept.dataset, reference) else None


def _new_concept(
    ctx: Context,
    name: str,
    role: str | None,
    description: str | None,
    dataset: SpooledDataset | None,
    reference: StoredReference | None,
    template: str | None,
    meta: MetadataFields | None,
) -> ConceptRecord:
    """A new concept (a target unless ``role`` says otherwise), its records published first; its
    creator, labels and reason recorded."""
    if dataset is not None:
        key = dataset_key(dataset.digest)
        if not ctx.storage.exists(key):  # content-addressed: another concept may hold the same records
            ctx.storage.put_file(key, dataset.path)
    return ConceptRecord(
        name=name,
        role=role or "target",
        description=description,
        num_records=dataset.num_records if dataset is not None else None,
        dataset_digest=dataset.digest if dataset is not None else None,
        models={},
        created_at=utc_now(),
        dataset=reference,
        template=template,
        created_by=job_owner.get() or ANONYMOUS,
        labels=dict(meta.labels) if meta is not None and meta.labels else None,
        reason=meta.reason if meta is not None else None,
    )


def _dispatched(
    ctx: Context, concept: ConceptRecord, models: list[str], new_jobs: list[JobRecord], urls: list[str]
) -> list[JobRecord]:
    """The listed models' collection jobs, the new ones enqueued (only now: the concept and its records
    are saved, and the jobs read them), the others calling ``urls`` back too."""
    for job in new_jobs:
        ctx.dispatch(job)
    created = {job.job_id for job in new_jobs}
    found = [ctx.jobs.get(concept.models[m].job_id) for m in models]
    return [attach_callbacks(ctx, j, urls) if j.job_id not in created else j for j in found if j is not None]


def _check_same_concept(
    concept: ConceptRecord, digest: str | None, role: str | None, reference: StoredReference | None, template: Any = KEEP
) -> None:
    """Posting a concept again is idempotent only with the same records (or the same dataset
    reference, or records equal to what its reference resolved to), role and template (or none given)."""
    name = concept.name
    held = concept.dataset
    if reference is not None:
        if held is None or not same_reference(held, reference):
            what = f"the dataset reference {held.uri} ({held.model_dump(mode='json')})" if held else "inline records"
            raise Conflict(f"concept {name} exists with {what}; delete it first or use another name")
    elif concept.dataset_digest != digest:
        if concept.dataset_digest is None:
            raise Conflict(f"concept {name} exists with a dataset reference not resolved yet; post that reference, or wait")
        raise Conflict(f"concept {name} exists with other records; delete it first or use another name")
    if role is not None and role != concept.role:
        raise Conflict(
            f"concept {name} exists with role {concept.role!r}, not {role!r}; "
            "delete it first to change its role, or omit role"
        )
    if template is not KEEP and template != concept.template:
        raise Conflict(
            f"concept {name} exists with template {concept.template!r}, not {template!r}; "
            "delete it first to change it, or omit template"
        )


def _plan_collections(
    ctx: Context,
    concept: ConceptRecord,
    manifests: Mapping[str, ModelRecord],
    callback_urls: list[str],
    modules: list[str] | None = None,
) -> tuple[ConceptRecord, list[JobRecord]]:
    """One collection job per model that needs one; the concept with those jobs as its collections."""
    created = []
    for model_id in _models_to_collect(ctx, concept, manifests, modules):
        manifest = manifests[model_id]
        spec, plan = plan_collection(ctx.settings, manifest.layout, concept, modules)
        payload = CollectPayload(
            model_id=model_id,
            model_digest=manifest.digest,
            dataset_digest=concept.dataset_digest,
            settings=spec,
            concept=concept.name,
            # a reference the job resolves first
            dataset=concept.dataset if concept.dataset_digest is None else None,
            plan=plan,
        )
        job = ctx.jobs.create(new_job("collect", payload, unit="tokens", callback_urls=callback_urls))
        # Where the statistics go; None while the dataset is a reference its job resolves first.
        stats = spec.key(manifest.digest, concept.dataset_digest).prefix if concept.dataset_digest else None
        state = ConceptModelState(job_id=job.job_id, stats=stats, modules=None if modules is None else tuple(modules))
        concept = concept.with_model(model_id, state)
        created.append(job)
    return concept, created


def _models_to_collect(
    ctx: Context, concept: ConceptRecord | None, manifests: Mapping[str, ModelRecord], modules: list[str] | None
) -> list[str]:
    """The listed models that need a collection job: those the concept is not collecting or
    collected on (a new concept: every one).

    Raises:
        Conflict: the concept is collected on a model with other modules.
    """
    if concept is None:
        return list(manifests)
    needed = []
    for model_id in manifests:
        entry = concept.models.get(model_id)
        if entry is not None:
            job = ctx.jobs.get(entry.job_id)
            if job is not None and job.status not in {"failed", "cancelled"}:
                held = entry.modules
                if modules is not None and (held is None or list(held) != modules):
                    raise Conflict(
                        f"concept {concept.name} is collected on model {model_id} with "
                        f"{'modules ' + ', '.join(held) if held else 'every module'}, not modules {', '.join(modules)}; "
                        "delete it first to collect other modules, or omit modules"
                    )
                continue  # already collecting or collected: posting again changes nothing
        needed.append(model_id)
    return needed


def find_concept(ctx: Context, name: str, *, recent: bool = False) -> ConceptRecord | None:
    """The stored concept; ``recent``: as of at most a second ago (views only, never a write's input).

    Raises:
        UnmigratedRecord: it is stored in an older format (``engram-service migrate``).
        UnreadableRecord: what is stored under its key is not a concept (named).
    """
    key = concept_key(name)
    data = ctx.reads.recent_json(key) if recent else find_record(ctx.storage, key)
    return None if data is None else read_concept(key, data)


def get_concept(ctx: Context, name: str, *, recent: bool = False) -> ConceptRecord:
    concept = find_concept(ctx, name, recent=recent)
    if concept is None:
        raise unknown_concepts(ctx, [name])
    return concept


# How a user lists the concepts the service knows (the detail of an unknown concept's 404 says it).
LIST_CONCEPTS_HINT = "GET /concepts lists the known ones (engram concepts list)"


def unknown_concepts(ctx: Context, names: Sequence[str]) -> NotFound:
    """The 404 of concept names that do not exist: each with its close matches among the known names
    (a misspelling's likely intent), and how to list them all.

    The problem's ``close_matches`` member holds the same suggestions: name -> known names.
    """
    known = concept_names(ctx)
    matches = {name: difflib.get_close_matches(name, known, n=3) for name in sorted(set(names))}
    named = [f"{name} (did you mean {' or '.join(close)}?)" if close else name for name, close in matches.items()]
    noun = "concept" if len(named) == 1 else "concepts"
    detail = f"unknown {noun}: {', '.join(named)}; {LIST_CONCEPTS_HINT}"
    return NotFound(detail, extensions={"close_matches": matches})


def list_concepts(ctx: Context, *, recent: bool = False) -> list[ConceptRecord]:
    """Every readable concept; ``recent``: as of at most a second ago (views only, never a write's
    input). One that cannot be read is left out with a warning naming it (reading it by name refuses it)."""
    listing = ctx.reads.recent_listing(CONCEPTS) if recent else ctx.storage.list(CONCEPTS)
    found = (skip_unreadable(k, partial(_stored_concept, ctx, k, recent)) for k in listing if k.endswith(".json"))
    return [concept for concept in found if concept is not None]


def _stored_concept(ctx: Context, key: str, recent: bool) -> ConceptRecord | None:
    """The concept under ``key`` (None: deleted since it was listed)."""
    data = ctx.reads.recent_json(key) if recent else find_record(ctx.storage, key)
    return None if data is None else read_concept(key, data)


def concept_names(ctx: Context) -> list[str]:
    """Every concept's name, sorted (as of at most a second ago: for views)."""
    keys = ctx.reads.recent_listing(CONCEPTS)
    return sorted(k.removeprefix(CONCEPTS).removesuffix(".json") for k in keys if k.endswith(".json"))


def _cancel_collections(ctx: Context, concept: ConceptRecord) -> None:
    for entry in concept.models.values():
        job = ctx.jobs.get(entry.job_id)
        if job is not None and job.status not in FINISHED:
            ctx.jobs.update(job.job_id, cancel_requested=True)


def concept_model_state(ctx: Context, entry: ConceptModelState) -> ModelStateView:
    # The job first, then the manifest: a collection publishes its manifest before its job succeeds,
    # so a job read as finished guarantees the manifest is found. The other order could read "no
    # manifest yet", then "succeeded", and report a finished collection as failed.
    job = ctx.jobs.get(entry.job_id)
    # No statistics key yet: a dataset reference its job has not resolved.
    published = stats_manifest(ctx, entry.stats) if entry.stats else None
    if published is not None:
        return ready_state(published, entry.job_id)
    status = {"running": "collecting", "queued": "pending"}.get(job.status, "failed") if job else "failed"
    return ModelStateView.model_validate({"status": status, "tokens": None, "job_id": entry.job_id})


def _as_its_jobs_left_it(ctx: Context, concept: ConceptRecord) -> ConceptRecord:
    """The concept as of after what its finished collection jobs wrote into it.

    A view may read a copy up to a second old (the read cache), and a reference's collection job
    writes into the concept (the resolved digest and its statistics key) before it ends. An entry
    without a statistics key whose job has finished is such an older copy, or a job that ended before
    resolving: the copy would show a succeeded collection as failed, then as ready a second later.
    Storage is read again, after the job (which wrote the concept before it finished).
    """
    unkeyed = [entry for entry in concept.models.values() if entry.stats is None]
    if not any((job := ctx.jobs.get(entry.job_id)) is not None and job.status in FINISHED for entry in unkeyed):
        return concept
    return find_concept(ctx, concept.name) or concept  # None: deleted since; the copy at hand is shown


def ready_state(published: StatisticsManifest, job_id: str) -> ModelStateView:
    """A model's state once its statistics are published: their tokens and what ``max_length`` did
    (the manifest's truncation report; ``None`` in a manifest written before there was one)."""
    state = {"status": "ready", "tokens": published.tokens, "job_id": job_id, "truncation": published.truncation}
    return ModelStateView.model_validate(state)


def concept_view(ctx: Context, concept: ConceptRecord) -> Concept:
    """The concept as the routes answer it: the contract's :class:`~api_schemas.Concept`."""
    concept = _as_its_jobs_left_it(ctx, concept)
    states = {m: concept_model_state(ctx, e) for m, e in concept.models.items()}
    error = None
    if concept.dataset is not None and concept.dataset_digest is None:
        failed = [ctx.jobs.get(e.job_id) for e in concept.models.values()]
        error = next((j.error.detail for j in failed if j and j.error), None)
    return concept_fields(concept, states, error)


def concept_fields(concept: ConceptRecord, states: Mapping[str, ModelStateView], error: str | None = None) -> Concept:
    """A concept's view from its record and its models' states (``error``: why its dataset
    reference did not resolve, when it did not): the contract's :class:`~api_schemas.Concept`."""
    dataset = None
    reference = concept.dataset
    if reference is not None:
        digest = concept.dataset_digest
        if digest is not None:
            status = "resolved"
        elif any(s.status in {"pending", "collecting"} for s in states.values()):
            status = "pending"
        else:
            status = "failed"
        failed = error if status == "failed" else None
        shown = {**reference.model_dump(mode="json"), "digest": digest, "status": status, "error": failed}
        dataset = DatasetReferenceView.model_validate(shown)
    fields = concept.model_dump(exclude={"format_version", "models", "dataset", "labels"})
    return Concept.model_validate({**fields, "labels": concept.labels or {}, "dataset": dataset, "models": states})


# ---------------------------------------------------------------- the concepts an edit is measured against


def ready_statistics(ctx: Context, model_id: str, names: Sequence[str]) -> dict[str, dict[str, str]]:
    """name -> {prefix, dataset_digest} for concepts ready on this model; 404/409 naming the rest."""
    unknown = [n for n in names if find_concept(ctx, n) is None]
    if unknown:
        raise unknown_concepts(ctx, unknown)
    ready, not_ready = {}, {}
    for name in names:
        concept = get_concept(ctx, name)
        entry = concept.models.get(model_id)
        if entry is None or not entry.stats or stats_manifest(ctx, entry.stats) is None or concept.dataset_digest is None:
            not_ready[name] = entry
            continue
        ready[name] = {"prefix": entry.stats, "dataset_digest": concept.dataset_digest}
    if not_ready:
        raise not_ready_concepts(ctx, model_id, not_ready)
    return ready


def not_ready_concepts(ctx: Context, model_id: str, entries: Mapping[str, ConceptModelState | None]) -> Conflict:
    """The 409 of concepts whose statistics on ``model_id`` are not ready: for each, why and what to
    do (a collection still running: its job to follow and wait for; a failed one: its job to read; none
    on this model: post the concept for it).

    The problem's ``jobs`` member lists the collections to follow: ``{concept, job_id, status, url}``.
    """
    reasons, jobs = [], []
    for name in sorted(entries):
        entry = entries[name]
        if entry is None:
            reasons.append(f"{name} was never collected on this model: post it again with {model_id} in its models")
            continue
        job = ctx.jobs.get(entry.job_id)
        status = job.status if job is not None else "gone"
        url = f"/jobs/{entry.job_id}"
        jobs.append({"concept": name, "job_id": entry.job_id, "status": status, "url": url})
        if status in FINISHED or job is None:
            reasons.append(
                f"{name}'s collection job {entry.job_id} ended {status} without statistics: GET {url} says why; "
                "post the concept again to collect it anew"
            )
        else:
            reasons.append(
                f"{name} is still being collected by job {entry.job_id} ({status}): wait for it to finish "
                f"(follow GET {url}, or engram jobs watch {entry.job_id}), then repeat this request"
            )
    noun = "concept" if len(entries) == 1 else "concepts"
    detail = f"{noun} without ready statistics on model {model_id}: {'; '.join(reasons)}"
    return Conflict(detail, extensions={"jobs": jobs} if jobs else None)


def default_reference(ctx: Context, model_id: str) -> list[str]:
    names = []
    for concept in list_concepts(ctx):
        entry = concept.models.get(model_id)
        if entry is not None and entry.stats and stats_manifest(ctx, entry.stats) is not None:
            names.append(concept.name)
    return sorted(names)
