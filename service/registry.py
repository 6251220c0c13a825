"""Models, concepts and variants: their manifests in storage and the rules around them.

Storage layout (every key content-addressed where the content determines it):

- ``models/<quoted id>.json``: registration and checkpoint layout
- ``datasets/<sha256>.jsonl``: the records a user sent, byte for byte as normalised JSON lines
- ``concepts/<name>.json``: name, role, dataset digest, and one collection job per model
- ``stats/<model digest>/<dataset digest>/<settings digest>/``: ``statistics.safetensors`` and
  ``manifest.json`` (written last: statistics exist exactly when it does)
- ``variants/<variant id>/request.json`` at submission, ``files/...``, ``manifest.json`` last
  (submitted by :mod:`service.variants.service`; universes: :mod:`service.universes.service`)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from service import callbacks
from service.config import Settings
from service.dataset_refs import content_changed, same_reference
from service.datasets import SpooledDataset, record_line
from service.engine.checkpoint import ModelLayout, directory_digest, inspect_model_dir
from service.engine.layers import select_layers, summarize_names, unmatched_suffixes
from service.engine.model_files import ModelSourceError, used_files
from service.engine.records import Record
from service.errors import Conflict, InvalidInput, NotFound
from service.jobs import FINISHED, JobStore, new_job, utc_now
from service.sources import local_model_dir
from service.storage.base import Storage
from service.storage.read_cache import ReadCache

ENGINE_VERSION = "engram-service/1"
KEEP: Any = object()  # an option left out of a request: an existing concept keeps its own


@dataclass
class Context:
    """What request handlers and tasks share: settings, storage, jobs and the job dispatcher."""

    settings: Settings
    storage: Storage
    jobs: JobStore
    dispatch: Any  # callable(job dict) -> None
    lock: Any  # a threading.RLock (embedded) or a Redis lock (distributed): a context manager
    broker_ping: Any = None  # callable raising when the broker is unreachable (distributed mode)
    queue_depths: Any = None  # callable -> {queue: waiting jobs}
    # callable(universe_id, job_id, count): ask idle workers to help build a universe (distributed mode)
    universe_helpers: Any = None
    live_workers: Any = None  # callable -> {queue: workers with a live heartbeat consuming it} (distributed)
    reads: ReadCache = field(init=False)  # what status views read: recent documents, not a round trip each

    def __post_init__(self) -> None:
        self.reads = ReadCache(self.storage)

    @property
    def cache_dir(self) -> Path:
        """Where checkpoints from s3:// and hf:// sources are downloaded (ENGRAM_CACHE_DIR)."""
        return self.settings.cache_dir


def canonical_digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def model_key(model_id: str) -> str:
    return f"models/{quote(model_id, safe='')}.json"


def concept_key(name: str) -> str:
    return f"concepts/{name}.json"


def stats_prefix(model_digest: str, dataset_digest: str, settings_digest: str) -> str:
    return f"stats/{model_digest}/{dataset_digest}/{settings_digest}/"


def collection_settings(
    settings: Settings, modules: Sequence[str] | None = None, template: str | None = None
) -> dict[str, Any]:
    """Everything that changes a statistic (and so is part of its key).

    Args:
        modules: the module suffixes a concept was posted with (only their input groups are
            collected); part of the key only when given, so keys without them stay as they were.
        template: ``"chat"``: prompt/completion records rendered as one-turn chats; part of the
            key only when set.
    """
    chosen: dict[str, Any] = {"max_length": settings.max_length, "engine": ENGINE_VERSION}
    if modules is not None:
        chosen["modules"] = canonical_modules(modules)
    if template is not None:
        chosen["template"] = template
    # Only when not the default, so existing keys stay valid.
    if settings.stats_dtype != "float64":
        chosen["stats_dtype"] = settings.stats_dtype
    if settings.collect_dtype != "stored":  # the activations, and so Σ, depend on it
        chosen["collect_dtype"] = settings.collect_dtype
    return chosen


def canonical_modules(modules: Sequence[str]) -> list[str]:
    """A module selection in the form that enters a statistics key: sorted, each suffix once."""
    return sorted(set(modules))


