"""``pinv_factors_from_rows`` (``pinv(XᵀX)`` from ``X·Xᵀ``, cost ``T²·D``) against ``pinv_factors`` of
the explicit ``XᵀX`` (cost ``D³``), both float64.

Tolerance: 1e-9 relative (Frobenius) on ``Σ⁺``. Both sides are float64 solves of the same matrix;
each loses about ``eps64 · κ`` on the kept spectrum, and the spectra kept here span at most
``κ = 1e4`` (the default cut keeps ``λ > D · 1.2e-7 · λ_max``): measured 5e-13 to 7e-12.
"""

from __future__ import annotations

import pytest
import torch

from service.engine.linalg import PinvFactors, default_rcond, pinv_factors, pinv_factors_from_rows

PINV_TOL = 1e-9


def rows_with_spectrum(singular_values: list[float], dim: int, seed: int) -> torch.Tensor:
    """``X = U·diag(s)·Vᵀ`` (``[T, D]``, float64) with the given singular values: ``XᵀX`` has
    eigenvalues ``s²`` on random orthonormal directions."""
    generator = torch.Generator().manual_seed(seed)
    count = len(singular_values)
    u, _ = torch.linalg.qr(torch.randn(count, count, dtype=torch.float64, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(dim, count, dtype=torch.float64, generator=generator))
    return (u * torch.tensor(singular_values, dtype=torch.float64)) @ v.mT


def dense(factors: PinvFactors, dim: int) -> torch.Tensor:
    return factors.apply_right(torch.eye(dim, dtype=torch.float64))


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize(
    ("tokens", "dim", "explicit"),
    [(5, 64, False), (40, 64, True), (63, 64, True), (20, 257, False)],
)
def test_rows_give_the_pseudo_inverse_of_the_explicit_covariance(tokens: int, dim: int, explicit: bool) -> None:
    # Singular values from 10 down to 0.1: eigenvalues over 1e-4 relative, all above the cut (D·1.2e-7 ≤ 3.1e-5).
    x = rows_with_spectrum(torch.logspace(1, -1, tokens).tolist(), dim, seed=tokens)
    reference = pinv_factors(x.mT @ x)
    ours = pinv_factors_from_rows(x)
    assert ours.rank == reference.rank == tokens
    assert ours.explicit == reference.explicit == explicit
    error = rel(dense(ours, dim), dense(reference, dim))
    assert error < PINV_TOL, error
    assert torch.allclose(ours.inverse_eigenvalues.sort().values, reference.inverse_eigenvalues.sort().values, rtol=1e-9)


def test_directions_below_the_cut_are_dropped_as_the_explicit_solve_drops_them() -> None:
    """Three directions far under ``D·eps32·λ_max`` (and rows repeated: ``XXᵀ`` singular): both keep the same 12."""
    dim = 96
    kept = torch.logspace(0, -1.5, 12).tolist()
    x = rows_with_spectrum([*kept, 1e-6, 1e-7, 1e-8], dim, seed=3)
    x = torch.cat([x, x[:4]])  # repeated rows: the Gram matrix has exact zero eigenvalues too
    assert 1e-12 < default_rcond(dim) * 1.0 < kept[-1] ** 2 / 4
    reference = pinv_factors(x.mT @ x)
    ours = pinv_factors_from_rows(x)
    assert ours.rank == reference.rank
    assert rel(dense(ours, dim), dense(reference, dim)) < PINV_TOL


def test_an_explicit_rcond_cuts_the_same_directions() -> None:
    dim = 80
    x = rows_with_spectrum([3.0, 2.0, 1.0, 0.5, 0.05, 0.01], dim, seed=7)
    for rcond in (1e-5, 1e-3, 0.1):
        reference, ours = pinv_factors(x.mT @ x, rcond), pinv_factors_from_rows(x, rcond)
        assert ours.rank == reference.rank, rcond
        assert rel(dense(ours, dim), dense(reference, dim)) < PINV_TOL, rcond
    assert pinv_factors_from_rows(x, 0.1).rank == 3  # λ = s²: 9, 4, 1 kept, 0.25 < 0.9 cut
    # No cut at all: the explicit D x D solve keeps its null space's rounding noise (~1e-16·λ_max
    # "eigenvalues"), the rows have no null space to keep: exactly the T true directions.
    assert pinv_factors_from_rows(x, 0.0).rank == 6 < pinv_factors(x.mT @ x, 0.0).rank


def test_float32_rows_are_solved_in_float64() -> None:
    dim = 48
    x32 = rows_with_spectrum(torch.logspace(0.5, -1, 16).tolist(), dim, seed=11).to(torch.float32)
    x64 = x32.to(torch.float64)  # the same values: float32 activations are exact in float64
    ours = pinv_factors_from_rows(x32)
    assert ours.inverse_eigenvalues.dtype == torch.float64 and ours.basis is not None
    assert ours.basis.dtype == torch.float64
    assert rel(dense(ours, dim), dense(pinv_factors(x64.mT @ x64), dim)) < PINV_TOL


def test_no_rows_or_zero_rows_give_rank_zero() -> None:
    for rows in (torch.zeros(0, 16, dtype=torch.float64), torch.zeros(3, 16, dtype=torch.float64)):
        factors = pinv_factors_from_rows(rows)
        assert factors.rank == 0 and not factors.explicit
        assert factors.basis is not None and tuple(factors.basis.shape) == (16, 0)
        assert torch.equal(dense(factors, 16), torch.zeros(16, 16, dtype=torch.float64))


@pytest.mark.parametrize(("rows", "rcond"), [(torch.zeros(4), None), (torch.zeros(2, 3, 4), None), (torch.ones(2, 8), 1.0)])
def test_bad_input_is_refused_by_what_is_wrong(rows: torch.Tensor, rcond: float | None) -> None:
    with pytest.raises(ValueError, match="rows must be|rcond must be"):
        pinv_factors_from_rows(rows, rcond)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("from_rows", [False, True])
def test_a_gpu_decomposes_like_the_cpu(from_rows: bool) -> None:
    """The universe's float64 eigh on a GPU (what ``decompose_group`` runs where ENGRAM_DEVICE finds
    one) keeps the same directions as the CPU, to 1e-10 of the pseudo-inverse."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(300, 96, generator=gen, dtype=torch.float64)
    if from_rows:
        cpu, gpu = pinv_factors_from_rows(rows), pinv_factors_from_rows(rows.to("cuda")).to("cpu")
    else:
        sigma = rows.mT @ rows
        cpu, gpu = pinv_factors(sigma), pinv_factors(sigma.to("cuda")).to("cpu")
    assert gpu.rank == cpu.rank
    eye = torch.eye(96, dtype=torch.float64)
    expected, got = cpu.apply_right(eye), gpu.apply_right(eye)
    assert float((got - expected).norm() / expected.norm()) < 1e-10


def test_factors_move_between_devices_unchanged() -> None:
    factors = pinv_factors(torch.diag(torch.tensor([4.0, 2.0, 0.0], dtype=torch.float64)), explicit=False)
    assert factors.to("cpu") is factors
    assert factors.basis is not None
    moved = factors.to("meta")
    assert moved.basis is not None and moved.basis.device.type == "meta" and moved.rank == factors.rank
