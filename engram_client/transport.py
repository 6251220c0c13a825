"""A typed Python client for the Engram Service HTTP API (``../shared/CONTRACT.md``).

Every method returns the wire models of :mod:`api_schemas`. Errors are exceptions of one family:

* :class:`EngramAPIError`: the service answered with a non-2xx status (parsed from problem+json);
* :class:`EngramConnectionError`: the service could not be reached, or did not answer in time;
* :class:`EngramDownloadError`: a downloaded file does not match the variant's manifest;
* :class:`EngramTimeoutError`: a wait gave up before the job finished.

Idempotent GETs are retried with exponential backoff on connection errors and 503 (the service
answers 503 while its storage or broker is away, which is usually brief); writes never are, because
a POST that timed out may still have been applied.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter

from api_schemas import (
    Concept,
    ConceptSubmission,
    Job,
    Model,
    Universe,
    UniverseSubmission,
    UniverseUsage,
    Variant,
    VariantFile,
    VariantSubmission,
)
from api_schemas.models import MAX_PAGE_SIZE, NEXT_CURSOR_HEADER

__all__ = [
    "DEFAULT_URL",
    "EngramAPIError",
    "EngramClient",
    "EngramConnectionError",
    "EngramDownloadError",
    "EngramError",
    "EngramJobError",
    "EngramOutputExistsError",
    "EngramTimeoutError",
    "FINISHED",
    "Page",
]

DEFAULT_URL = "http://127.0.0.1:8000"
FINISHED = frozenset({"succeeded", "failed", "cancelled"})
REDIRECTS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5
CHUNK_BYTES = 1 << 20
MAX_RETRY_AFTER_S = 30.0
# How long the service may hold a map or a remote registration for its job before answering 202.
JOB_HOLD_S = 20.0

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
ProgressCallback = Callable[[Job], None]
DownloadCallback = Callable[[VariantFile, int], None]
# A probe: ``{"prompt", "completion"}`` (other keys are ignored) or a ``(prompt, completion)`` pair.
ProbeLike = Mapping[str, Any] | Sequence[str]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- errors


class Page(list[M], Generic[M]):
    """A list the service answered page by page: its items, and ``next_cursor``, the cursor of the
    page after them (``None`` when they end the list, always so for a list read whole)."""

    def __init__(self, items: Iterable[M] = (), next_cursor: str | None = None) -> None:
        super().__init__(items)
        self.next_cursor = next_cursor


class EngramError(Exception):
    """Base of every error the client raises."""


class EngramAPIError(EngramError):
    """The service answered with an error status.

    Attributes:
        status: the HTTP status code.
        title: the problem's short summary (e.g. ``Not found``).
        detail: what exactly was wrong with the request.
        problem: the whole problem+json body (``type``, ``title``, ``status``, ``detail``, ``errors``?).
    """

    def __init__(self, status: int, title: str, detail: str, problem: dict[str, Any]) -> None:
        super().__init__(f"{status} {title}: {detail}")
        self.status, self.title, self.detail, self.problem = status, title, detail, problem

    @classmethod
    def from_response(cls, response: httpx.Response) -> EngramAPIError:
        """Parse a problem+json answer; anything else (a proxy's HTML page) keeps its status and a text excerpt."""
        problem: dict[str, Any] = {}
        try:
            body = response.json()
            if isinstance(body, dict):
                problem = body
        except ValueError:
            pass
        status = int(problem.get("status") or response.status_code)
        title = str(problem.get("title") or response.reason_phrase or "HTTP error")
        detail = str(problem.get("detail") or response.text[:500].strip() or f"{response.request.method} {response.url}")
        return cls(status, title, detail, problem or {"status": status, "title": title, "detail": detail})


class EngramConnectionError(EngramError):
    """The service could not be reached (refused, DNS, TLS, timeout) after the retries.

    Attributes:
        timed_out: the service was reached but did not answer within the client's timeout.
    """

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class EngramDownloadError(EngramError):
    """A downloaded file's size or sha256 differs from the variant's manifest; nothing was written."""


class EngramOutputExistsError(EngramError, FileExistsError):
    """The download directory exists with other content; it is never merged into, only replaced on request."""


class EngramTimeoutError(EngramError, TimeoutError):
    """A wait for a job or variant ran past its timeout (the job itself keeps running)."""


class EngramJobError(EngramError):
    """A job the caller waited for failed or was cancelled.

    Attributes:
        job: the finished job; ``job.error`` is its problem, when it has one.
    """

    def __init__(self, job: Job) -> None:
        reason = f"{job.error.title}: {job.error.detail}" if job.error else "no error was recorded"
        super().__init__(f"{job.kind} job {job.job_id} {job.status}: {reason}")
        self.job = job


class _Transient(Exception):
    """An answer worth retrying (503); carries the error to raise when the retries run out."""

    def __init__(self, error: EngramAPIError, retry_after: float) -> None:
        super().__init__(str(error))
        self.error, self.retry_after = error, retry_after


# ---------------------------------------------------------------- the client


class EngramClient:
    """A synchronous client for one Engram Service.

    Args:
        base_url: the service's URL; default ``$ENGRAM_URL`` or ``http://127.0.0.1:8000``.
            A path prefix (a reverse proxy's ``/engram``) is kept.
        api_key: sent as ``Authorization: Bearer``; default ``$ENGRAM_API_KEY`` (none when unset).
        timeout: seconds for connecting and for each read.
        transport: an httpx transport (tests, proxies, custom TLS); default: the network.
        retries: how often an idempotent GET is retried on connection errors and 503.
        backoff_s: the first retry's delay; each further retry doubles it.
        page_size: items per request when a list is read whole (the service's maximum by default:
            the fewest round trips).
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 60,
        transport: httpx.BaseTransport | None = None,
        *,
        retries: int = 3,
        backoff_s: float = 0.5,
        page_size: int = MAX_PAGE_SIZE,
    ) -> None:
        self.base_url = (base_url or os.environ.get("ENGRAM_URL") or DEFAULT_URL).rstrip("/")
        api_key = api_key if api_key is not None else os.environ.get("ENGRAM_API_KEY")
        headers = {"Accept": "application/json", "User-Agent": "engram-client"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.retries, self.backoff_s, self.timeout = retries, backoff_s, timeout
        self.page_size = page_size
        # Redirects are followed by hand (see _stream): the Authorization header must never reach another host.
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport, follow_redirects=False
        )

    def __enter__(self) -> EngramClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    # ------------------------------------------------------------ operations

    def health(self) -> dict[str, Any]:
        """``GET /healthz``: the process is up."""
        return self._request("GET", "/healthz").json()

    def ready(self) -> dict[str, Any]:
        """``GET /readyz``: storage and broker reachable; a 503 raises at once (it is the answer, not a blip)."""
        return self._request("GET", "/readyz", retry=False).json()

    # ------------------------------------------------------------ models

    def register_model(self, model_id: str, source: str) -> Model:
        """Register a checkpoint (``file://``, ``s3://`` or ``hf://``); the same registration again is a no-op.

        A remote source is downloaded by a job on the service: this waits for it (as long as it takes).

        Raises:
            EngramJobError: the registration job failed (the source cannot be read, or is refused).
        """
        body = {"model_id": model_id, "source": source}
        return self._parse(Model, self._answer_after_job("POST", "/models", json=body))

    def list_models(self, *, limit: int | None = None, cursor: str | None = None) -> Page[Model]:
        """Registered models by ID: all of them, or one page with ``limit``/``cursor`` (see :meth:`_list`)."""
        return self._list(Model, "/models", None, limit, cursor)

    def get_model(self, model_id: str) -> Model:
        """One model and its editable layers."""
        return self._parse(Model, self._request("GET", f"/models/{_quote(model_id)}"))

    # ------------------------------------------------------------ concepts

    def add_concept(
        self,
        name: str,
        models: Sequence[str],
        records: Sequence[Mapping[str, Any]] | None = None,
        jsonl_path: str | os.PathLike[str] | None = None,
        role: str = "target",
        description: str | None = None,
        callback_url: str | None = None,
        modules: Sequence[str] | None = None,
        dataset: Mapping[str, Any] | None = None,
        template: str | None = None,
    ) -> ConceptSubmission:
        """Store a concept and start collecting its statistics on each model.

        Args:
            name: the concept's name (letters, digits, ``.``, ``_``, ``-``).
            models: model IDs to collect on.
            records: inline records, ``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages": [...]}``;
                for small datasets.
            jsonl_path: a JSONL file, one record per line, streamed as a multipart upload; for large ones.
            dataset: a dataset reference the service's worker fetches: ``{"uri": "s3://…" | "hf://datasets/…"
                | "file:///…", "format"?, "columns"?, "rows"?}``.
            role: ``target`` (to be edited) or ``reference`` (only shapes the universe).
            description: free text kept with the concept.
            callback_url: POSTed each collection job when it ends (its host must be allowlisted).
            modules: module-name suffixes: collect only these layers' input groups (an edit must then
                select among them); default every editable layer.
            template: ``"chat"``: prompt/completion records rendered with the model's chat template.

        Returns:
            The concept and its collection jobs (already finished ones too, when the post repeats).

        Raises:
            ValueError: not exactly one of ``records``, ``jsonl_path`` and ``dataset``.
        """
        if sum(x is not None for x in (records, jsonl_path, dataset)) != 1:
            raise ValueError("pass exactly one of records= (inline), jsonl_path= (multipart upload), dataset= (reference)")
        fields = _set_only(
            name=name, models=list(models), role=role, description=description, callback_url=callback_url, template=template
        )
        if modules is not None:
            fields["modules"] = list(modules)
        if records is not None or dataset is not None:
            body = {"records": list(records)} if records is not None else {"dataset": dict(dataset or {})}
            response = self._request("POST", "/concepts", json={**fields, **body})
            return self._parse(ConceptSubmission, response)
        path = Path(jsonl_path)  # type: ignore[arg-type]  # checked above
        with path.open("rb") as upload:  # streamed from disk: a large dataset is never held in memory
            files = {"dataset": (path.name, upload, "application/x-ndjson")}
            response = self._request("POST", "/concepts", data=fields, files=files)
        return self._parse(ConceptSubmission, response)

    def list_concepts(self, *, limit: int | None = None, cursor: str | None = None) -> Page[Concept]:
        """Concepts by name with their per-model collection status: all of them, or one page with
        ``limit``/``cursor`` (see :meth:`_list`)."""
        return self._list(Concept, "/concepts", None, limit, cursor)

    def get_concept(self, name: str) -> Concept:
        """One concept."""
        return self._parse(Concept, self._request("GET", f"/concepts/{_quote(name)}"))

    def delete_concept(self, name: str) -> None:
        """Delete a concept (its cached statistics and the variants built from it stay)."""
        self._request("DELETE", f"/concepts/{_quote(name)}")

    # ------------------------------------------------------------ jobs

    def get_job(self, job_id: str) -> Job:
        """A job's status and progress."""
        return self._parse(Job, self._request("GET", f"/jobs/{_quote(job_id)}"))

    def list_jobs(
        self, status: Sequence[str] | None = None, *, limit: int | None = None, cursor: str | None = None
    ) -> Page[Job]:
        """The jobs not finished yet, oldest first; ``status`` (``queued``, ``running``) narrows them.
        All of them, or one page with ``limit``/``cursor`` (see :meth:`_list`)."""
        params = {"status": list(status)} if status else None
        return self._list(Job, "/jobs", params, limit, cursor)

    def cancel_job(self, job_id: str) -> Job:
        """Cancel a job: a queued one at once, a running one at its next checkpoint."""
        return self._parse(Job, self._request("DELETE", f"/jobs/{_quote(job_id)}"))

    def wait_for_job(
        self,
        job_id: str,
        on_progress: ProgressCallback | None = None,
        poll_s: float = 0.5,
        timeout: float | None = None,
    ) -> Job:
        """Poll a job until it succeeded, failed or was cancelled, and return it (whatever its status).

        Args:
            on_progress: called with the job after every poll, the finished job included.
            poll_s: seconds between polls.
            timeout: give up after this many seconds (``None``: wait as long as it takes).

        Raises:
            EngramTimeoutError: the timeout passed; the job keeps running on the service.
        """
        return self.wait_for_jobs([job_id], on_progress, poll_s, timeout)[0]

    def wait_for_jobs(
        self,
        job_ids: Sequence[str],
        on_progress: ProgressCallback | None = None,
        poll_s: float = 0.5,
        timeout: float | None = None,
    ) -> list[Job]:
        """:meth:`wait_for_job` for several jobs at once (a concept collected on several models); same order."""
        deadline = None if timeout is None else time.monotonic() + timeout
        latest: dict[str, Job] = {}
        while True:
            for job_id in job_ids:
                if job_id not in latest or latest[job_id].status not in FINISHED:
                    latest[job_id] = self.get_job(job_id)
                    if on_progress is not None:
                        on_progress(latest[job_id])
            if all(job.status in FINISHED for job in latest.values()):
                return [latest[job_id] for job_id in job_ids]
            if deadline is not None and time.monotonic() > deadline:
                running = [j for j, job in latest.items() if job.status not in FINISHED]
                raise EngramTimeoutError(f"jobs {', '.join(running)} did not finish within {timeout}s")
            time.sleep(poll_s)

    # ------------------------------------------------------------ universes

    def create_universe(
        self,
        model_id: str,
        concepts: Sequence[str] | None = None,
        rcond: float | None = None,
        callback_url: str | None = None,
    ) -> UniverseSubmission:
        """Build the universe of ``concepts`` (default: every concept ready on the model) and make it the
        model's current one; a universe already built answers at once (``job`` is then ``None``)."""
        body = _set_only(concepts=list(concepts) if concepts else None, rcond=rcond, callback_url=callback_url)
        return self._parse(UniverseSubmission, self._request("POST", f"/models/{_quote(model_id)}/universes", json=body))

    def list_universes(self, model_id: str, *, limit: int | None = None, cursor: str | None = None) -> Page[Universe]:
        """A model's universes, oldest first; ``current`` marks the one requests use. All of them, or
        one page with ``limit``/``cursor`` (see :meth:`_list`)."""
        return self._list(Universe, f"/models/{_quote(model_id)}/universes", None, limit, cursor)

    def get_universe(self, universe_id: str) -> Universe:
        """A universe: members, status, groups decomposed so far, bytes once built, last use."""
        return self._parse(Universe, self._request("GET", f"/universes/{_quote(universe_id)}"))

    def delete_universe(self, universe_id: str) -> None:
        """Delete a universe and its stored factors and engrams (an admin key; variants built from it
        stay). A 409 while a job builds or reads it, or while it is a model's current universe."""
        self._request("DELETE", f"/universes/{_quote(universe_id)}")

    def universe_usage(self, model_id: str | None = None) -> UniverseUsage:
        """Bytes the universes store (one model's, or all) against the service's budget."""
        params = _set_only(model_id=model_id)
        return self._parse(UniverseUsage, self._request("GET", "/universes/usage", params=params))

    # ------------------------------------------------------------ unlearning and composition

    def unlearn(
        self,
        model_id: str,
        concepts: Sequence[str],
        alpha: float = 1.0,
        *,
        scaling: str | None = None,
        modules: Sequence[str] | None = None,
        layers: Sequence[int] | None = None,
        rcond: float | None = None,
        reference: Sequence[str] | None = None,
        format: str | None = None,  # the API field name
        lora_rank: int | None = None,
        callback_url: str | None = None,
        module_strengths: Mapping[str, float] | None = None,
        lora_target: str | None = None,
        universe: str | None = None,
    ) -> VariantSubmission:
        """Remove concepts: ``W_new = W − α Σ_k f_l s_l W_k⁺``.

        Only the options that are set are sent, so the service's defaults apply to the rest.
        ``module_strengths`` maps module-name suffixes to a factor ``s`` on the strength (0 < s ≤ 4);
        ``lora_target="vllm"`` writes a peft adapter vLLM serves; ``universe`` pins the universe.

        Returns:
            The variant and its build job; ``job`` is ``None`` when the variant already existed (HTTP 200).
        """
        body = {"concepts": list(concepts), "alpha": alpha}
        body |= _edit_options(
            scaling,
            modules,
            layers,
            rcond,
            reference,
            format,
            lora_rank,
            callback_url,
            module_strengths,
            lora_target,
            universe,
        )
        return self._parse(VariantSubmission, self._request("POST", f"/models/{_quote(model_id)}/unlearn", json=body))

    def compose(
        self,
        model_id: str,
        terms: Mapping[str, float],
        *,
        scaling: str | None = None,
        modules: Sequence[str] | None = None,
        layers: Sequence[int] | None = None,
        rcond: float | None = None,
        reference: Sequence[str] | None = None,
        format: str | None = None,  # the API field name
        lora_rank: int | None = None,
        callback_url: str | None = None,
        module_strengths: Mapping[str, float] | None = None,
        lora_target: str | None = None,
        universe: str | None = None,
    ) -> VariantSubmission:
        """Engram arithmetic: ``W_new = W + Σ_k c_k f_l W_k⁺`` (negative coefficients remove, positive add back)."""
        body: dict[str, Any] = {"terms": dict(terms)}
        body |= _edit_options(
            scaling,
            modules,
            layers,
            rcond,
            reference,
            format,
            lora_rank,
            callback_url,
            module_strengths,
            lora_target,
            universe,
        )
        return self._parse(VariantSubmission, self._request("POST", f"/models/{_quote(model_id)}/compose", json=body))

    # ------------------------------------------------------------ variants

    def get_variant(self, variant_id: str) -> Variant:
        """A variant: its terms, options, status and files."""
        return self._parse(Variant, self._request("GET", f"/variants/{_quote(variant_id)}"))

    def list_variants(
        self, model_id: str | None = None, *, limit: int | None = None, cursor: str | None = None
    ) -> Page[Variant]:
        """Variants by ID, or only those built from ``model_id``: all of them, or one page with
        ``limit``/``cursor`` (see :meth:`_list`)."""
        params = {"model_id": model_id} if model_id is not None else None
        return self._list(Variant, "/variants", params, limit, cursor)

    def wait_for_variant(
        self,
        variant_id: str,
        on_progress: ProgressCallback | None = None,
        poll_s: float = 0.5,
        timeout: float | None = None,
    ) -> Variant:
        """Wait until a variant is built and return it.

        Raises:
            EngramJobError: the build failed or was cancelled.
            EngramTimeoutError: the timeout passed.
        """
        variant = self.get_variant(variant_id)
        if variant.status == "building" and variant.job_id:
            job = self.wait_for_job(variant.job_id, on_progress, poll_s, timeout)
            if job.status != "succeeded":
                raise EngramJobError(job)
            variant = self.get_variant(variant_id)
        if variant.status != "ready":
            last = self.get_job(variant.job_id) if variant.job_id else None
            if last is not None and last.status in FINISHED:
                raise EngramJobError(last)
            raise EngramError(f"variant {variant_id} is {variant.status}, not ready")
        return variant

    def download_variant(
        self,
        variant_id: str,
        out_dir: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        on_progress: DownloadCallback | None = None,
    ) -> Path:
        """Download every file of a ready variant into ``out_dir``, all verified, or nothing at all.

        Files are streamed into a temporary sibling of ``out_dir``, each checked against the manifest's
        size and sha256; only when all of them match is the directory renamed into place, so a failed
        or interrupted download never leaves a half-written checkpoint behind. Redirects to presigned
        storage URLs are followed without the API key.

        Args:
            out_dir: the directory to create. When it exists and already holds exactly these verified
                files, nothing is downloaded; any other non-empty directory is refused unless ``overwrite``.
            on_progress: called with (file, bytes received so far) as each file streams in.

        Returns:
            ``out_dir`` as a :class:`~pathlib.Path`.

        Raises:
            EngramDownloadError: a file's size or sha256 is wrong (``out_dir`` is left untouched).
            EngramOutputExistsError: ``out_dir`` holds something else and ``overwrite`` is off, or is a
                file (never replaced, even with ``overwrite``).
            EngramError: the variant is not ready.
        """
        variant = self.get_variant(variant_id)
        if variant.status != "ready":
            raise EngramError(f"variant {variant_id} is {variant.status}, not ready: nothing to download")
        for entry in variant.files:
            _check_relative(entry.path)
        target = Path(out_dir)
        if (target.exists() or target.is_symlink()) and not target.is_dir():
            # --force replaces a directory of files, never a file that happens to have that name.
            raise EngramOutputExistsError(f"{target} is a file, not a directory: name a directory to download into")
        if _non_empty(target) and not overwrite:
            if _holds_exactly(target, variant.files):
                return target
            raise EngramOutputExistsError(f"{target} exists and holds something else than this variant")
        target.parent.mkdir(parents=True, exist_ok=True)
        # A sibling, so the final rename stays on one file system; mkdir (not mkdtemp) so the umask applies.
        staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.partial"
        staging.mkdir()
        try:
            for entry in variant.files:
                self._download_file(variant_id, entry, staging / entry.path, on_progress)
            _publish(staging, target)
        except BaseException:  # KeyboardInterrupt too: never leave the staging directory behind
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target

    # ------------------------------------------------------------ evaluation and generation
    #
    # Both start a job. One design for both: the call returns the job as the service answered it,
    # finished when it ended within ``wait_s`` (the service holds the answer up to 60 s), else queued
    # or running, to be polled with wait_for_job. With ``wait=True`` the client polls until the job
    # ends and returns it succeeded, or raises EngramJobError, as wait_for_variant does.

    def evaluate(
        self,
        variant_id: str,
        forget: Sequence[ProbeLike] = (),
        retain: Sequence[ProbeLike] = (),
        *,
        callback_url: str | None = None,
        wait_s: float = 0,
        wait: bool = False,
        on_progress: ProgressCallback | None = None,
        poll_s: float = 0.5,
        timeout: float | None = None,
    ) -> Job:
        """Score a ready variant and its base model on probes: answer NLL and greedy exact match (job kind ``evaluate``).

        Args:
            forget: what the variant should have forgotten: ``{"prompt", "completion"}`` mappings (other keys
                are dropped, so JSONL records with an ``id`` pass) or ``(prompt, completion)`` pairs.
            retain: what it should keep, in the same forms; at least one of the two must hold a probe.
            callback_url: POSTed the job when it ends (its host must be allowlisted).
            wait_s: let the service hold its answer up to this many seconds (0 to 60) for the job to end.
            wait: then poll until the job ends (``on_progress``, ``poll_s`` and ``timeout`` as in
                :meth:`wait_for_job`).

        Returns:
            The job; without ``wait`` it may still be queued or running. Its ``result``, once succeeded:
            ``summary.{base,variant}.{forget,retain}`` = ``{mean_nll, exact_match, n}`` (a split without
            probes is absent) and ``records``, one per probe in request order with both models' scores.

        Raises:
            ValueError: a probe is neither such a mapping nor a pair.
            EngramJobError: with ``wait``, the job failed or was cancelled.
            EngramTimeoutError: with ``wait``, the timeout passed.
        """
        body = _set_only(forget=_probes(forget, "forget"), retain=_probes(retain, "retain"), callback_url=callback_url)
        path = f"/variants/{_quote(variant_id)}/evaluate"
        return self._submit_job(path, body, wait_s, wait, on_progress, poll_s, timeout)

    def generate(
        self,
        variant_id: str,
        prompt: str | Sequence[Mapping[str, str]],
        max_new_tokens: int = 32,
        models: Sequence[str] | None = None,
        *,
        callback_url: str | None = None,
        wait_s: float = 0,
        wait: bool = False,
        on_progress: ProgressCallback | None = None,
        poll_s: float = 0.5,
        timeout: float | None = None,
    ) -> Job:
        """Greedy continuation of ``prompt`` by a ready variant and/or its base (job kind ``generate``).

        Args:
            prompt: text, or chat messages (``[{"role", "content"}, …]``) that the service renders with
                the model's chat template and its generation prompt.
            models: ``base``, ``variant`` or both (the default).
            callback_url, wait_s, wait, on_progress, poll_s, timeout: as for :meth:`evaluate`.

        Returns:
            The job; once succeeded, ``result`` is ``{variant_id, prompt, outputs: {model: {text, token_ids}}}``.
        """
        body = _set_only(
            prompt=prompt if isinstance(prompt, str) else None,
            messages=None if isinstance(prompt, str) else [dict(m) for m in prompt],
            max_new_tokens=max_new_tokens,
            models=list(models) if models is not None else None,
            callback_url=callback_url,
        )
        path = f"/variants/{_quote(variant_id)}/generate"
        return self._submit_job(path, body, wait_s, wait, on_progress, poll_s, timeout)

    # ------------------------------------------------------------ memory-trace maps

    def engram_map(
        self,
        model_id: str,
        concepts: Sequence[str],
        reference: Sequence[str] | None = None,
        rcond: float | None = None,
        *,
        measure: str | None = None,
    ) -> dict[str, Any]:
        """Where each concept's engram lives, by block and module type.

        Args:
            concepts: up to 8 concepts ready on the model.
            reference: the universe's other concepts (default: every concept ready on the model; ``[]``: none).
            rcond: the pseudo-inverse cut, as for :meth:`unlearn`.
            measure: ``data`` (the service's default): ``‖W_l⁺X‖_F / ‖W_l X‖_F`` over the universe's
                inputs, 0 to 1; ``weight``: the paper's ``‖W_l⁺‖_F / ‖W_l‖_F``.

        Returns:
            ``{model_id, concepts, reference, rcond, blocks, modules, maps: {concept: {rho, max, argmax}},
            outside_blocks, layers}``; ``rho`` is a blocks × modules grid (``None`` where a block lacks
            that module). A map not computed yet is computed by a job on the service: this waits for it.

        Raises:
            EngramJobError: the map's job failed.
        """
        params = _map_params(concepts, reference, rcond, measure)
        return self._answer_after_job("GET", f"/models/{_quote(model_id)}/engram-map", params=params).json()

    def engram_map_png(
        self,
        model_id: str,
        concepts: Sequence[str],
        reference: Sequence[str] | None = None,
        rcond: float | None = None,
        *,
        width: int | None = None,
        height: int | None = None,
        measure: str | None = None,
    ) -> bytes:
        """The map as a PNG heatmap, one panel per concept; ``width`` × ``height`` pixels (200 to 4000 each);
        ``measure`` as for :meth:`engram_map`.

        Raises:
            EngramError: the answer is not a PNG image.
        """
        params = _map_params(concepts, reference, rcond, measure) | _set_only(width=width, height=height)
        headers = {"Accept": "image/png, application/problem+json"}
        response = self._answer_after_job(
            "GET", f"/models/{_quote(model_id)}/engram-map.png", params=params, headers=headers
        )
        if not response.content.startswith(PNG_SIGNATURE):
            raise EngramError(f"the engram map of {model_id} is not a PNG ({response.headers.get('content-type')})")
        return response.content

    # ------------------------------------------------------------ transport

    def _submit_job(
        self,
        path: str,
        body: dict[str, Any],
        wait_s: float,
        wait: bool,
        on_progress: ProgressCallback | None,
        poll_s: float,
        timeout: float | None,
    ) -> Job:
        """POST a job (never retried); with ``wait``, poll it to the end and raise unless it succeeded."""
        options: dict[str, Any] = {}
        if wait_s:  # the service holds its answer up to wait_s: the read timeout must outlast the hold
            options = {"params": {"wait": wait_s}, "timeout": httpx.Timeout(self.timeout, read=self.timeout + wait_s)}
        job = self._parse(Job, self._request("POST", path, json=body, **options))
        if not wait:
            return job
        if job.status not in FINISHED:
            job = self.wait_for_job(job.job_id, on_progress, poll_s, timeout)
        elif on_progress is not None:
            on_progress(job)  # the caller hears of the end in every case
        if job.status != "succeeded":
            raise EngramJobError(job)
        return job

    def _answer_after_job(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send a request the service answers once a job did the work (a map, a remote registration):
        the service holds its answer up to :data:`JOB_HOLD_S` seconds, then answers 202 with the job;
        this waits for that job and asks again (its answer is then stored)."""
        params = {**kwargs.pop("params", {}), "wait": JOB_HOLD_S}
        held = httpx.Timeout(self.timeout, read=self.timeout + JOB_HOLD_S)  # the read outlasts the hold
        response = self._request(method, path, params=params, timeout=held, **kwargs)
        if response.status_code != 202:
            return response
        job = self.wait_for_job(self._parse(Job, response).job_id)
        if job.status != "succeeded":
            raise EngramJobError(job)
        return self._request(method, path, params=params, timeout=held, **kwargs)

    def _request(self, method: str, path: str, *, retry: bool | None = None, **kwargs: Any) -> httpx.Response:
        """Send one request; a non-2xx answer raises :class:`EngramAPIError`. GETs retry unless ``retry=False``."""
        retry = method == "GET" if retry is None else retry

        def send() -> httpx.Response:
            response = self._http.request(method, path, **kwargs)
            if retry and response.status_code == 503:
                raise _Transient(EngramAPIError.from_response(response), _retry_after(response))
            return response

        response = self._retrying(send, retry)
        if not response.is_success:
            raise EngramAPIError.from_response(response)
        return response

    def _retrying(self, attempt: Callable[[], T], retry: bool) -> T:
        """Run ``attempt``; on a connection error or :class:`_Transient`, back off and try again."""
        delays = [self.backoff_s * 2**n for n in range(self.retries)] if retry else []
        for n in range(len(delays) + 1):
            last = n == len(delays)
            try:
                return attempt()
            except httpx.TransportError as exc:
                if last:
                    raise self._connection_error(exc) from exc
                delay = delays[n]
            except _Transient as transient:
                if last:
                    raise transient.error from None
                delay = max(delays[n], transient.retry_after)
            time.sleep(delay)
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def _connection_error(self, exc: httpx.TransportError) -> EngramConnectionError:
        timed_out = isinstance(exc, httpx.TimeoutException)
        what = "did not answer in time" if timed_out else "could not be reached"
        return EngramConnectionError(
            f"the Engram service at {self.base_url} {what} ({type(exc).__name__}: {exc})", timed_out
        )

    def _download_file(self, variant_id: str, entry: VariantFile, dest: Path, on_progress: DownloadCallback | None) -> None:
        """Stream one file to ``dest`` (retried whole on connection errors), then verify size and sha256."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        path = f"/variants/{_quote(variant_id)}/files/{quote(entry.path, safe='/')}"

        def attempt() -> tuple[int, str]:
            digest, size = hashlib.sha256(), 0
            with self._stream(path) as response, dest.open("wb") as sink:
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    size += len(chunk)
                    if size > entry.size:  # stop early: a file that is too long is wrong whatever follows
                        break
                    sink.write(chunk)
                    digest.update(chunk)
                    if on_progress is not None:
                        on_progress(entry, size)
            return size, digest.hexdigest()

        size, sha256 = self._retrying(attempt, retry=True)
        if size != entry.size:
            raise EngramDownloadError(f"{entry.path}: received {size} bytes or more, the manifest says {entry.size}")
        if sha256 != entry.sha256:
            raise EngramDownloadError(f"{entry.path}: sha256 {sha256} differs from the manifest's {entry.sha256}")

    @contextmanager
    def _stream(self, path: str) -> Iterator[httpx.Response]:
        """GET ``path`` as a stream, following redirects by hand; 503 is :class:`_Transient`, other errors raise."""
        request = self._http.build_request("GET", path)
        for _ in range(MAX_REDIRECTS + 1):
            response = self._http.send(request, stream=True)
            if response.status_code in REDIRECTS and "location" in response.headers:
                response.close()
                request = self._redirected(request, response.headers["location"])
                continue
            try:
                if not response.is_success:
                    response.read()
                    error = EngramAPIError.from_response(response)
                    if response.status_code == 503:
                        raise _Transient(error, _retry_after(response))
                    raise error
                yield response
            finally:
                response.close()
            return
        raise EngramError(f"GET {path}: more than {MAX_REDIRECTS} redirects")

    def _redirected(self, previous: httpx.Request, location: str) -> httpx.Request:
        """The request for a redirect's target; the API key goes only to the service's own origin.

        A presigned S3 URL carries its own credentials: forwarding the key would leak it to the
        storage host (and S3 rejects a request that has two authentication mechanisms).
        """
        url = previous.url.join(location)
        request = self._http.build_request("GET", url)
        if not _same_origin(url, self._http.base_url):
            request.headers.pop("Authorization", None)
        return request

    def _list(
        self, model: type[M], path: str, params: Mapping[str, Any] | None, limit: int | None, cursor: str | None
    ) -> Page[M]:
        """A paginated list: every page, followed to the end, when neither ``limit`` nor ``cursor`` is
        given; else the one page of up to ``limit`` items (:attr:`page_size` unless given) starting
        at ``cursor`` (a previous page's ``next_cursor``; ``None``: the first page).

        Each item of a list that existed when paging began is returned once, even while others are
        added (the service pages in a stable order). A server without pagination answers the whole
        list at once, which this returns as it is.
        """
        one_page = limit is not None or cursor is not None
        query: dict[str, Any] = {**(params or {}), "limit": limit if limit is not None else self.page_size}
        items: list[M] = []
        while True:
            if cursor is not None:
                query["cursor"] = cursor
            response = self._request("GET", path, params=query)
            items.extend(self._parse_list(model, response))
            cursor = response.headers.get(NEXT_CURSOR_HEADER) or None
            if one_page or cursor is None:
                return Page(items, cursor)

    @staticmethod
    def _parse(model: type[M], response: httpx.Response) -> M:
        return model.model_validate_json(response.content)

    @staticmethod
    def _parse_list(model: type[M], response: httpx.Response) -> list[M]:
        return TypeAdapter(list[model]).validate_json(response.content)  # type: ignore[valid-type]


# ---------------------------------------------------------------- helpers


def _quote(segment: str) -> str:
    """A path segment for the URL; model IDs keep their one ``/`` (``org/name``), which the routes accept."""
    return quote(segment, safe="/")


def _set_only(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _edit_options(
    scaling: str | None,
    modules: Sequence[str] | None,
    layers: Sequence[int] | None,
    rcond: float | None,
    reference: Sequence[str] | None,
    fmt: str | None,
    lora_rank: int | None,
    callback_url: str | None,
    module_strengths: Mapping[str, float] | None = None,
    lora_target: str | None = None,
    universe: str | None = None,
) -> dict[str, Any]:
    """The options shared by unlearn and compose, only those set (the service's defaults apply to the rest)."""
    return _set_only(
        scaling=scaling,
        modules=list(modules) if modules is not None else None,
        layers=list(layers) if layers is not None else None,
        rcond=rcond,
        reference=list(reference) if reference is not None else None,
        format=fmt,
        lora_rank=lora_rank,
        callback_url=callback_url,
        module_strengths=dict(module_strengths) if module_strengths is not None else None,
        lora_target=lora_target,
        universe=universe,
    )


def _probes(probes: Sequence[ProbeLike], split: str) -> list[dict[str, Any]]:
    """``{"prompt", "completion"}`` for each probe, whichever form it came in; a bad one is named by split and index."""
    out: list[dict[str, Any]] = []
    for i, probe in enumerate(probes):
        if isinstance(probe, Mapping) and "messages" in probe:
            out.append({"messages": [dict(m) for m in probe["messages"]]})
        elif isinstance(probe, Mapping) and "prompt" in probe and "completion" in probe:
            out.append({"prompt": probe["prompt"], "completion": probe["completion"]})
        elif isinstance(probe, Sequence) and not isinstance(probe, str) and len(probe) == 2:
            out.append({"prompt": probe[0], "completion": probe[1]})
        else:
            raise ValueError(f"{split}[{i}] is neither a {{prompt, completion}} mapping nor a pair: {probe!r:.100}")
    return out


def _names(names: Sequence[str] | str) -> str:
    """Concept names for a query (``a,b``); one bare name is one name, not its letters."""
    return names if isinstance(names, str) else ",".join(names)


def _map_params(
    concepts: Sequence[str], reference: Sequence[str] | None, rcond: float | None, measure: str | None
) -> dict[str, Any]:
    names = _names(reference) if reference is not None else None
    return _set_only(concepts=_names(concepts), reference=names, rcond=rcond, measure=measure)


def _retry_after(response: httpx.Response) -> float:
    """Seconds from a ``Retry-After`` header (only the delta-seconds form), capped; 0 when absent."""
    try:
        return min(max(float(response.headers.get("retry-after", 0)), 0.0), MAX_RETRY_AFTER_S)
    except ValueError:
        return 0.0


def _same_origin(url: httpx.URL, base: httpx.URL) -> bool:
    return (url.scheme, url.host, url.port) == (base.scheme, base.host, base.port)


def _check_relative(path: str) -> None:
    """Refuse a manifest path that would land outside the output directory (a hostile or broken server)."""
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or any(p in {"..", "."} for p in parts) or "\\" in path:
        raise EngramDownloadError(f"the variant lists an unsafe file path {path!r}; refusing to download")


def _non_empty(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists()  # a file in the way counts as non-empty


def _holds_exactly(directory: Path, files: Sequence[VariantFile]) -> bool:
    """Whether ``directory`` holds exactly these files with the right sizes and sha256 (an earlier download)."""
    if not directory.is_dir():
        return False
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    if present != {f.path for f in files}:
        return False
    return all((directory / f.path).stat().st_size == f.size and _sha256(directory / f.path) == f.sha256 for f in files)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        for block in iter(lambda: source.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def _publish(staging: Path, target: Path) -> None:
    """Rename the verified ``staging`` directory to ``target``; whatever was at ``target`` goes only afterwards."""
    if not target.exists():
        os.replace(staging, target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent)) / "old"
    os.replace(target, aside)
    try:
        os.replace(staging, target)
    except OSError:
        os.replace(aside, target)  # put the old content back: the caller sees the error and the old directory
        raise
    finally:
        shutil.rmtree(aside.parent, ignore_errors=True)
