"""Evaluation and generation: jobs that run a ready variant and its base on probes or a prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from api_schemas import EvaluateJob, EvaluateRequest, GenerateJob, GenerateRequest
from engram_client.bodies import fields_body
from engram_client.resources.jobs import JobsResource, ProgressCallback
from engram_client.transport import _quote

# A probe: ``{"prompt", "completion"}`` (other keys are ignored), ``{"messages"}``, a ``(prompt,
# completion)`` pair, or for an image classifier ``{"image": <base64 PNG/JPEG/WebP>, "label": <id or name>}``.
ProbeLike = Mapping[str, Any] | Sequence[str]
IMAGE_FIELDS = ("image", "label")
# TOFU's extra answers, kept from a probe mapping that has them.
TOFU_FIELDS = ("paraphrased_answer", "perturbed_answers")


class EvaluationResource(JobsResource):
    """``/variants/{id}/evaluate`` and ``/variants/{id}/generate``: jobs, answered or waited for."""

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
        test: Sequence[ProbeLike] = (),
        metrics: str | Sequence[str] | None = None,
        retain_model: str | None = None,
        holdout: Sequence[ProbeLike] = (),
        utility: Mapping[str, Sequence[ProbeLike]] | None = None,
        attacks: Sequence[Mapping[str, Any]] = (),
        callback_url: str | None = None,
        wait_s: float = 0,
        wait: bool = False,
        on_progress: ProgressCallback | None = None,
        poll_s: float = 0.5,
        timeout: float | None = None,
    ) -> EvaluateJob:
        """Score a ready variant and its base model on probes: answer NLL and greedy exact match (job kind ``evaluate``).

        Args:
            forget: what the variant should have forgotten: ``{"prompt", "completion"}`` mappings (other keys
                are dropped, so JSONL records with an ``id`` pass) or ``(prompt, completion)`` pairs.
            retain: what it should keep, in the same forms; at least one of the two must hold a probe.
                A mapping's ``paraphrased_answer`` and ``perturbed_answers`` (TOFU's) are kept.
                An image classifier's variant takes ``{"image", "label"}`` mappings instead (the base64 of a
                PNG, JPEG or WebP file, and a class id or a name in the model's ``id2label``).
            test: image probes only: held-out images of every class (ToW's test accuracy).
            metrics: ``"tofu"`` for TOFU's whole suite, or a list of its names (OpenUnlearning's); None:
                NLL and exact match only.
            retain_model: with metrics, a registered model or variant trained without the forget set
                (same tokenizer): forget quality, privacy, memorization and Overall against it. With image
                probes (no metrics needed): the classifier retrained without the forget classes (ToW, CKA).
            holdout: with metrics, facts no model saw (the membership attacks' non-members).
            utility: with metrics, named probe sets the forget set does not touch (model utility).
            attacks: attacks on the forgetting (:mod:`api_schemas.attacks`), e.g. ``{"kind": "quantize",
                "type": "Q4_1"}``, ``{"kind": "relearn", "steps": 10}``; the result's ``attacks`` holds each
                one's scores per model, by name (``quantize:Q4_1``, ``relearn``, ``rephrase:chat_template``).
            callback_url: POSTed the job when it ends (its host must be allowlisted).
            wait_s: let the service hold its answer up to this many seconds (0 to 60) for the job to end.
            wait: then poll until the job ends (``on_progress``, ``poll_s`` and ``timeout`` as in
                :meth:`wait_for_job`).

        Returns:
            The job; without ``wait`` it may still be queued or running. Its ``result``, once succeeded, is an
            :class:`~api_schemas.EvaluationResult`: ``summary[model][split]`` (``base``/``variant``,
            ``forget``/``retain``) = ``{mean_nll, exact_match, n}`` (a split without probes is absent) and
            ``records``, one per probe in request order with both models' scores; with metrics,
            ``tofu[model]`` (``base``/``variant``/``retain``) = ``{values, left_out}``. With image probes,
            ``summary``/``records`` hold the label's NLL and top-1 correctness, and ``classifier`` a
            :class:`~api_schemas.evaluation.ClassifierEvaluation` (per model and set accuracy, label NLL,
            confusion; DA, NMI; ToW and CKA).

        Raises:
            ValueError: a probe is neither such a mapping nor a pair.
            EngramJobError: with ``wait``, the job failed or was cancelled.
            EngramTimeoutError: with ``wait``, the timeout passed.
        """
        given: dict[str, Any] = {
            "forget": _probes(forget, "forget"),
            "retain": _probes(retain, "retain"),
            "test": _probes(test, "test") or None,
            "callback_url": callback_url,
            "attacks": [dict(attack) for attack in attacks] or None,
        }
        images = any("image" in probe for split in ("forget", "retain") for probe in given[split]) or bool(test)
        if images:  # an image classifier's retrained model needs no metrics
            given["retain_model"] = retain_model
        if metrics is not None:
            given["metrics"] = metrics if isinstance(metrics, str) else list(metrics)
            given["retain_model"] = retain_model
            given["holdout"] = _probes(holdout, "holdout")
            given["utility"] = {name: _probes(items, name) for name, items in (utility or {}).items()}
        elif (retain_model is not None and not images) or holdout or utility:
            raise ValueError("retain_model, holdout and utility serve metrics: pass metrics='tofu' (or a list)")
        body = fields_body(EvaluateRequest, given)
        path = f"/variants/{_quote(variant_id)}/evaluate"
        return self._submit_job(EvaluateJob, path, body, wait_s, wait, on_progress, poll_s, timeout)

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
    ) -> GenerateJob:
        """Greedy continuation of ``prompt`` by a ready variant and/or its base (job kind ``generate``).

        Args:
            prompt: text, or chat messages (``[{"role", "content"}, …]``) that the service renders with
                the model's chat template and its generation prompt.
            models: ``base``, ``variant`` or both (the default).
            callback_url, wait_s, wait, on_progress, poll_s, timeout: as for :meth:`evaluate`.

        Returns:
            The job; once succeeded, ``result`` is a :class:`~api_schemas.GenerationResult`:
            ``{variant_id, prompt, outputs: {model: {text, token_ids}}}``.
        """
        given = {
            "prompt": prompt if isinstance(prompt, str) else None,
            "messages": None if isinstance(prompt, str) else [dict(m) for m in prompt],
            "max_new_tokens": max_new_tokens,
            "models": models,
            "callback_url": callback_url,
        }
        body = fields_body(GenerateRequest, given)
        path = f"/variants/{_quote(variant_id)}/generate"
        return self._submit_job(GenerateJob, path, body, wait_s, wait, on_progress, poll_s, timeout)


def _probes(probes: Sequence[ProbeLike], split: str) -> list[dict[str, Any]]:
    """``{"prompt", "completion"}`` (or ``{"messages"}``, or ``{"image", "label"}``) for each probe, whichever
    form it came in; a bad one is named by split and index."""
    out: list[dict[str, Any]] = []
    for i, probe in enumerate(probes):
        extra = {k: probe[k] for k in TOFU_FIELDS if k in probe} if isinstance(probe, Mapping) else {}
        if isinstance(probe, Mapping) and "image" in probe:
            out.append({k: probe[k] for k in IMAGE_FIELDS if k in probe})
        elif isinstance(probe, Mapping) and "messages" in probe:
            out.append({"messages": [dict(m) for m in probe["messages"]], **extra})
        elif isinstance(probe, Mapping) and "prompt" in probe and "completion" in probe:
            out.append({"prompt": probe["prompt"], "completion": probe["completion"], **extra})
        elif isinstance(probe, Sequence) and not isinstance(probe, str) and len(probe) == 2:
            out.append({"prompt": probe[0], "completion": probe[1]})
        else:
            raise ValueError(
                f"{split}[{i}] is neither a {{prompt, completion}}, {{messages}} or {{image, label}} mapping nor a pair: "
                f"{probe!r:.100}"
            )
    return out