# ---------------------------------------------------------------- models


def file_fingerprint(path: Path) -> dict[str, list[int]]:
    """Sizes and mtimes of the files the service uses from a model folder (side files and shards,
    each resolved and checked to lie inside the folder: nothing outside is ever looked at), a cheap
    check that they did not change under us.

    Raises:
        ModelSourceError: a used file breaks a rule of :mod:`service.engine.model_files` (a link
            leading out of the folder, a bad shard name).
    """
    stats = {name: real.stat() for name, real in used_files(path).items()}
    return {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()}


def register_model(ctx: Context, model_id: str, source: str) -> tuple[dict[str, Any], bool]:
    """Register a checkpoint; returns (manifest, created). Same registration twice is a no-op."""
    existing = find_model(ctx, model_id)
    if existing is not None:
        if existing["source"] != source:
            raise Conflict(f"model {model_id} is already registered with source {existing['source']}")
        return existing, False
    path = local_model_dir(source, ctx.settings.model_root_paths, ctx.cache_dir, ctx.settings.s3_endpoint_url)
    try:
        # Refuses links leading out of the folder and shard names that are not plain file names
        # in it (service.engine.model_files), before any of those files is opened.
        layout = inspect_model_dir(path)
        digest, fingerprint = directory_digest(path), file_fingerprint(path)
    except ModelSourceError as exc:
        raise InvalidInput(str(exc)) from None
    if not layout.layers:
        raise InvalidInput("the model has no editable Linear or Conv1D layers in its safetensors weights")
    manifest = {
        "model_id": model_id,
        "source": source,
        "path": str(path),
        "digest": digest,
        "fingerprint": fingerprint,
        "architecture": layout.architecture,
        "num_parameters": layout.num_parameters,
        "layout": layout.to_json(),
        "registered_at": utc_now(),
    }
    with ctx.lock:
        again = find_model(ctx, model_id)
        if again is not None:
            return register_model(ctx, model_id, source)
        ctx.storage.put_json(model_key(model_id), manifest)
    return manifest, True


def find_model(ctx: Context, model_id: str) -> dict[str, Any] | None:
    return ctx.storage.find_json(model_key(model_id))


def get_model(ctx: Context, model_id: str) -> dict[str, Any]:
    manifest = find_model(ctx, model_id)
    if manifest is None:
        raise NotFound(f"model {model_id} is not registered")
    return manifest


def list_models(ctx: Context) -> list[dict[str, Any]]:
    return [ctx.storage.get_json(k) for k in ctx.storage.list("models/") if k.endswith(".json")]


def model_view(manifest: dict[str, Any]) -> dict[str, Any]:
    layers = [{k: spec[k] for k in ("name", "in_features", "out_features", "bias")} for spec in manifest["layout"]["layers"]]
    keys = ("model_id", "source", "digest", "architecture", "num_parameters")
    return {**{k: manifest[k] for k in keys}, "layers": layers}


# ---------------------------------------------------------------- concepts


def dataset_bytes(records: Sequence[Record]) -> bytes:
    """The stored bytes of a dataset (what :class:`service.datasets.DatasetSpool` writes, record by record)."""
    return b"".join(record_line(r) for r in records)


def load_records(ctx: Context, dataset_digest: str) -> list[Record]:
    data = ctx.storage.get_bytes(f"datasets/{dataset_digest}.jsonl")
    # bytes.splitlines cuts at \n only here (json.dumps escapes \r): str.splitlines would also cut
    # inside a record at a raw U+2028, U+0085 or U+001C, which ensure_ascii=False leaves as they are.
    return [Record.from_mapping(json.loads(line), i) for i, line in enumerate(data.splitlines())]


def iter_records(path: Path) -> Iterator[Record]:
    """The records of a stored dataset file, one line at a time (never the whole file in memory).

    Lines are cut at ``\n`` only, as :func:`load_records` does.
    """
    with path.open("rb") as handle:
        for i, line in enumerate(handle):
            yield Record.from_mapping(json.loads(line), i)


CHAT_KINDS = 'messages records and template "chat"'


