"""An image classifier's ``calibrate`` job: candidates scored on labelled image probes.

A classifier's calibration always has a goal (:func:`service.calibration.goal.classifier_goal_spec`:
the request's objective, or the lowest ``forget_accuracy`` with ``retain_accuracy`` ≥ 0.9 × the
base's, or with a retrained model the highest ``tow``). Each candidate is built in memory as the
text path builds it (:class:`~service.calibration.candidates.CandidateWeights`: the variant's own
engram arithmetic and rounding), and scored by the code ``evaluate`` runs on a classifier's variant
(:mod:`service.evaluation.classifier_run`: the model's image processor, :func:`~service.engine.classify.classify`,
:mod:`service.evaluation.classifier_metrics`), so a candidate's ``forget_accuracy`` is the
``classifier.models.variant.sets.forget.accuracy`` that ``evaluate`` gives its built variant on the
same probes, its ``tow`` the evaluation's ``scores.tow``, its ``cka_to_base_<set>`` the
evaluation's ``scores.cka_to_base.<set>``.

The result keeps the text result's shape: a candidate's ``forget`` / ``retain`` scores are the
label's mean NLL (``mean_nll``), the top-1 accuracy (``exact_match``) and the label NLL ratio to the
base (``nll_ratio``), as evaluate's ``summary`` reads for image probes. The images are decoded once
and kept as pixels for every candidate while they fit in :data:`PIXEL_CACHE_BYTES`; past it they
are decoded again per candidate, one batch at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from api_schemas.calibration import HeldOutCheck
from api_schemas.evaluation import ClassifierSet
from service.calibration.candidates import SPLITS, CandidateWeights, Measured, ratio
from service.calibration.goal import GoalSpec
from service.calibration.goal_run import amend_goal_result, margins, resolved, resolved_bounds, validated_on_held_out
from service.calibration.goal_scoring import public
from service.calibration.goal_search import violation
from service.calibration.records import CalibrationProbes, StoredCalibrationResult
from service.calibration.search import Arm, Candidate, Outcome, SearchResult
from service.context import Context
from service.engine.classify import Classified, HeadNotFound, classification_head
from service.engine.collect import PixelBatch
from service.engine.layers import LayerSpec
from service.engine.layout import ModelLayout
from service.engrams.manifest import UniverseManifest
from service.errors import JobFailed
from service.evaluation import classifier_metrics as cm
from service.evaluation.classifier_run import (
    Classifier,
    ProbeSets,
    cka_per_set,
    classified,
    load_retrained,
    model_classes,
    probe_pixels,
    probe_sets,
    resolved_labels,
    tug_of_war,
)
from service.evaluation.records import ProbeJson

# Pixels kept decoded across candidates (a set past it is decoded again for each candidate).
PIXEL_CACHE_BYTES = 1 << 30
# The text search's Outcome is read from these two names (goal_search): for a classifier they carry
# the label NLL ratios, and are not shown as metrics (they would read as answer-NLL ratios of text).
OUTCOME_NAMES = ("forget_nll_ratio", "retain_nll_ratio")

Outputs = dict[ClassifierSet, Classified]


@dataclass
class ClassifierMeasured(Measured):
    """One candidate: the text-shaped summaries, and the model's outputs per probe set."""

    outputs: Outputs


class Pixels:
    """The probe sets' pixels as the classifier's image processor makes them, kept while they fit."""

    def __init__(self, classifier: Classifier, batch_size: int, max_pixels: int, limit: int = PIXEL_CACHE_BYTES) -> None:
        self.classifier, self.batch_size, self.max_pixels, self.limit = classifier, batch_size, max_pixels, limit
        self._kept: dict[str, list[PixelBatch]] = {}
        self._bytes = 0

    def batches(self, key: str, probes: Sequence[ProbeJson], name: str) -> Iterator[PixelBatch]:
        """``probes``' pixel batches (``key`` names the set in the cache, ``name`` in messages)."""
        if key in self._kept:
            yield from self._kept[key]
            return
        kept: list[PixelBatch] | None = []
        size = 0
        for batch in probe_pixels(self.classifier, probes, name, batch_size=self.batch_size, max_pixels=self.max_pixels):
            if kept is not None:
                size += batch.pixel_values.numel() * batch.pixel_values.element_size()
                if self._bytes + size <= self.limit:
                    kept.append(batch)
                else:
                    kept = None  # too big to keep: decoded again next time
            yield batch
        if kept is not None:
            self._kept[key] = kept
            self._bytes += size


