"""The ``evaluate`` job on an image classifier's variant: labelled image probes through the base, the
variant and the retrained model.

The probes are decoded, bounded and converted as a concept's image records are
(:mod:`service.datasets.images`, :mod:`service.engine.images`: the model's own image processor, its
channel count), in batches of ``ENGRAM_COLLECT_BATCH_SIZE``, decoded again for each model (at most
one batch of pixels is held at once). :func:`service.engine.classify.classify` gives each model's
logits and penultimate features, and :mod:`service.evaluation.classifier_metrics` the numbers:

- per model and probe set: top-1 accuracy, mean label NLL and the confusion row of each forgotten
  class (the labels of the forget probes) that has probes in the set;
- per model, with forget and retain probes: DA and NMI of the penultimate features;
- the variant's linear CKA to the base per set, and given the retrained model its CKA to it per set and
  ToW on the forget, retain and test accuracies (all three sets needed).

A number that cannot be computed (a set without probes, a representation that is the same for every
probe) is left out, naming why (``classifier.scores.left_out``). ``summary`` and ``records`` keep their
text shape: ``mean_nll`` / ``nll`` is the label's NLL and ``exact_match`` whether the top-1 class is
the label. The variant is the artifact shipped (checkpoint, delta or PEFT adapter; see
:mod:`service.evaluation.run`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import numpy as np
import torch

from api_schemas.evaluation import (
    ClassifierEvaluation,
    ClassifierModel,
    ClassifierModelReport,
    ClassifierScores,
    ClassifierSet,
    ClassifierSetReport,
    EvaluationResult,
    ProbeRecord,
    ProbeScore,
    ProbeSummary,
    Scored,
)
from service.context import Context
from service.datasets.images import IMAGE_FIELD, LABEL_FIELD, decode_base64, decode_image, resolve_label
from service.engine.classify import Classified, HeadNotFound, classify
from service.engine.collect import PixelBatch
from service.engine.image_resize import ResizePath
from service.engine.images import ImageProcessorError, channels_of, load_image_processor, pixel_batches
from service.engine.model_file_descriptors import clean_view
from service.errors import InvalidInput, JobFailed, PayloadTooLarge
from service.evaluation import classifier_metrics as metrics
from service.evaluation.records import ProbeJson, StoredProbes
from service.evaluation.retain_model import RetainModelRef
from service.models.loaded import checked_model_files, loaded_model
from service.models.record import ModelRecord
from service.models.registry import get_model
from service.variants.service import find_variant_request

# (base model, variant model, tokenizer) of a variant, as shipped: service.evaluation.run's loader.
VariantLoader = Callable[[Context, str], tuple[Any, Any, Any]]
# the probe sets and the models of a classifier evaluation, as the result names them (one spelling)
SETS: tuple[ClassifierSet, ...] = get_args(ClassifierSet)
ProbeSets = dict[ClassifierSet, list[ProbeJson]]
# one model's outputs per probe set
SetOutputs = Mapping[ClassifierSet, Classified]
# NMI's k-means costs n·d·k multiply-adds per Lloyd iteration (10 restarts, up to 300 iterations
# each): past this it is left out, naming why, rather than holding a worker for hours.
NMI_MAX_WORK = 2_000_000_000


@dataclass(frozen=True)
class Classifier:
    """A loaded classifier and the folder whose image processor reads its images.

    Attributes:
        folder: the model's folder on this machine (a job's: the folder of its checked files).
        processor: that image processor, when it was read already (a job reads it through the
            model's checked files: :func:`checked_processor`); ``None``: read from ``folder``.
    """

    model: Any
    folder: Path
    processor: Any = None


def model_classes(model: Any) -> dict[int, str]:
    """The loaded model's classes (``config.id2label``, ids as ints)."""
    # a transformers config: a model without labels has no id2label
    return {int(k): str(v) for k, v in (getattr(model.config, "id2label", None) or {}).items()}


def probe_sets(raw: Mapping[str, Sequence[ProbeJson] | None]) -> ProbeSets:
    """The stored probe sets that have probes, in the order forget, retain, test."""
    return {name: list(raw.get(name) or []) for name in SETS if raw.get(name)}


def resolved_labels(sets: ProbeSets, classes: dict[int, str]) -> dict[str, list[int]]:
    """Every probe's label as a class id of the model (checked at submission; again here, where the
    model itself is read)."""
    try:
        return {
            name: [_class_id(resolve_label(p[LABEL_FIELD], classes, f"{name}[{i}]")) for i, p in enumerate(probes)]
            for name, probes in sets.items()
        }
    except InvalidInput as exc:
        raise JobFailed(exc.detail) from None


def _class_id(label: int | None) -> int:
    if label is None:  # the schema requires a label on every image probe
        raise JobFailed("an image probe has no label")
    return label


def _images(probes: Sequence[ProbeJson], name: str, max_pixels: int, resize: ResizePath) -> Iterator[Any]:
    """The probes' decoded images; one that its resize would blow past ``max_pixels`` refused first."""
    for i, probe in enumerate(probes):
        where = f"{name}[{i}]"
        try:
            yield decode_image(decode_base64(probe[IMAGE_FIELD], where), where, max_pixels, resize)
        except (InvalidInput, PayloadTooLarge) as exc:  # the worker's own bound may be lower than the API's
            raise JobFailed(exc.detail) from None


def probe_pixels(
    classifier: Classifier, probes: Sequence[ProbeJson], name: str, *, batch_size: int, max_pixels: int
) -> Iterator[PixelBatch]:
    """The probes' pixels in batches, read by the classifier's own image processor (decoded lazily:
    one batch held at a time). An image that does not decode, a processor that cannot be read: JobFailed."""
    try:
        processor = classifier.processor if classifier.processor is not None else load_image_processor(classifier.folder)
        channels = channels_of(classifier.model.config)
    except ImageProcessorError as exc:
        raise JobFailed(str(exc)) from None
    images = _images(probes, name, max_pixels, ResizePath.of(processor))
    for values in pixel_batches(processor, images, batch_size, channels):
        yield PixelBatch(values)


def classified(model: Any, batches: Iterable[PixelBatch], labels: Sequence[int]) -> Classified:
    """:func:`~service.engine.classify.classify`, its refusals as the job's failure."""
    try:
        return classify(model, batches, labels)
    except (HeadNotFound, ImageProcessorError) as exc:
        raise JobFailed(str(exc)) from None


def run_classifier(
    classifier: Classifier,
    probes: Sequence[ProbeJson],
    labels: Sequence[int],
    name: str,
    *,
    batch_size: int,
    max_pixels: int,
    advance: Callable[[int], None],
) -> Classified:
    """One classifier's logits and penultimate features on one probe set, its images read by its
    own image processor; ``advance`` is called with each batch's image count."""

    def batches() -> Iterator[PixelBatch]:
        for batch in probe_pixels(classifier, probes, name, batch_size=batch_size, max_pixels=max_pixels):
            yield batch
            advance(batch.num_counted)

    return classified(classifier.model, batches(), labels)


# ---------------------------------------------------------------- the numbers


def per_probe(outputs: Classified) -> tuple[list[float], list[bool]]:
    """Each probe's label NLL (``−log softmax(logits)[label]``) and whether its top-1 class is its label."""
    logits, labels = outputs.logits.numpy(), outputs.labels.numpy()
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    nll = (-log_probs[np.arange(labels.shape[0]), labels]).tolist()
    correct = (np.argmax(logits, axis=1) == labels).tolist()
    return nll, correct


def set_report(outputs: Classified, forgotten: Sequence[int], name: str) -> ClassifierSetReport:
    """One model on one probe set: ``n``, accuracy, label NLL, and the forgotten classes' confusion rows."""
    logits, labels = outputs.logits.numpy(), outputs.labels.numpy()
    present = [c for c in forgotten if bool((labels == c).any())]
    confusion = {str(c): metrics.confusion_row(logits, labels, c, what=name) for c in present} if present else None
    return ClassifierSetReport(
        n=int(labels.shape[0]),
        accuracy=metrics.top1_accuracy(logits, labels, what=name),
        label_nll=metrics.mean_label_nll(logits, labels, what=name),
        confusion=confusion,
    )


def model_report(
    outputs: SetOutputs, forgotten: Sequence[int], model: str, left_out: dict[str, str]
) -> ClassifierModelReport:
    """One model's per-set reports, and its features' DA and NMI when forget and retain probes were given."""
    sets = {name: set_report(out, forgotten, name) for name, out in outputs.items()}
    if "forget" not in outputs or "retain" not in outputs:
        why = "needs forget and retain probes"
        left_out.update({f"{model}.da": why, f"{model}.nmi": why})
        return ClassifierModelReport(sets=sets)
    forget, retain = outputs["forget"], outputs["retain"]
    da: float | None = None
    try:
        da = metrics.dimensional_alignment(forget.features.numpy(), retain.features.numpy())
    except ValueError as exc:
        left_out[f"{model}.da"] = str(exc)
    features = torch.cat([forget.features, retain.features]).numpy()
    labels = torch.cat([forget.labels, retain.labels]).numpy()
    work = features.shape[0] * features.shape[1] * len(set(labels.tolist()))
    if work > NMI_MAX_WORK:
        left_out[f"{model}.nmi"] = (
            f"k-means of {features.shape[0]} features {features.shape[1]} wide into {len(set(labels.tolist()))} "
            f"clusters is {work:.3g} multiply-adds an iteration, past {NMI_MAX_WORK:.0e}: send fewer probes"
        )
        return ClassifierModelReport(sets=sets, da=da)
    nmi: float | None = None
    try:
        nmi = metrics.feature_nmi(features, labels)
    except ValueError as exc:
        left_out[f"{model}.nmi"] = str(exc)
    return ClassifierModelReport(sets=sets, da=da, nmi=nmi)


def cka_per_set(first: SetOutputs, second: SetOutputs, what: str, left_out: dict[str, str]) -> dict[ClassifierSet, float]:
    """Linear CKA of two models' penultimate features on each probe set (a set where it is undefined
    is left out, naming why)."""
    values: dict[ClassifierSet, float] = {}
    for name, outputs in first.items():
        try:
            values[name] = metrics.linear_cka(outputs.features.numpy(), second[name].features.numpy())
        except ValueError as exc:
            left_out[f"{what}.{name}"] = str(exc)
    return values


def tug_of_war(variant: SetOutputs, retrained: SetOutputs, left_out: dict[str, str]) -> float | None:
    """ToW of the variant against the retrained model on the forget, retain and test accuracies."""
    missing = [name for name in SETS if name not in variant]
    if missing:
        left_out["tow"] = f"ToW compares the forget, retain and test accuracies; no {', '.join(missing)} probes given"
        return None

    def accuracies(outputs: SetOutputs) -> metrics.SetAccuracies:
        values = {n: metrics.top1_accuracy(o.logits.numpy(), o.labels.numpy(), what=n) for n, o in outputs.items()}
        return metrics.SetAccuracies(forget=values["forget"], retain=values["retain"], test=values["test"])

    return metrics.tug_of_war(accuracies(variant), accuracies(retrained))


def classifier_section(outputs: Mapping[ClassifierModel, SetOutputs], forgotten: Sequence[int]) -> ClassifierEvaluation:
    """The result's ``classifier`` section from every model's outputs (``base``, ``variant``,
    ``retrained`` when given), per probe set. A score not computed is absent, ``left_out`` naming why."""
    left_out: dict[str, str] = {}
    models = {name: model_report(per_set, forgotten, name, left_out) for name, per_set in outputs.items()}
    cka_to_base = cka_per_set(outputs["variant"], outputs["base"], "cka_to_base", left_out)
    cka_to_retrained: dict[ClassifierSet, float] | None = None
    tow: float | None = None
    retrained = outputs.get("retrained")
    if retrained is not None:
        cka_to_retrained = cka_per_set(outputs["variant"], retrained, "cka_to_retrained", left_out)
        tow = tug_of_war(outputs["variant"], retrained, left_out)
    else:
        why = "needs retain_model (the classifier retrained without the forget classes)"
        left_out.update({"tow": why, "cka_to_retrained": why})
    scores = ClassifierScores(tow=tow, cka_to_base=cka_to_base, cka_to_retrained=cka_to_retrained, left_out=left_out)
    return ClassifierEvaluation(forgotten_classes=list(forgotten), models=models, scores=scores)


# ---------------------------------------------------------------- the job


def checked_processor(ctx: Context, manifest: ModelRecord) -> tuple[Path, Any]:
    """The folder of a registered model's checked files on this machine and the image processor
    read from them (through their descriptors, :func:`~service.engine.model_file_descriptors.clean_view`).

    Never ``manifest.path``: that is the folder on the machine that registered the model, which a
    worker (its own ``ENGRAM_CACHE_DIR``) may not have; the checked files are a ``file://`` model's
    folder, a remote model's private copy in this machine's cache, a GGUF registration's
    dequantized folder (:func:`service.models.loaded.checked_model_files`).

    Raises:
        JobFailed: the files are not the registered ones, or the image processor cannot be read.
    """
    with checked_model_files(ctx, manifest) as files, clean_view(files) as view:
        try:
            return files.folder, load_image_processor(view)
        except ImageProcessorError as exc:  # named by the model's folder, not the private view's
            raise JobFailed(str(exc).replace(str(view), str(files.folder))) from None


def load_retrained(ctx: Context, option: RetainModelRef, load_variant: VariantLoader) -> Classifier:
    """The retrained classifier named by the stored ``retain_model`` option (a registered model, or a
    variant as shipped), with the folder of the image processor it reads images with."""
    if option.kind == "variant":
        request = find_variant_request(ctx, option.id)
        if request is None:
            raise JobFailed(f"retain_model {option.id} was deleted since this evaluation was asked for")
        _, model, _ = load_variant(ctx, option.id)
        return Classifier(model, *checked_processor(ctx, get_model(ctx, request.model_id)))
    manifest = get_model(ctx, option.id)
    if manifest.digest != option.digest:
        raise JobFailed(f"retain_model {option.id} was registered again since this evaluation was asked for")
    model, _ = loaded_model(ctx, manifest, ctx.settings.torch_device)
    return Classifier(model, *checked_processor(ctx, manifest))


def evaluate_classifiers(
    ctx: Context,
    variant_id: str,
    raw: StoredProbes,
    load_variant: VariantLoader,
    progress_for: Callable[[int], Any],
) -> EvaluationResult:
    """An image classifier's evaluation result (``summary``, ``records``, ``classifier``, ``retain_model``).

    Args:
        raw: the stored probes (``forget``, ``retain``, ``test``, ``classifier``).
        load_variant: loads a variant as shipped (``(base, variant, tokenizer)``).
        progress_for: makes the job's progress from its total (images × models).
    """
    option = raw.classifier.retain_model if raw.classifier is not None else None
    classifiers = _classifiers(ctx, variant_id, option, load_variant)
    sets = probe_sets({"forget": raw.forget, "retain": raw.retain, "test": raw.test})
    labels = resolved_labels(sets, model_classes(classifiers["base"].model))
    progress = progress_for(len(classifiers) * sum(len(p) for p in sets.values()))
    outputs = {
        model: {
            name: run_classifier(
                classifier,
                probes,
                labels[name],
                name,
                batch_size=ctx.settings.collect_batch_size,
                max_pixels=ctx.settings.max_image_pixels,
                advance=progress.advance,
            )
            for name, probes in sets.items()
        }
        for model, classifier in classifiers.items()
    }
    return _classifier_result(variant_id, sets, outputs, labels, option.id if option is not None else None)


def _classifiers(
    ctx: Context, variant_id: str, option: RetainModelRef | None, load_variant: VariantLoader
) -> dict[ClassifierModel, Classifier]:
    """The base and the variant as classifiers, and the retrained one when the request named it.

    Raises:
        JobFailed: the variant is gone or not built, or the retrained model has other classes.
    """
    request = find_variant_request(ctx, variant_id)
    if request is None:
        raise JobFailed(f"variant {variant_id} is not ready (deleted, or still building)")
    manifest = get_model(ctx, request.model_id)
    base, variant, _ = load_variant(ctx, variant_id)
    folder, processor = checked_processor(ctx, manifest)  # one image processor: the variant's is its base's
    classifiers: dict[ClassifierModel, Classifier] = {
        "base": Classifier(base, folder, processor),
        "variant": Classifier(variant, folder, processor),
    }
    if option is not None:
        classifiers["retrained"] = load_retrained(ctx, option, load_variant)
        if len(model_classes(classifiers["retrained"].model)) != len(model_classes(base)):
            raise JobFailed(f"retain_model {option.id} has another number of classes than the base model")
    return classifiers


def _classifier_result(
    variant_id: str,
    sets: ProbeSets,
    outputs: Mapping[ClassifierModel, SetOutputs],
    labels: Mapping[str, list[int]],
    retain_model: str | None,
) -> EvaluationResult:
    """The evaluation result of every model's outputs on every probe set."""
    forgotten = sorted(set(labels.get("forget", [])))
    scored: dict[Scored, dict[ClassifierSet, tuple[list[float], list[bool]]]] = {
        model: {name: per_probe(out) for name, out in outputs[model].items()} for model in ("base", "variant")
    }
    return EvaluationResult(
        variant_id=variant_id,
        summary={
            model: {
                name: ProbeSummary(mean_nll=float(np.mean(nll)), exact_match=float(np.mean(hits)), n=len(nll))
                for name, (nll, hits) in per_set.items()
            }
            for model, per_set in scored.items()
        },
        records=[
            ProbeRecord(
                split=name,
                index=i,
                base=ProbeScore(nll=scored["base"][name][0][i], exact_match=scored["base"][name][1][i]),
                variant=ProbeScore(nll=scored["variant"][name][0][i], exact_match=scored["variant"][name][1][i]),
            )
            for name in sets
            for i in range(len(sets[name]))
        ],
        classifier=classifier_section(outputs, forgotten),
        retain_model=retain_model,
    )
