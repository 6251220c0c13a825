"""A reference concept drawn from the model itself: ``POST /concepts`` with ``samples``.

A universe without general text gives an edit that is less selective. A platform without a retain
corpus can post ``{"samples": {"count", "max_new_tokens", "temperature", "seed"}}`` for one model:
its collection job first draws ``count`` texts with that model, stores them as the concept's dataset
(``datasets/<digest>.jsonl``, content-addressed like any upload: the same texts are the same
statistics), then collects them as text records.

How they are drawn (what a test reproduces with ``model.generate``): every sample starts from the
tokenizer's BOS token (its EOS where it has none) — also for chat models, whose chat template is not
rendered: the samples are the model's unconditional text distribution, the general text a reference
stands for. ``torch.manual_seed(seed)`` once (inside ``torch.random.fork_rng``: the process's own
random state is left as it was), then batches of ``ENGRAM_COLLECT_BATCH_SIZE`` in order, each
``model.generate(bos, do_sample=True, temperature, top_k=0, top_p=1.0, max_new_tokens,
min_new_tokens=max_new_tokens)``: pure temperature sampling (not the model's generation-config
truncation), every sample exactly ``max_new_tokens`` tokens (EOS is suppressed, so that no sample is
empty and a sample's size is what was asked). Decoded without special tokens. Deterministic for a
seed on one machine (and one batch size); another device or library version may draw other texts.

Memory: one batch's key/value cache at a time; the texts themselves go to a spooled file as drawn.

Here: the request checked at submission (the route, as a dataset reference is) and the concept's
samples (posted again: only the same samples, on the same model). The drawing:
:mod:`service.concepts.draw`, in the collection job (:mod:`service.concepts.collection`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from service.concepts.record import ConceptRecord
from service.config import Settings
from service.context import Context
from service.engine.probe_bound import model_context
from service.errors import Conflict, InvalidInput
from service.jobs.collect_plan import Sampling
from service.models.record import ModelRecord
from service.models.registry import get_model

if TYPE_CHECKING:
    from api_schemas.concepts import SampleRequest


def submitted_samples(ctx: Context, models: Sequence[str], samples: SampleRequest | None) -> Sampling | None:
    """A request's ``samples`` checked against its models (:func:`check_sampling`); ``None``: none given.

    Raises:
        NotFound: an unknown model.
        InvalidInput: as :func:`check_sampling`.
    """
    if samples is None:
        return None
    sampling = Sampling.model_validate(samples.model_dump())
    check_sampling(ctx.settings, {m: get_model(ctx, m) for m in dict.fromkeys(models)}, sampling)
    return sampling


def check_sampling(settings: Settings, manifests: Mapping[str, ModelRecord], sampling: Sampling) -> None:
    """A samples request checked at submission: one text model, ``count`` and ``max_new_tokens`` in bounds.

    Raises:
        InvalidInput: several models, an image model, more samples than ENGRAM_MAX_SAMPLES or
            ENGRAM_MAX_RECORDS, or more tokens than the model's context leaves after its BOS token.
    """
    if len(manifests) != 1:
        raise InvalidInput(
            f"samples are drawn by one model and belong to it: name one model, not {', '.join(manifests)} "
            "(post one concept per model)"
        )
    ((model_id, manifest),) = manifests.items()
    if manifest.kind != "text":
        raise InvalidInput(f"model {model_id} is an image classifier: only a language model draws samples")
    if sampling.count > settings.max_samples:
        raise InvalidInput(
            f"samples.count {sampling.count} is more than ENGRAM_MAX_SAMPLES ({settings.max_samples}), the most texts "
            "this server draws for one concept: ask for fewer, or ask the operator to raise ENGRAM_MAX_SAMPLES"
        )
    if sampling.count > settings.max_records:
        raise InvalidInput(
            f"samples.count {sampling.count} is more than ENGRAM_MAX_RECORDS ({settings.max_records}): ask for fewer"
        )
    context = _context(Path(manifest.path))
    if context is not None and sampling.max_new_tokens >= context:
        raise InvalidInput(
            f"samples.max_new_tokens {sampling.max_new_tokens} does not fit model {model_id}'s context of {context} "
            f"tokens (max_position_embeddings) after its BOS token: ask for at most {context - 1}"
        )


def _context(folder: Path) -> int | None:
    """The model's context from its ``config.json`` (``None``: it does not say)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return model_context(SimpleNamespace(**text))


def drawn_digest(
    concept: ConceptRecord, samples: Sampling | None, digest: str | None, manifests: Mapping[str, ModelRecord]
) -> str | None:
    """The dataset digest a post of ``concept`` again stands for: for a samples concept posted with
    the same samples, the digest of the texts its model drew (they are its records); else ``digest``.

    Raises:
        Conflict: other samples (or records for a samples concept, or samples for a records concept),
            or a samples concept listed for a model that did not draw it.
    """
    if samples is None and concept.samples is None:
        return digest
    if samples != concept.samples:
        held = f"samples {concept.samples.model_dump()}" if concept.samples is not None else "records"
        raise Conflict(f"concept {concept.name} exists with {held}; delete it first or use another name")
    others = [m for m in manifests if m not in concept.models]
    if others:
        raise Conflict(
            f"concept {concept.name} holds samples drawn by model {', '.join(concept.models)}, which belong to it: "
            f"post another samples concept for {', '.join(others)}"
        )
    return concept.dataset_digest


def as_sampled(concept: ConceptRecord, samples: Sampling | None, role: str | None) -> ConceptRecord:
    """A new concept with its ``samples`` (a reference unless ``role`` was given); unchanged without."""
    if samples is None:
        return concept
    return concept.model_copy(update={"samples": samples, "role": role or "reference"})