def check_chat_templates(manifests: dict[str, dict[str, Any]], why: str) -> None:
    """Refuse (422) a model whose registered folder ships no chat template, read from its allowlisted
    tokenizer files (no tokenizer or model is loaded). A folder this process cannot read is left to
    the job, which fails saying the same.
    """
    from service.engine.chat import folder_has_chat_template

    for model_id, manifest in manifests.items():
        if folder_has_chat_template(Path(manifest.get("path", ""))) is False:
            raise InvalidInput(
                f"model {model_id} has no chat template (chat_template.jinja, or chat_template in "
                f"tokenizer_config.json), which {why} need"
            )


def submit_concept(
    ctx: Context,
    *,
    name: str,
    role: str | None,
    description: str | None,
    dataset: SpooledDataset | None,
    models: Sequence[str],
    callback_url: str | None = None,
    modules: Sequence[str] | None = None,
    reference: dict[str, Any] | None = None,
    template: str | None | Any = KEEP,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Store a concept's records (or its dataset reference) and start one collection per model that lacks one.

    Args:
        role: ``"target"`` or ``"reference"``; ``None`` keeps an existing concept's role (a new
            concept is a target).
        dataset: the records, spooled and hashed (:mod:`service.datasets`); published here. ``None``
            with ``reference``.
        modules: module suffixes (as ``modules`` on unlearn): collect only those layers' input
            groups; ``None`` collects every editable layer. A suffix that matches no layer of a
            listed model is a 422; a model already collecting or collected with other modules, a 409.
        reference: a dataset reference from :func:`service.dataset_refs.submitted_reference`:
            nothing is fetched here; each collection job resolves it first (the concept has no
            dataset digest until then). The same reference with another content fingerprint is a
            new concept under the same name (the old one's unfinished jobs are cancelled).
        template: ``"chat"``: prompt/completion records are rendered with the chat template;
            ``KEEP`` (left out) keeps an existing concept's; another than the stored one is a 409.

    Returns:
        (concept view, the collection jobs of the listed models; each calls ``callback_url`` back).

    Raises:
        Conflict: the concept exists with other records, another reference, or the other role or template.
        InvalidInput: messages records or template ``"chat"`` on a model without a chat template;
            template ``"chat"`` over text records.
    """
    urls = callbacks.check_optional_url(callback_url, ctx.settings)
    manifests = {m: get_model(ctx, m) for m in dict.fromkeys(models)}
    if modules is not None:
        modules = canonical_modules(modules)
        for model_id, manifest in manifests.items():
            missing = unmatched_suffixes(ModelLayout.from_json(manifest["layout"]).layers, modules)
            if missing:
                raise InvalidInput(f"module suffix(es) match no layer of model {model_id}: {', '.join(missing)}")
    kinds = dataset.kinds if dataset is not None else frozenset()
    if reference is not None and "messages" in (reference.get("columns") or {}):
        kinds = frozenset({"messages"})
    chosen_template = None if template is KEEP else template
    if chosen_template == "chat" and "text" in kinds:
        raise InvalidInput('template "chat" renders prompt/completion records as a chat; the dataset holds text records')
    digest = dataset.digest if dataset is not None else None
    retired = None
    with ctx.lock:
        concept = find_concept(ctx, name)
        if concept is not None:
            _check_same_concept(concept, digest, role, reference, template)
            chosen_template = concept.get("template")
            if reference is not None and content_changed(concept["dataset"], reference):
                # What the reference names changed since it was posted: a new concept over the new
                # content, as if the old one were deleted first (its role and description kept).
                retired, concept = concept, None
                role = role or retired["role"]
                description = retired["description"] if description is None else description
        # Checked before anything is written: a refused request stores nothing.
        if "messages" in kinds or chosen_template == "chat":
            held = concept["models"] if concept is not None else {}
            check_chat_templates({m: v for m, v in manifests.items() if m not in held}, CHAT_KINDS)
        if concept is None:
            if dataset is not None:
                key = f"datasets/{digest}.jsonl"
                if not ctx.storage.exists(key):  # content-addressed: another concept may hold the same records
                    ctx.storage.put_file(key, dataset.path)
            concept = {
                "name": name,
                "role": role or "target",
                "description": description,
                "num_records": dataset.num_records if dataset is not None else None,
                "dataset_digest": digest,
                "models": {},
                "created_at": utc_now(),
            }
            if reference is not None:
                concept["dataset"] = reference
            if chosen_template is not None:
                concept["template"] = chosen_template
        new_jobs = _plan_collections(ctx, concept, manifests, urls, modules)
        if retired is not None:
            _cancel_collections(ctx, retired)
        ctx.storage.put_json(concept_key(name), concept)
        ctx.reads.forget(concept_key(name))
    # Enqueue only after the records and the concept are saved: the task reads them.
    for job in new_jobs:
        ctx.dispatch(job)
    created = {job["job_id"] for job in new_jobs}
    found = [ctx.jobs.get(concept["models"][m]["job_id"]) for m in manifests]
    jobs = [attach_callbacks(ctx, j, urls) if j["job_id"] not in created else j for j in found if j is not None]
    return concept_view(ctx, concept), jobs


def _check_same_concept(
    concept: dict[str, Any], digest: str | None, role: str | None, reference: dict[str, Any] | None, template: Any = KEEP
) -> None:
    """Posting a concept again is idempotent only with the same records (or the same dataset
    reference, or records equal to what its reference resolved to), role and template (or none given)."""
    name = concept["name"]
    held = concept.get("dataset")
    if reference is not None:
        if held is None or not same_reference(held, reference):
            what = f"the dataset reference {held['uri']} ({held})" if held else "inline records"
            raise Conflict(f"concept {name} exists with {what}; delete it first or use another name")
    elif concept["dataset_digest"] != digest:
        if concept["dataset_digest"] is None:
            raise Conflict(f"concept {name} exists with a dataset reference not resolved yet; post that reference, or wait")
        raise Conflict(f"concept {name} exists with other records; delete it first or use another name")
    if role is not None and role != concept["role"]:
        raise Conflict(
            f"concept {name} exists with role {concept['role']!r}, not {role!r}; "
            "delete it first to change its role, or omit role"
        )
    if template is not KEEP and template != concept.get("template"):
        raise Conflict(
            f"concept {name} exists with template {concept.get('template')!r}, not {template!r}; "
            "delete it first to change it, or omit template"
        )


def attach_callbacks(ctx: Context, job: dict[str, Any], urls: list[str]) -> dict[str, Any]:
    """Add callback URLs to an existing job; a job that already ended calls them back at once."""
    new_urls = [u for u in urls if u not in (job.get("callbacks") or [])]
    if not new_urls:
        return job
    job = ctx.jobs.update(job["job_id"], persist=False, callbacks=[*(job.get("callbacks") or []), *new_urls])
    if job["status"] in FINISHED:
        callbacks.enqueue(ctx.storage, {**job, "callbacks": new_urls})
        if ctx.jobs.on_finished is not None:
            ctx.jobs.on_finished()
    else:
        ctx.jobs.update(job["job_id"])  # persist now: the outbox entry is written when it ends
    return job


def _plan_collections(
    ctx: Context,
    concept: dict[str, Any],
    manifests: dict[str, Any],
    callback_urls: list[str],
    modules: list[str] | None = None,
) -> list[dict[str, Any]]:
    created = []
    for model_id, manifest in manifests.items():
        entry = concept["models"].get(model_id)
        if entry is not None:
            job = ctx.jobs.get(entry["job_id"])
            if job is not None and job["status"] not in {"failed", "cancelled"}:
                if modules is not None and entry.get("modules") != modules:
                    held = entry.get("modules")
                    raise Conflict(
                        f"concept {concept['name']} is collected on model {model_id} with "
                        f"{'modules ' + ', '.join(held) if held else 'every module'}, not modules {', '.join(modules)}; "
                        "delete it first to collect other modules, or omit modules"
                    )
                continue  # already collecting or collected: posting again changes nothing
        payload = {
            "model_id": model_id,
            "model_digest": manifest["digest"],
            "dataset_digest": concept["dataset_digest"],
            "settings": collection_settings(ctx.settings, modules, concept.get("template")),
            "concept": concept["name"],
        }
        if concept["dataset_digest"] is None:  # a reference the job resolves first
            payload["dataset"] = concept["dataset"]
        job = ctx.jobs.create(new_job("collect", payload, unit="tokens", callback_urls=callback_urls))
        stats = _stats_prefix_for(payload) if concept["dataset_digest"] is not None else None
        concept["models"][model_id] = {"job_id": job["job_id"], "stats": stats}
        if modules is not None:
            concept["models"][model_id]["modules"] = modules
        created.append(job)
    return created


def _stats_prefix_for(payload: dict[str, Any]) -> str:
    return stats_prefix(payload["model_digest"], payload["dataset_digest"], canonical_digest(payload["settings"]))


def find_concept(ctx: Context, name: str, *, recent: bool = False) -> dict[str, Any] | None:
    """The stored concept; ``recent``: as of at most a second ago (views only, never a write's input)."""
    return ctx.reads.recent_json(concept_key(name)) if recent else ctx.storage.find_json(concept_key(name))


def get_concept(ctx: Context, name: str, *, recent: bool = False) -> dict[str, Any]:
    concept = find_concept(ctx, name, recent=recent)
    if concept is None:
        raise NotFound(f"concept {name} does not exist")
    return concept


def list_concepts(ctx: Context, *, recent: bool = False) -> list[dict[str, Any]]:
    """Every concept; ``recent``: as of at most a second ago (views only, never a write's input)."""
    if not recent:
        return [ctx.storage.get_json(k) for k in ctx.storage.list("concepts/") if k.endswith(".json")]
    found = (ctx.reads.recent_json(k) for k in ctx.reads.recent_listing("concepts/") if k.endswith(".json"))
    return [concept for concept in found if concept is not None]


def delete_concept(ctx: Context, name: str) -> None:
    """Forget a concept. Its statistics stay cached (content-addressed, maybe shared)."""
    with ctx.lock:
        _cancel_collections(ctx, get_concept(ctx, name))
        ctx.storage.delete(concept_key(name))
        ctx.reads.forget(concept_key(name))


def _cancel_collections(ctx: Context, concept: dict[str, Any]) -> None:
    for entry in concept["models"].values():
        job = ctx.jobs.get(entry["job_id"])
        if job is not None and job["status"] not in FINISHED:
            ctx.jobs.update(job["job_id"], cancel_requested=True)


def stats_manifest(ctx: Context, prefix: str) -> dict[str, Any] | None:
    return ctx.reads.immutable_json(prefix + "manifest.json")  # content-addressed: written once


def concept_model_state(ctx: Context, entry: dict[str, Any]) -> dict[str, Any]:
    # The job first, then the manifest: a collection publishes its manifest before its job succeeds,
    # so a job read as finished guarantees the manifest is found. The other order could read "no
    # manifest yet", then "succeeded", and report a finished collection as failed.
    job = ctx.jobs.get(entry["job_id"])
    # No statistics key yet: a dataset reference its job has not resolved.
    published = stats_manifest(ctx, entry["stats"]) if entry.get("stats") else None
    if published is not None:
        return {"status": "ready", "tokens": published["tokens"], "job_id": entry["job_id"]}
    status = {"running": "collecting", "queued": "pending"}.get(job["status"], "failed") if job else "failed"
    return {"status": status, "tokens": None, "job_id": entry["job_id"]}


def concept_view(ctx: Context, concept: dict[str, Any]) -> dict[str, Any]:
    states = {m: concept_model_state(ctx, e) for m, e in concept["models"].items()}
    error = None
    if concept.get("dataset") is not None and concept["dataset_digest"] is None:
        failed = [ctx.jobs.get(e["job_id"]) for e in concept["models"].values()]
        error = next((j["error"]["detail"] for j in failed if j and j.get("error")), None)
    return concept_fields(concept, states, error)


def concept_fields(concept: dict[str, Any], states: dict[str, Any], error: str | None = None) -> dict[str, Any]:
    """A concept's view from its document and its models' states (``error``: why its dataset
    reference did not resolve, when it did not)."""
    keys = ("name", "role", "description", "num_records", "dataset_digest")
    view = {**{k: concept[k] for k in keys}, "template": concept.get("template"), "models": states}
    reference = concept.get("dataset")
    if reference is not None:
        digest = concept["dataset_digest"]
        if digest is not None:
            status = "resolved"
        elif any(s["status"] in {"pending", "collecting"} for s in states.values()):
            status = "pending"
        else:
            status = "failed"
        view["dataset"] = {**reference, "digest": digest, "status": status, "error": error if status == "failed" else None}
    return view


# ---------------------------------------------------------------- variants


def _ready_stats(ctx: Context, model_id: str, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """name -> {prefix, dataset_digest} for concepts ready on this model; 404/409 naming the rest."""
    unknown = [n for n in names if find_concept(ctx, n) is None]
    if unknown:
        raise NotFound(f"unknown concept(s): {', '.join(sorted(unknown))}")
    ready, not_ready = {}, []
    for name in names:
        concept = get_concept(ctx, name)
        entry = concept["models"].get(model_id)
        if entry is None or not entry.get("stats") or stats_manifest(ctx, entry["stats"]) is None:
            not_ready.append(name)
            continue
        ready[name] = {"prefix": entry["stats"], "dataset_digest": concept["dataset_digest"]}
    if not_ready:
        raise Conflict(f"concept(s) without ready statistics on model {model_id}: {', '.join(sorted(not_ready))}")
    return ready


def _default_reference(ctx: Context, model_id: str) -> list[str]:
    names = []
    for concept in list_concepts(ctx):
        entry = concept["models"].get(model_id)
        if entry is not None and entry.get("stats") and stats_manifest(ctx, entry["stats"]) is not None:
            names.append(concept["name"])
    return sorted(names)


def _check_selection(layout: ModelLayout, modules: list[str] | None, layers: list[int] | None) -> None:
    if modules:
        missing = unmatched_suffixes(layout.layers, modules)
        if missing:
            raise InvalidInput(f"module suffix(es) match no layer: {', '.join(missing)}")
    if not select_layers(layout.layers, modules, layers):
        raise InvalidInput("the modules/layers selection matches no editable layer")


def check_statistics_cover(
    ctx: Context,
    layout: ModelLayout,
    members: Iterable[tuple[str, str]],
    modules: Sequence[str] | None,
    layers: Sequence[int] | None,
) -> None:
    """Refuse an edit that needs a layer some member's statistics lack (collected with ``modules``,
    or a layer collection could not read).

    Args:
        layout: the model's layout.
        members: ``(concept name, statistics prefix)`` of every concept of the edit's universe.
        modules, layers: the edit's selection.

    Raises:
        Conflict: naming each concept and the layers it has no statistics for.
    """
    needed = select_layers(layout.layers, modules, layers)
    problems = []
    for name, prefix in sorted(set(members)):
        manifest = stats_manifest(ctx, prefix)
        if manifest is None:
            continue  # not ready: refused by name where the universe is resolved
        held = statistics_layers(ctx, prefix, manifest, layout)
        missing = [spec.name for spec in needed if spec.name not in held]
        if missing:
            collected = manifest.get("settings", {}).get("modules")
            how = f" (collected with modules {', '.join(collected)})" if collected else ""
            problems.append(f"concept {name} has no statistics for {summarize_names(missing)}{how}")
    if problems:
        raise Conflict(
            f"the edit needs layers that its concepts' statistics lack: {'; '.join(problems)}. Choose modules/layers "
            "they cover, or post the concept with modules that include those layers"
        )


_STATS_LAYERS: dict[str, frozenset[str]] = {}  # statistics prefix -> its layers (statistics never change)


def statistics_layers(ctx: Context, prefix: str, manifest: dict[str, Any], layout: ModelLayout) -> frozenset[str]:
    """The layers a published statistics file holds: those its ``modules`` selected minus the ones
    collection could not read (``lacking``). Statistics published before ``lacking`` was recorded
    and holding fewer layers than that are read from the file's header (a few kilobytes)."""
    chosen = select_layers(layout.layers, manifest.get("settings", {}).get("modules"))
    if "lacking" in manifest or int(manifest.get("layers", len(chosen))) >= len(chosen):
        return frozenset(spec.name for spec in chosen) - set(manifest.get("lacking", ()))
    if prefix not in _STATS_LAYERS:
        _STATS_LAYERS[prefix] = frozenset(_header_metadata(ctx, prefix + "statistics.safetensors")["layer_group"])
    return _STATS_LAYERS[prefix]


def _header_metadata(ctx: Context, key: str) -> dict[str, Any]:
    """A stored safetensors file's metadata (JSON values decoded), read by range: its header only."""
    length = int.from_bytes(b"".join(ctx.storage.iter_range(key, 0, 7)), "little")
    header = json.loads(b"".join(ctx.storage.iter_range(key, 8, 8 + length - 1)))
    return {k: json.loads(v) if k == "layer_group" else v for k, v in (header.get("__metadata__") or {}).items()}


def _check_lora_rank(options: dict[str, Any]) -> None:
    """``lora_rank`` shapes a peft adapter only: with another format it would be silently ignored."""
    if options.get("lora_rank") is not None and options.get("format") != "peft":
        raise InvalidInput(f'lora_rank applies to format "peft" only, not {options.get("format")!r}')


def find_variant_request(ctx: Context, variant_id: str, *, recent: bool = False) -> dict[str, Any] | None:
    """The stored request; ``recent``: as of at most a second ago (views only, never a write's input)."""
    if not variant_id.isalnum():
        return None
    key = f"variants/{variant_id}/request.json"
    return ctx.reads.recent_json(key) if recent else ctx.storage.find_json(key)


def variant_manifest(ctx: Context, variant_id: str) -> dict[str, Any] | None:
    # Content-addressed and written once, last: cached once found.
    return ctx.reads.immutable_json(f"variants/{variant_id}/manifest.json") if variant_id.isalnum() else None


VARIANT_FIELDS = (
    "variant_id",
    "model_id",
    "terms",
    "alpha",
    "scaling",
    "format",
    "lora_rank",
    "lora_target",
    "modules",
    "layers",
    "module_strengths",
    "rcond",
    "universe_id",
)


def variant_view(ctx: Context, variant_id: str) -> dict[str, Any]:
    request = find_variant_request(ctx, variant_id, recent=True)
    if request is None:
        raise NotFound(f"variant {variant_id} does not exist")
    view = {k: request.get(k) for k in VARIANT_FIELDS}
    view.update(reference=request["reference"], job_id=request.get("job_id"), files=[])
    job = ctx.jobs.get(request["job_id"]) if request.get("job_id") else None  # before the manifest: see concept_model_state
    manifest = variant_manifest(ctx, variant_id)
    if manifest is not None:
        view.update(status="ready", files=manifest["files"], lora=manifest.get("lora"))
        return view
    view["status"] = "building" if job is not None and job["status"] not in FINISHED else "failed"
    return view


def list_variants(ctx: Context, model_id: str | None = None) -> list[dict[str, Any]]:
    """Every variant, or those of one model (404 when that model is not registered)."""
    if model_id is not None:
        get_model(ctx, model_id)
    ids = {k.split("/")[1] for k in ctx.reads.recent_listing("variants/") if k.endswith("/request.json")}
    views = [variant_view(ctx, v) for v in sorted(ids)]
    return [v for v in views if model_id is None or v["model_id"] == model_id]


@dataclass(frozen=True)
class Universe:
    """The concepts an engram is measured against, resolved to their statistics on one model."""

    names: list[str]  # sorted: reference ∪ terms
    stats: dict[str, str]  # concept -> statistics prefix
    prefixes: list[str]  # sorted, without duplicates (two names may share a dataset)


def resolve_universe(ctx: Context, model_id: str, terms: Sequence[str], reference: Sequence[str] | None) -> Universe:
    """``reference ∪ terms`` (reference defaulting to every ready concept); 404/409 naming the missing."""
    chosen = sorted(set(reference)) if reference is not None else _default_reference(ctx, model_id)
    names = sorted(set(chosen) | set(terms))
    resolved = _ready_stats(ctx, model_id, names)
    stats = {n: resolved[n]["prefix"] for n in names}
    return Universe(names, stats, sorted(set(stats.values())))
