"""Classifier metrics (service.evaluation.classifier_metrics) against independent computations.

References are written here from the published definitions by other code paths: per-sample Python
loops for accuracy, NLL (``math.log`` of a summed ``math.exp``) and the confusion row; the HSIC
form of linear CKA with explicit centring-matrix loops (Kornblith et al. 2019, eq. 3);
scikit-learn's ``normalized_mutual_info_score`` and ``KMeans`` for NMI; an explicit projector
``P = U_k U_kᵀ`` from ``numpy.linalg.eigh`` of ``Z_rᵀZ_r`` for DA. Tolerance 1e-9 (float64).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.evaluation import classifier_metrics as cm

TOL = 1e-9


@pytest.fixture
def probes() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(40, 5)) * 3.0
    labels = rng.integers(0, 5, size=40)
    labels[:6] = 0  # class 0 is certainly present
    return logits, labels


def test_accuracy_and_nll_equal_a_loop(probes: tuple[np.ndarray, np.ndarray]) -> None:
    logits, labels = probes
    hits, nll = 0, 0.0
    for row, label in zip(logits.tolist(), labels.tolist(), strict=True):
        hits += int(max(range(len(row)), key=lambda c: (row[c], -c)) == label)
        nll += math.log(sum(math.exp(v) for v in row)) - row[label]
    assert cm.top1_accuracy(logits, labels) == pytest.approx(hits / len(labels), abs=TOL)
    assert cm.mean_label_nll(logits, labels) == pytest.approx(nll / len(labels), abs=TOL)


def test_nll_is_stable_for_large_logits() -> None:
    logits = np.array([[1000.0, 0.0], [0.0, 1000.0]])
    assert cm.mean_label_nll(logits, [0, 0]) == pytest.approx(500.0, abs=TOL)


def test_confusion_row_counts_where_a_class_goes(probes: tuple[np.ndarray, np.ndarray]) -> None:
    logits, labels = probes
    counts = [0] * 5
    for row, label in zip(logits.tolist(), labels.tolist(), strict=True):
        if label == 0:
            counts[row.index(max(row))] += 1
    row = cm.confusion_row(logits, labels, 0)
    assert row == pytest.approx([c / sum(counts) for c in counts], abs=TOL)
    assert row[0] == pytest.approx(cm.top1_accuracy(logits[labels == 0], labels[labels == 0]), abs=TOL)


def test_a_class_absent_from_the_set_has_no_confusion_row(probes: tuple[np.ndarray, np.ndarray]) -> None:
    logits, labels = probes
    labels = np.where(labels == 3, 2, labels)
    with pytest.raises(cm.EmptyProbeSet, match="class 3"):
        cm.confusion_row(logits, labels, 3, what="forget")


def test_an_empty_set_is_refused_by_name() -> None:
    with pytest.raises(cm.EmptyProbeSet, match="retain: the probe set is empty"):
        cm.top1_accuracy(np.zeros((0, 3)), np.zeros(0), what="retain")
    with pytest.raises(cm.EmptyProbeSet):
        cm.mean_label_nll(np.zeros((0, 3)), np.zeros(0))


def test_a_label_outside_the_classes_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        cm.top1_accuracy(np.zeros((2, 3)), [0, 3])


def test_tug_of_war_is_the_product_of_the_three_gaps() -> None:
    unlearned = cm.SetAccuracies(forget=0.05, retain=0.93, test=0.81)
    retrained = cm.SetAccuracies(forget=0.0, retain=0.97, test=0.84)
    expected = (1 - 0.05) * (1 - 0.04) * (1 - 0.03)
    assert cm.tug_of_war(unlearned, retrained) == pytest.approx(expected, abs=TOL)
    assert cm.tug_of_war(retrained, retrained) == 1.0


def test_tug_of_war_refuses_percentages() -> None:
    with pytest.raises(ValueError, match="retrained model's test accuracy is 84"):
        cm.tug_of_war(cm.SetAccuracies(0.0, 1.0, 0.8), cm.SetAccuracies(0.0, 1.0, 84.0))


def _cka_by_hsic(x: np.ndarray, y: np.ndarray) -> float:
    """Kornblith et al. 2019: HSIC(K, L) = tr(K H L H) / (n − 1)², K = XXᵀ, L = YYᵀ, H = I − 11ᵀ/n."""
    n = x.shape[0]
    gram_x = [[sum(x[i, k] * x[j, k] for k in range(x.shape[1])) for j in range(n)] for i in range(n)]
    gram_y = [[sum(y[i, k] * y[j, k] for k in range(y.shape[1])) for j in range(n)] for i in range(n)]

    def centred(gram: list[list[float]]) -> list[list[float]]:
        rows = [sum(r) / n for r in gram]
        total = sum(rows) / n
        return [[gram[i][j] - rows[i] - rows[j] + total for j in range(n)] for i in range(n)]

    def hsic(a: list[list[float]], b: list[list[float]]) -> float:
        return sum(a[i][j] * b[j][i] for i in range(n) for j in range(n)) / (n - 1) ** 2

    k, l_ = centred(gram_x), centred(gram_y)
    return hsic(k, l_) / math.sqrt(hsic(k, k) * hsic(l_, l_))


def test_linear_cka_equals_the_hsic_form() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(12, 5)) + 2.0
    y = x @ rng.normal(size=(5, 7)) + 0.5 * rng.normal(size=(12, 7))
    assert cm.linear_cka(x, y) == pytest.approx(_cka_by_hsic(x, y), abs=TOL)


def test_linear_cka_invariances() -> None:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(30, 6))
    rotation, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    assert cm.linear_cka(x, 3.0 * x @ rotation + 1.0) == pytest.approx(1.0, abs=TOL)
    with pytest.raises(ValueError, match="same for every example"):
        cm.linear_cka(x, np.ones((30, 2)))
    with pytest.raises(ValueError, match="30 and 29 rows"):
        cm.linear_cka(x, x[:29])


def _da_by_projector(forget: np.ndarray, retain: np.ndarray, energy: float) -> float:
    values, vectors = np.linalg.eigh(retain.T @ retain)
    order = np.argsort(values)[::-1]
    values, vectors = values[order], vectors[:, order]
    k = 1
    while values[:k].sum() / values.sum() < energy - 1e-12:
        k += 1
    projector = vectors[:, :k] @ vectors[:, :k].T
    return float(sum(f @ projector @ f for f in forget) / sum(f @ f for f in forget))


@pytest.mark.parametrize("energy", [0.5, 0.9, 0.99, 1.0])
def test_dimensional_alignment_equals_a_projector(energy: float) -> None:
    rng = np.random.default_rng(5)
    retain = rng.normal(size=(50, 8)) * np.array([5, 4, 3, 2, 1, 0.5, 0.1, 0.01])
    forget = rng.normal(size=(9, 8))
    assert cm.dimensional_alignment(forget, retain, energy) == pytest.approx(
        _da_by_projector(forget, retain, energy), abs=TOL
    )


def test_dimensional_alignment_bounds() -> None:
    retain = np.zeros((10, 4))
    retain[:, :2] = np.random.default_rng(6).normal(size=(10, 2))
    inside = np.zeros((3, 4))
    inside[:, :2] = 1.0
    outside = np.zeros((3, 4))
    outside[:, 2:] = 1.0
    assert cm.dimensional_alignment(inside, retain, 1.0) == pytest.approx(1.0, abs=TOL)
    assert cm.dimensional_alignment(outside, retain, 1.0) == pytest.approx(0.0, abs=TOL)
    with pytest.raises(cm.EmptyProbeSet, match="forget"):
        cm.dimensional_alignment(np.zeros((0, 4)), retain)


def test_nmi_equals_scikit_learn() -> None:
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(8)
    for _ in range(20):
        a = rng.integers(0, 4, size=60)
        b = np.where(rng.random(60) < 0.6, a, rng.integers(0, 6, size=60))
        assert cm.normalized_mutual_info(a, b) == pytest.approx(metrics.normalized_mutual_info_score(a, b), abs=TOL)
    # a class absent in one labeling, and the degenerate single-cluster case
    assert cm.normalized_mutual_info([1, 1, 1], [0, 0, 0]) == metrics.normalized_mutual_info_score([1, 1, 1], [0, 0, 0])
    assert cm.normalized_mutual_info([1, 1, 1], [0, 1, 2]) == pytest.approx(
        metrics.normalized_mutual_info_score([1, 1, 1], [0, 1, 2]), abs=TOL
    )


def test_feature_nmi_matches_scikit_learn_kmeans_on_separated_blobs() -> None:
    cluster = pytest.importorskip("sklearn.cluster")
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(9)
    centres = rng.normal(size=(4, 6)) * 10.0
    labels = np.repeat(np.arange(4), 15)
    points = centres[labels] + rng.normal(size=(60, 6))
    theirs = cluster.KMeans(n_clusters=4, n_init=10, random_state=0).fit_predict(points)
    mine = cm.kmeans(points, 4, seed=0)
    assert cm.normalized_mutual_info(mine, theirs) == pytest.approx(1.0, abs=TOL)
    labels_noisy = labels.copy()
    labels_noisy[:5] = 3  # five class-0 samples mislabelled: NMI below 1, as scikit-learn computes it
    assert cm.feature_nmi(points, labels_noisy) == pytest.approx(
        metrics.normalized_mutual_info_score(labels_noisy, theirs), abs=TOL
    )
