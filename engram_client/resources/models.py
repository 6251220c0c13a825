"""The service's probes and its models: health, readiness, registration, the list and one model."""

from __future__ import annotations

from api_schemas import Health, Model, Readiness
from engram_client.resources.jobs import JobsResource
from engram_client.transport import Page, _quote


class ModelsResource(JobsResource):
    """``/healthz``, ``/readyz`` and ``/models``; a remote registration is a job this waits for."""

    def health(self) -> Health:
        """``GET /healthz``: the process is up."""
        return self._parse(Health, self._request("GET", "/healthz"))

    def ready(self) -> Readiness:
        """``GET /readyz``: storage and broker reachable; a 503 raises at once (it is the answer, not a blip)."""
        return self._parse(Readiness, self._request("GET", "/readyz", retry=False))

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
