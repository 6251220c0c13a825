"""Variants: build one (unlearn, compose), read, list, and wait until it is ready."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from api_schemas import EditOptions, Variant, VariantSubmission
from api_schemas.variants import VariantReceipt
from engram_client.bodies import edit_keywords, edit_options_body
from engram_client.errors import EngramError, EngramJobError
from engram_client.resources.jobs import JobsResource, ProgressCallback
from engram_client.transport import FINISHED, Page, _quote


class VariantsResource(JobsResource):
    """``/models/{id}/unlearn``, ``/models/{id}/compose`` and ``/variants``; options from ``EditOptions``."""

    def unlearn(
        self,
        model_id: str,
        concepts: Sequence[str],
        alpha: float | None = None,
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
        adapter_base_model: str | None = None,
        gguf_quantization: str | None = None,
        universe: str | None = None,
        options: EditOptions | None = None,
    ) -> VariantSubmission:
        """Remove concepts: ``W_new = W − α Σ_k f_l s_l W_k⁺``.

        Only the options that are set are sent, so the service's defaults apply to the rest; without
        ``alpha`` the service uses the model's last calibration of these concepts, else a conservative
        α, and the answer's ``warnings`` say which.
        ``module_strengths`` maps module-name suffixes to a factor ``s`` on the strength (0 < s ≤ 4);
        ``lora_target="vllm"`` writes a peft adapter vLLM serves; ``format="gguf"`` one ``.gguf`` file
        (``gguf_quantization``: F32, F16, BF16, Q8_0, Q4_0 or Q4_1); ``universe`` pins the universe.
        The options are the fields of :class:`api_schemas.EditOptions`: pass them as keywords, or as
        ``options=EditOptions(...)`` to have them validated before anything is sent (not both for one option).

        Returns:
            The variant and its build job; ``job`` is ``None`` when the variant already existed (HTTP 200).
        """
        body: dict[str, Any] = {"concepts": list(concepts)} | ({} if alpha is None else {"alpha": alpha})
        body |= edit_options_body(options, edit_keywords(locals()))
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
        adapter_base_model: str | None = None,
        gguf_quantization: str | None = None,
        universe: str | None = None,
        options: EditOptions | None = None,
    ) -> VariantSubmission:
        """Engram arithmetic: ``W_new = W + Σ_k c_k f_l W_k⁺`` (negative coefficients remove, positive add back);
        the options as for :meth:`unlearn`."""
        body: dict[str, Any] = {"terms": dict(terms)}
        body |= edit_options_body(options, edit_keywords(locals()))
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

    def variant_receipt(self, variant_id: str) -> VariantReceipt:
        """A ready variant's receipt (save its JSON and check a downloaded folder with ``engram verify``)."""
        return self._parse(VariantReceipt, self._request("GET", f"/variants/{_quote(variant_id)}/receipt"))

    def delete_variant(self, variant_id: str) -> None:
        """Delete a variant and everything it owns (the key that created it, or an admin key)."""
        self._request("DELETE", f"/variants/{_quote(variant_id)}")

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