def summary_of(outputs: Outputs) -> dict[str, dict[str, float]]:
    """Per set, evaluate's text-shaped summary of image probes: label NLL, top-1 accuracy, count."""
    return {
        name: {
            "mean_nll": cm.mean_label_nll(out.logits.numpy(), out.labels.numpy(), what=name),
            "exact_match": cm.top1_accuracy(out.logits.numpy(), out.labels.numpy(), what=name),
            "n": float(out.labels.shape[0]),
        }
        for name, out in outputs.items()
    }


def classifier_metrics(outputs: Outputs, base: Outputs, retrained: Outputs | None) -> dict[str, float]:
    """A model's calibration metrics from its outputs per set, the base's and the retrained model's:
    ``<set>_accuracy``, ``<set>_label_nll``, ``<set>_label_nll_ratio``, ``cka_to_base_<set>``, and
    with a retrained model ``cka_to_retrained_<set>`` and ``tow`` (with forget, retain and test sets).
    A value that cannot be computed (CKA of a constant representation) is left out."""
    values: dict[str, float] = {}
    own, of_base = summary_of(outputs), summary_of(base)
    for name, scores in own.items():
        values[f"{name}_accuracy"] = scores["exact_match"]
        values[f"{name}_label_nll"] = scores["mean_nll"]
        values[f"{name}_label_nll_ratio"] = ratio(scores["mean_nll"], of_base[name]["mean_nll"])
    left_out: dict[str, str] = {}
    values.update({f"cka_to_base_{n}": v for n, v in cka_per_set(outputs, base, "cka_to_base", left_out).items()})
    if retrained is not None:
        cka = cka_per_set(outputs, retrained, "cka_to_retrained", left_out)
        values.update({f"cka_to_retrained_{n}": v for n, v in cka.items()})
        tow = tug_of_war(outputs, retrained, left_out)
        if tow is not None:
            values["tow"] = tow
    return values


def _shown(values: Mapping[str, float]) -> dict[str, float | None]:
    return public({k: v for k, v in values.items() if k not in OUTCOME_NAMES})


class ClassifierCandidates(CandidateWeights):
    """Candidates of one universe's engrams on one loaded image classifier, scored on labelled images.

    Args:
        folder: the registered model's folder (its image processor reads the probes).
        sets: the searched probe sets (forget, retain and test, as stored).
        batch_size, max_pixels: as evaluate reads images (``ENGRAM_COLLECT_BATCH_SIZE``, the pixel bound).
        (the others: :class:`CandidateWeights`'s)
    """

    def __init__(
        self,
        ctx: Any,
        model_dir: Any,
        folder: Path,
        layout: ModelLayout,
        universe: UniverseManifest,
        term_prefixes: Sequence[str],
        device: str,
        union: Sequence[LayerSpec],
        sets: CalibrationProbes,
        *,
        batch_size: int,
        max_pixels: int,
    ) -> None:
        super().__init__(ctx, model_dir, layout, universe, term_prefixes, device, union)
        self.classes = model_classes(self.model)
        self.classifier = Classifier(self.model, folder)
        self.pixels = Pixels(self.classifier, batch_size, max_pixels)
        self.sets = probe_sets(sets.image_sets())
        self.labels = resolved_labels(self.sets, self.classes)
        self.base_outputs = self.outputs(self.base_model(), self.sets, self.labels)
        self.base = summary_of(self.base_outputs)

    def check_loaded(self, model: nn.Module) -> None:
        try:
            classification_head(model)
        except HeadNotFound as exc:
            raise JobFailed(f"an image classifier's calibration: {exc}") from None

    def outputs(self, model: nn.Module, sets: ProbeSets, labels: Mapping[str, Sequence[int]], prefix: str = "") -> Outputs:
        """``model``'s outputs on every set (``prefix`` keeps held-out sets apart in the pixel cache)."""
        return {
            name: classified(model, self.pixels.batches(prefix + name, probes, prefix + name), labels[name])
            for name, probes in sets.items()
        }

    def measure(self, arm: Arm, alpha: float) -> ClassifierMeasured:
        """Swap in the candidate's weights and classify every searched probe."""
        outputs = self.outputs(self._apply(arm, alpha), self.sets, self.labels)
        summary = summary_of(outputs)
        outcome = Outcome(
            ratio(summary["forget"]["mean_nll"], self.base["forget"]["mean_nll"]),
            ratio(summary["retain"]["mean_nll"], self.base["retain"]["mean_nll"]),
        )
        return ClassifierMeasured(summary, outcome, outputs)


