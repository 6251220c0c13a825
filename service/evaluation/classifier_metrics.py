"""Metrics of class-wise unlearning on an image classifier, from logits, labels and penultimate features.

Pure numpy functions over what a classifier already produced (:mod:`service.engine.classify`
produces it): no model, no torch, no scikit-learn (the service does not depend on it; the tests
compare against it). Everything is float64.

Per probe set (forget / retain / test):

* :func:`top1_accuracy`: the fraction of probes whose largest logit is their label (ties go to the
  lowest class index, as ``argmax`` does);
* :func:`mean_label_nll`: the mean of ``−log softmax(logits)[label]``;
* :func:`confusion_row`: where the probes of one class go: the fraction predicted as each class.

Against a model retrained without the forget set (the AI Engram paper's appendix, "Evaluation Metrics"):

* :func:`tug_of_war`: ToW (Zhao et al. 2024, "What makes unlearning hard and what to do about it",
  NeurIPS): ``ToW = (1 − da(X⁺))·(1 − da(X⁻))·(1 − da(D_test))`` with
  ``da(D) = |a(μᵘ, D) − a(μʳ, D)|`` the absolute difference of the unlearned and the retrained
  model's accuracies; accuracies are fractions in [0, 1], so ToW is in [0, 1] and 1 is best.
  The paper's X⁺ is the forget set and X⁻ the retain set.
* :func:`dimensional_alignment`: DA (Seo, Kim and Han 2025, "Revisiting Machine Unlearning with
  Dimensional Alignment", WACV): how well the forget set's penultimate features lie in the retain
  set's principal subspace. See its docstring for what was chosen where the definition was not at hand.
* :func:`feature_nmi`: NMI of the penultimate features (Seo et al. 2025): the normalized mutual
  information between a k-means clustering of the features and the class labels.
* :func:`linear_cka`: linear CKA (Kornblith et al. 2019, "Similarity of Neural Network
  Representations Revisited", ICML, eq. for the linear kernel):
  ``CKA(X, Y) = ‖YᵀX‖_F² / (‖XᵀX‖_F · ‖YᵀY‖_F)`` on column-centred ``X`` ``[n, p₁]`` and ``Y`` ``[n, p₂]``
  (the same n examples through two models).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "DA_ENERGY",
    "EmptyProbeSet",
    "SetAccuracies",
    "confusion_row",
    "dimensional_alignment",
    "feature_nmi",
    "kmeans",
    "linear_cka",
    "mean_label_nll",
    "normalized_mutual_info",
    "top1_accuracy",
    "tug_of_war",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# The share of the retain features' energy (sum of squared singular values) that DA's principal
# subspace keeps: see dimensional_alignment.
DA_ENERGY = 0.99


class EmptyProbeSet(ValueError):
    """A metric was asked of a probe set (or a class within one) that has no probes; the message names it."""


@dataclass(frozen=True)
class SetAccuracies:
    """Top-1 accuracies (fractions in [0, 1]) of one model on the forget, retain and test probes."""

    forget: float
    retain: float
    test: float


def _logits_and_labels(logits: npt.ArrayLike, labels: npt.ArrayLike, what: str) -> tuple[FloatArray, IntArray]:
    scores = np.asarray(logits, dtype=np.float64)
    classes = np.asarray(labels, dtype=np.int64)
    if scores.ndim != 2 or classes.ndim != 1 or scores.shape[0] != classes.shape[0]:
        raise ValueError(f"{what}: logits must be [n, classes] and labels [n]; got {scores.shape} and {classes.shape}")
    if scores.shape[0] == 0:
        raise EmptyProbeSet(f"{what}: the probe set is empty")
    if classes.min() < 0 or classes.max() >= scores.shape[1]:
        raise ValueError(
            f"{what}: labels must be class indices in [0, {scores.shape[1]}); got {sorted(set(classes.tolist()))}"
        )
    return scores, classes


def top1_accuracy(logits: npt.ArrayLike, labels: npt.ArrayLike, what: str = "probes") -> float:
    """The fraction of probes whose top logit is their label.

    Args:
        logits: ``[n, classes]``.
        labels: ``[n]`` class indices.
        what: The set's name for messages ("forget").

    Raises:
        EmptyProbeSet: ``n == 0``.
    """
    scores, classes = _logits_and_labels(logits, labels, what)
    return float(np.mean(np.argmax(scores, axis=1) == classes))


def _log_softmax(scores: FloatArray) -> FloatArray:
    shifted = scores - scores.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def mean_label_nll(logits: npt.ArrayLike, labels: npt.ArrayLike, what: str = "probes") -> float:
    """Mean over probes of ``−log softmax(logits)[label]`` (nats).

    Raises:
        EmptyProbeSet: ``n == 0``.
    """
    scores, classes = _logits_and_labels(logits, labels, what)
    log_probs = _log_softmax(scores)
    return float(-np.mean(log_probs[np.arange(classes.shape[0]), classes]))


def confusion_row(logits: npt.ArrayLike, labels: npt.ArrayLike, label: int, what: str = "probes") -> list[float]:
    """Where the probes of class ``label`` go: the fraction of them predicted as each class.

    Returns:
        ``classes`` fractions summing to 1 (entry ``label`` is that class's accuracy).

    Raises:
        EmptyProbeSet: the set has no probe of class ``label`` (the message names the class).
    """
    scores, classes = _logits_and_labels(logits, labels, what)
    mine = classes == label
    if not mine.any():
        raise EmptyProbeSet(f"{what}: no probe is labelled class {label}, so its confusion row is undefined")
    predicted = np.argmax(scores[mine], axis=1)
    counts = np.bincount(predicted, minlength=scores.shape[1]).astype(np.float64)
    return (counts / counts.sum()).tolist()


def tug_of_war(unlearned: SetAccuracies, retrained: SetAccuracies) -> float:
    """ToW of an unlearned model against the retrained one (Zhao et al. 2024; the AI Engram paper's appendix).

    ``(1 − |a_f(u) − a_f(r)|)·(1 − |a_r(u) − a_r(r)|)·(1 − |a_t(u) − a_t(r)|)`` with accuracies as
    fractions.

    Raises:
        ValueError: an accuracy outside [0, 1] (a percentage would make a factor negative).
    """
    for model, accuracies in (("unlearned", unlearned), ("retrained", retrained)):
        for name in ("forget", "retain", "test"):
            value = getattr(accuracies, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"ToW takes accuracies as fractions in [0, 1]; the {model} model's {name} accuracy is {value}"
                )
    product = 1.0
    for name in ("forget", "retain", "test"):
        product *= 1.0 - abs(getattr(unlearned, name) - getattr(retrained, name))
    return product


def _features(values: npt.ArrayLike, what: str) -> FloatArray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 2:
        raise ValueError(f"{what} must be [n, features]; got shape {array.shape}")
    if array.shape[0] == 0:
        raise EmptyProbeSet(f"{what}: no probes")
    if not np.isfinite(array).all():
        raise ValueError(f"{what} hold non-finite values")
    return array


def linear_cka(x: npt.ArrayLike, y: npt.ArrayLike) -> float:
    """Linear CKA of two representations of the same examples (Kornblith et al. 2019).

    ``‖YᵀX‖_F² / (‖XᵀX‖_F ‖YᵀY‖_F)`` after centring each column (each feature) over the examples;
    equal to ``HSIC(XXᵀ, YYᵀ) / sqrt(HSIC(XXᵀ, XXᵀ)·HSIC(YYᵀ, YYᵀ))``. In [0, 1]; invariant to
    orthogonal transforms and isotropic scaling of either side; the widths may differ.

    Args:
        x: ``[n, p₁]`` features of n examples through one model.
        y: ``[n, p₂]`` features of the same n examples, in the same order, through another.

    Raises:
        ValueError: different example counts, or a side that is constant over the examples
            (its centred features are zero and CKA is 0/0).
    """
    first = _features(x, "CKA's first features")
    second = _features(y, "CKA's second features")
    if first.shape[0] != second.shape[0]:
        raise ValueError(f"CKA compares the same examples: got {first.shape[0]} and {second.shape[0]} rows")
    first = first - first.mean(axis=0, keepdims=True)
    second = second - second.mean(axis=0, keepdims=True)
    norm_x = np.linalg.norm(first.T @ first)
    norm_y = np.linalg.norm(second.T @ second)
    if norm_x == 0.0 or norm_y == 0.0:
        raise ValueError("CKA is undefined when one representation is the same for every example")
    return float(np.linalg.norm(second.T @ first) ** 2 / (norm_x * norm_y))


def dimensional_alignment(forget: npt.ArrayLike, retain: npt.ArrayLike, energy: float = DA_ENERGY) -> float:
    """DA: the share of the forget features' energy inside the retain features' principal subspace.

    Seo, Kim and Han (2025) define dimensional alignment as the alignment between the eigenspaces of
    the forget and the retain set's features (the AI Engram paper: "how well forget-set features
    align with the retain-set principal subspace"); a model retrained without the forget set maps
    unseen samples into the retain manifold, so higher is better. Computed here as

        ``DA = ‖Z_f U_k‖_F² / ‖Z_f‖_F²``,

    where ``U_k`` holds the top-``k`` right singular vectors of the retain features ``Z_r`` and
    ``Z_f`` are the forget features (rows are samples). Choices, because the paper's text could not
    be read from here (no network): features are not centred (the eigenspace of ``Z_rᵀZ_r``, as the
    authors' "eigenspaces of the samples"); ``k`` is the smallest count of singular directions that
    keeps ``energy`` (default 0.99) of ``‖Z_r‖_F²``. With ``energy = 1`` every direction the retain
    features span counts.

    Args:
        forget: ``[n_f, d]`` penultimate features of the forget probes.
        retain: ``[n_r, d]`` penultimate features of the retain probes.
        energy: Share of the retain energy the subspace keeps, in (0, 1].

    Raises:
        EmptyProbeSet: a set without probes.
        ValueError: widths differ, ``energy`` out of range, or zero features.
    """
    forget_features = _features(forget, "DA's forget features")
    retain_features = _features(retain, "DA's retain features")
    if forget_features.shape[1] != retain_features.shape[1]:
        raise ValueError(f"DA: forget features are {forget_features.shape[1]} wide, retain {retain_features.shape[1]}")
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"DA's energy must be in (0, 1]; got {energy}")
    _, singular, right = np.linalg.svd(retain_features, full_matrices=False)
    squares = singular**2
    if squares.sum() == 0.0 or not (forget_features**2).sum() > 0.0:
        raise ValueError("DA is undefined for features that are all zero")
    cumulative = np.cumsum(squares) / squares.sum()
    # The first k whose cumulative share reaches `energy` (a rounding margin so 1.0 reaches 1.0).
    k = int(np.searchsorted(cumulative, energy - 1e-12)) + 1
    basis = right[: min(k, right.shape[0])].T
    return float(np.linalg.norm(forget_features @ basis) ** 2 / np.linalg.norm(forget_features) ** 2)


def _entropy(counts: FloatArray) -> float:
    probabilities = counts[counts > 0] / counts.sum()
    return float(-(probabilities * np.log(probabilities)).sum())


def normalized_mutual_info(first: npt.ArrayLike, second: npt.ArrayLike) -> float:
    """NMI of two labelings of the same samples, normalized by the arithmetic mean of their entropies.

    ``I(A; B) / ((H(A) + H(B)) / 2)`` (natural logs; scikit-learn's default ``average_method``).
    Two labelings that are each a single cluster carry no information either way: 1.0, as
    scikit-learn returns.

    Raises:
        EmptyProbeSet: no samples.
        ValueError: different lengths.
    """
    a = np.asarray(first).ravel()
    b = np.asarray(second).ravel()
    if a.shape != b.shape:
        raise ValueError(f"NMI compares labelings of the same samples: got {a.shape[0]} and {b.shape[0]}")
    if a.shape[0] == 0:
        raise EmptyProbeSet("NMI of no samples")
    _, a_index = np.unique(a, return_inverse=True)
    _, b_index = np.unique(b, return_inverse=True)
    joint = np.zeros((a_index.max() + 1, b_index.max() + 1))
    np.add.at(joint, (a_index, b_index), 1.0)
    if joint.shape[0] == 1 and joint.shape[1] == 1:
        return 1.0
    h_a, h_b = _entropy(joint.sum(axis=1)), _entropy(joint.sum(axis=0))
    mutual = h_a + h_b - _entropy(joint.ravel())
    denominator = (h_a + h_b) / 2.0
    return 0.0 if denominator <= 0.0 else float(max(mutual, 0.0) / denominator)


def _plus_plus_centres(points: FloatArray, clusters: int, rng: np.random.Generator) -> FloatArray:
    """k-means++ seeding (Arthur and Vassilvitskii 2007): each next centre drawn ∝ squared distance."""
    centres = [points[rng.integers(points.shape[0])]]
    distances = _squared_distances(points, centres[0][None, :])[:, 0]
    for _ in range(1, clusters):
        total = distances.sum()
        index = rng.integers(points.shape[0]) if total == 0.0 else rng.choice(points.shape[0], p=distances / total)
        centres.append(points[index])
        distances = np.minimum(distances, _squared_distances(points, points[index][None, :])[:, 0])
    return np.asarray(centres)


def _squared_distances(points: FloatArray, centres: FloatArray) -> FloatArray:
    """``[n, k]`` squared Euclidean distances as ``‖x‖² − 2x·c + ‖c‖²`` (clamped at 0): memory ``n·k``,
    not the ``n·k·d`` of differencing every pair (ten thousand 768-wide features into 1000 classes)."""
    squares = (points**2).sum(axis=1)[:, None] - 2.0 * points @ centres.T + (centres**2).sum(axis=1)[None, :]
    return np.maximum(squares, 0.0)


def _lloyd(points: FloatArray, centres: FloatArray, max_iter: int) -> tuple[IntArray, float]:
    previous: IntArray | None = None
    for _ in range(max_iter):
        distances = _squared_distances(points, centres)
        assignment = distances.argmin(axis=1)
        if previous is not None and np.array_equal(assignment, previous):
            break
        for cluster in range(centres.shape[0]):
            members = points[assignment == cluster]
            if members.shape[0]:  # an emptied cluster keeps its centre
                centres[cluster] = members.mean(axis=0)
        previous = assignment
    distances = _squared_distances(points, centres)
    assignment = distances.argmin(axis=1)
    return assignment, float(distances[np.arange(points.shape[0]), assignment].sum())


def kmeans(points: npt.ArrayLike, clusters: int, seed: int = 0, restarts: int = 10, max_iter: int = 300) -> IntArray:
    """Lloyd's k-means from k-means++ seeds, the lowest-inertia run of ``restarts`` (deterministic per ``seed``).

    Returns:
        ``[n]`` cluster indices.

    Raises:
        ValueError: ``clusters`` not in [1, n], or ``restarts`` under 1.
    """
    features = _features(points, "k-means' points")
    if not 1 <= clusters <= features.shape[0]:
        raise ValueError(f"k-means needs 1 <= clusters <= {features.shape[0]} points; got {clusters}")
    if restarts < 1:
        raise ValueError(f"k-means needs at least one restart; got {restarts}")
    rng = np.random.default_rng(seed)
    runs = (_lloyd(features, _plus_plus_centres(features, clusters, rng), max_iter) for _ in range(restarts))
    return min(runs, key=lambda run: run[1])[0]  # the first of equal inertias, as a strict < keeps


def feature_nmi(features: npt.ArrayLike, labels: Sequence[int] | npt.ArrayLike, seed: int = 0) -> float:
    """NMI between a k-means clustering of penultimate features and the class labels (Seo et al. 2025).

    k is the number of distinct labels among the samples. Seo et al. cluster the features and
    compare clusters with the classes; the AI Engram paper reads it as "clustering separability
    between forget and retain features" (lower is better after unlearning). Choice: the caller
    passes the forget and retain probes together with their class labels, so a forgotten class
    whose features scatter into the other classes' clusters lowers NMI.

    Raises:
        EmptyProbeSet: no samples.
        ValueError: features and labels of different lengths.
    """
    points = _features(features, "NMI's features")
    classes = np.asarray(labels).ravel()
    if classes.shape[0] != points.shape[0]:
        raise ValueError(f"NMI: {points.shape[0]} feature rows but {classes.shape[0]} labels")
    clusters = kmeans(points, int(np.unique(classes).shape[0]), seed=seed)
    return normalized_mutual_info(clusters, classes)
