"""Image probes for an image classifier's evaluation: what is checked when they arrive.

A probe is ``{"image": "<base64 of a PNG, JPEG or WebP file>", "label": <class id or name>}``, checked
as a concept's image records are (:func:`service.datasets.images.check_image_file`: the format told by
its first bytes, ``ENGRAM_MAX_IMAGE_PIXELS`` and the aspect ratio read from the header, the file
checked whole without its pixels decoded: the API never holds an image). Everything the job could
refuse is refused here first, naming the probe (``forget[3]``) and the model's kind:

- image probes for a text model, text probes for an image model (the request's schema already
  refuses the two kinds together);
- a label name the model's ``id2label`` does not have, a class id past its classes;
- an image that is truncated or corrupt, or too far from square (422), or has too many pixels (413);
- a retain model (the classifier retrained without the forget classes) that is no image classifier,
  or has another number of classes than the base.

The module is torch-free: the API process reads the model's ``config.json``, never its weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from api_schemas.evaluation import CLASSIFIER_SETS
from service.context import Context
from service.datasets.images import IMAGE_FIELD, check_image_file, read_image_record
from service.errors import Conflict, InvalidInput, NotFound
from service.evaluation.retain_model import RetainModelRef
from service.models.classes import model_classes
from service.models.record import ModelRecord
from service.models.registry import find_model, get_model
from service.variants.service import find_variant_request, variant_view

IMAGE_PROBE_SHAPE = '{"image": "<base64 of a PNG, JPEG or WebP file>", "label": <class id or name>}'


def is_image_probe(probe: Mapping[str, Any]) -> bool:
    """Whether a probe (as dumped from the request) is a labelled image."""
    return IMAGE_FIELD in probe


def named_probes(probes: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[tuple[str, Mapping[str, Any]]]:
    """Every probe with how messages name it (``forget[0]``, ``test[2]``), in request order."""
    return [(f"{name}[{i}]", probe) for name in CLASSIFIER_SETS for i, probe in enumerate(probes.get(name, ()))]


def check_probe_kinds(probes: Mapping[str, Sequence[Mapping[str, Any]]], model: ModelRecord) -> None:
    """Refuse probes of another kind than the model reads, naming the first one and the model's kind.

    Raises:
        InvalidInput: a text probe for an image model, or an image probe for a text model.
    """
    for where, probe in named_probes(probes):
        if model.kind == "image" and not is_image_probe(probe):
            raise InvalidInput(
                f"{where} is a text probe, but model {model.model_id} is an image model ({model.architecture}): "
                f"its probes are labelled images, {IMAGE_PROBE_SHAPE}"
            )
        if model.kind != "image" and is_image_probe(probe):
            raise InvalidInput(
                f"{where} is an image probe, but model {model.model_id} is a {model.kind} model "
                f"({model.architecture}): its probes are prompt + completion or messages; image probes are for "
                "image classifiers"
            )


def check_image_probes(
    probes: Mapping[str, Sequence[Mapping[str, Any]]], classes: Mapping[int, str] | None, max_pixels: int
) -> None:
    """Check every probe's image from its file (:func:`~service.datasets.images.check_image_file`,
    never decoding its pixels) and resolve its label against ``classes``.

    Raises:
        InvalidInput: an image that is no PNG, JPEG or WebP, truncated or corrupt, or too far from
            square; a label that is no class of the model (naming the probe).
        PayloadTooLarge: an image of more than ``max_pixels`` pixels (a decompression bomb).
    """
    for where, probe in named_probes(probes):
        check_image_file(read_image_record(probe, where, classes).data, where, max_pixels)


def retain_classifier(ctx: Context, base: ModelRecord, retain_id: str) -> RetainModelRef:
    """The retrained classifier named by ``retain_model``, resolved (a registered model's checkpoint
    digest, or the variant id, which names its content), so that a re-registered retain model is a
    new evaluation.

    Raises:
        NotFound: neither a registered model nor a variant has this id.
        Conflict: a variant that is not ready.
        InvalidInput: not an image classifier, or another number of classes than the base.
    """
    manifest = find_model(ctx, retain_id)
    if manifest is not None:
        _check_same_classes(base, manifest, retain_id)
        return RetainModelRef(id=retain_id, kind="model", digest=manifest.digest)
    if find_variant_request(ctx, retain_id) is None:
        raise NotFound(f"retain_model {retain_id} is neither a registered model nor a variant")
    view = variant_view(ctx, retain_id)
    if view.status != "ready":
        raise Conflict(f"retain_model {retain_id} is a variant that is {view.status}, not ready")
    _check_same_classes(base, get_model(ctx, view.model_id), retain_id)
    return RetainModelRef(id=retain_id, kind="variant", digest=retain_id)


def _check_same_classes(base: ModelRecord, retain: ModelRecord, retain_id: str) -> None:
    if retain.kind != "image":
        raise InvalidInput(
            f"retain_model {retain_id} is a {retain.kind} model ({retain.architecture}), but model {base.model_id} "
            "is an image model: the retrained model of an image classifier is an image classifier"
        )
    if base.digest == retain.digest:
        return
    base_classes, retain_classes = model_classes(base), model_classes(retain)
    if base_classes is not None and retain_classes is not None and len(base_classes) != len(retain_classes):
        raise InvalidInput(
            f"retain_model {retain_id} has {len(retain_classes)} classes, model {base.model_id} has "
            f"{len(base_classes)}: ToW and the confusion rows compare the same classes (retrain with the same "
            "head, the forget classes left out of the training data)"
        )