class ClassifierGoalRun:
    """The goal's part of an image classifier's calibration (as :class:`~service.calibration.goal_run.GoalRun`
    is the text path's): the retrained model's outputs, each candidate's metrics, the held-out check.

    Args:
        spec: the stored goal (``kind`` "image").
        candidates: the loaded candidates, their model at the base weights.
        held: the stored probe sets held out (empty: no check).
    """

    def __init__(self, ctx: Context, spec: GoalSpec, candidates: ClassifierCandidates, held: CalibrationProbes) -> None:
        self.spec, self.candidates = spec, candidates
        self.held_sets = probe_sets(held.image_sets())
        self.has_held_out = all(split in self.held_sets for split in SPLITS)  # probe_sets keeps sets with probes
        self.held_labels = resolved_labels(self.held_sets, candidates.classes) if self.has_held_out else {}
        base = candidates.base_model()
        self.base_held = self._held(base) if self.has_held_out else {}
        self.retrained: Outputs | None = None
        self.retrained_held: Outputs | None = None
        if spec.retain_model is not None:
            self._load_retrained(ctx, spec)
        self.base_metrics = classifier_metrics(candidates.base_outputs, candidates.base_outputs, self.retrained)
        self.goal = resolved(spec, self.base_metrics)

    def _load_retrained(self, ctx: Context, spec: GoalSpec) -> None:
        from service.evaluation.run import loaded_variant  # the variant loader evaluate uses (as shipped)

        assert spec.retain_model is not None
        retrained = load_retrained(ctx, spec.retain_model, loaded_variant)
        if len(model_classes(retrained.model)) != len(self.candidates.classes):
            raise JobFailed(f"retain_model {spec.retain_model.id} has another number of classes than the base model")
        # its own image processor reads the images: no cache shared with the candidates' pixels
        pixels = Pixels(retrained, self.candidates.pixels.batch_size, self.candidates.pixels.max_pixels, limit=0)
        c = self.candidates

        def run(sets: ProbeSets, labels: Mapping[str, Sequence[int]]) -> Outputs:
            return {n: classified(retrained.model, pixels.batches(n, p, n), labels[n]) for n, p in sets.items()}

        self.retrained = run(c.sets, c.labels)
        if self.has_held_out:
            self.retrained_held = run(self.held_sets, self.held_labels)

    def _held(self, model: nn.Module) -> Outputs:
        return self.candidates.outputs(model, self.held_sets, self.held_labels, prefix="held_out ")

    def candidate_metrics(self, measured: Measured) -> dict[str, float]:
        """The candidate's metrics (and its label NLL ratios under the names the search reads its Outcome from)."""
        assert isinstance(measured, ClassifierMeasured)
        values = classifier_metrics(measured.outputs, self.candidates.base_outputs, self.retrained)
        values["forget_nll_ratio"] = measured.outcome.forget_ratio
        values["retain_nll_ratio"] = measured.outcome.retain_ratio
        return values

    def check_held_out(self, best: Candidate) -> HeldOutCheck:
        """The candidate on the held-out probes, its bounds resolved with the base's values there."""
        held = classifier_metrics(
            self._held(self.candidates.applied(best.arm, best.alpha)), self.base_held, self.retrained_held
        )
        base = classifier_metrics(self.base_held, self.base_held, self.retrained_held)
        goal = resolved(self.spec, base)
        return HeldOutCheck(
            probes={name: len(items) for name, items in self.held_sets.items()},
            margins=margins(goal, held),
            constraints=resolved_bounds(goal, base),
            feasible=violation(goal, held) == 0.0,
            base=_shown(base),
            recommended=_shown(held),
        )

    def validated_on_held_out(self, ranked: Sequence[Candidate]) -> tuple[Candidate, HeldOutCheck]:
        """The best-ranked candidate that meets the bounds on the held-out probes too, and its check."""
        return validated_on_held_out(ranked, self.check_held_out)

    def amend(self, result: StoredCalibrationResult, found: SearchResult, best: Candidate | None) -> StoredCalibrationResult:
        """The result with the goal's fields (every candidate's classifier metrics, the bounds)."""
        retrained = None
        if self.retrained is not None:
            retrained = _shown(classifier_metrics(self.retrained, self.candidates.base_outputs, self.retrained))
        return amend_goal_result(result, found, best, self.spec, self.goal, self.base_metrics, retrained, shown=_shown)


def is_classifier_goal(spec: GoalSpec | None) -> bool:
    return spec is not None and spec.kind == "image"


__all__ = [
    "PIXEL_CACHE_BYTES",
    "ClassifierCandidates",
    "ClassifierGoalRun",
    "ClassifierMeasured",
    "classifier_metrics",
    "is_classifier_goal",
    "summary_of",
]
