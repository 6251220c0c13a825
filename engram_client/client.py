"""A typed Python client for the Engram Service HTTP API.

Every method returns the wire models of :mod:`api_schemas`. Errors are exceptions of one family
(:mod:`engram_client.errors`):

* :class:`EngramAPIError`: the service answered with a non-2xx status (parsed from problem+json);
* :class:`EngramConnectionError`: the service could not be reached, or did not answer in time;
* :class:`EngramDownloadError`: a downloaded file does not match the variant's manifest;
* :class:`EngramTimeoutError`: a wait gave up before the job finished.

:class:`EngramClient` is composed of one mixin per resource (``engram_client/resources/``) over
the one :class:`~engram_client.transport.Transport` that sends, retries and parses; its methods
are documented where they are written.
"""

from __future__ import annotations

from types import TracebackType

from engram_client.errors import (
    EngramAPIError,
    EngramConnectionError,
    EngramDownloadError,
    EngramError,
    EngramJobError,
    EngramOutputExistsError,
    EngramTimeoutError,
)
from engram_client.resources.calibration import CalibrationResource
from engram_client.resources.concepts import ConceptsResource
from engram_client.resources.evaluation import EvaluationResource
from engram_client.resources.evaluation import ProbeLike as ProbeLike
from engram_client.resources.files import DownloadCallback as DownloadCallback
from engram_client.resources.files import FilesResource
from engram_client.resources.jobs import JOB_HOLD_S as JOB_HOLD_S
from engram_client.resources.jobs import JobsResource
from engram_client.resources.jobs import ProgressCallback as ProgressCallback
from engram_client.resources.maps import MapsResource
from engram_client.resources.models import ModelsResource
from engram_client.resources.universes import UniversesResource
from engram_client.resources.variants import VariantsResource
from engram_client.transport import DEFAULT_URL, FINISHED, Page

# Importable from here as before the split into resources (the CLI and 0.1.0's callers do).
from engram_client.transport import PNG_SIGNATURE as PNG_SIGNATURE
from engram_client.transport import _quote as _quote
from engram_client.transport import _set_only as _set_only

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


class EngramClient(
    ModelsResource,
    ConceptsResource,
    FilesResource,  # downloads a variant: a VariantsResource
    VariantsResource,
    EvaluationResource,
    MapsResource,
    JobsResource,  # after every resource that starts or waits for a job (the method resolution order)
    UniversesResource,
    CalibrationResource,
):
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

    def __enter__(self) -> EngramClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
