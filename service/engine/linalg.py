"""Spectral pseudo-inverse of symmetric PSD covariances, packed symmetric storage, Gram sums."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

# The cut is a regularisation strength, not a noise floor, so it is pinned to float32's epsilon
# whatever dtype the solve runs in: ai-engram reproduces the paper's TOFU numbers with
# ``keep λ > D · eps32 · λ_max`` and a float64 eps would keep (and amplify) noise directions.
EPS_FLOAT32 = 1.1920928955078125e-07


def default_rcond(dim: int) -> float:
    """The paper's relative eigenvalue cut for a ``dim``-wide covariance: ``dim · eps32``."""
    return dim * EPS_FLOAT32


@dataclass(frozen=True)
class PinvFactors:
    """``pinv(Σ)`` over the kept directions, in whichever form is cheaper to apply.

    Factored, ``basis · diag(inverse_eigenvalues) · basisᵀ``, when few directions are kept; when
    more than half are (``2k > D``, the usual case for a universe with more tokens than the layer
    is wide), the explicit ``[D, D]`` ``matrix``: one product with it costs ``D²`` per row against
    the factors' ``2·D·k``, in no more memory than twice the basis.
    """

    inverse_eigenvalues: torch.Tensor  # [k] float64
    basis: torch.Tensor | None = None  # [D, k] float64, factored form
    matrix: torch.Tensor | None = None  # [D, D] float64, explicit form

    @property
    def rank(self) -> int:
        return int(self.inverse_eigenvalues.numel())

    @property
    def explicit(self) -> bool:
        return self.matrix is not None

    @property
    def nbytes(self) -> int:
        held = (self.inverse_eigenvalues, self.basis, self.matrix)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def to(self, device: str | torch.device) -> PinvFactors:
        """The same factors on ``device`` (itself when they are there already)."""

        def moved(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device)

        if self.inverse_eigenvalues.device == torch.device(device):
            return self
        return PinvFactors(self.inverse_eigenvalues.to(device), basis=moved(self.basis), matrix=moved(self.matrix))

    def factored_basis(self) -> torch.Tensor:
        """The factored form's ``basis`` ([D, k]).

        Raises:
            ValueError: the factors are the explicit ``[D, D]`` matrix, which keeps no basis (a
                product order of the factored form was chosen for them).
        """
        if self.basis is None:
            raise ValueError(f"these pseudo-inverse factors (rank {self.rank}) are an explicit matrix: they keep no basis")
        return self.basis

    def apply_right(self, matrix: torch.Tensor) -> torch.Tensor:
        """``matrix · pinv(Σ)``, without forming the inverse when it is factored."""
        if self.matrix is not None:
            return matrix @ self.matrix.to(matrix.device, matrix.dtype)
        basis = self.factored_basis().to(matrix.device, matrix.dtype)
        inv = self.inverse_eigenvalues.to(matrix.device, matrix.dtype)
        return ((matrix @ basis) * inv) @ basis.mT


def pinv_factors(sigma: torch.Tensor, rcond: float | None = None, explicit: bool | None = None) -> PinvFactors:
    """Truncated eigen-factors of the pseudo-inverse of a symmetric PSD matrix.

    Args:
        sigma: ``[D, D]`` symmetric positive semi-definite (any float dtype; solved in float64).
        rcond: keep eigenvalues ``λ > rcond · λ_max``; ``None`` uses :func:`default_rcond`.
        explicit: form the ``[D, D]`` matrix (True) or keep the factors (False); ``None`` picks
            the explicit matrix when more than half the directions are kept.

    Returns:
        The kept directions (float64). An all-zero ``sigma`` gives rank 0.
    """
    if sigma.ndim != 2 or sigma.shape[0] != sigma.shape[1]:
        raise ValueError(f"sigma must be square, got shape {tuple(sigma.shape)}")
    cut = _checked_cut(sigma.shape[0], rcond)
    sym = sigma.to(torch.float64)
    sym = (sym + sym.mT) * 0.5  # eigh assumes exact symmetry; accumulation leaves ~1e-16 skew
    eigenvalues, vectors = torch.linalg.eigh(sym)
    keep = _kept(eigenvalues, cut)
    return _factors(vectors[:, keep].contiguous(), eigenvalues[keep], sigma.shape[0], explicit)


def pinv_factors_from_rows(rows: torch.Tensor, rcond: float | None = None, explicit: bool | None = None) -> PinvFactors:
    """:func:`pinv_factors` of ``XᵀX`` from the rows ``X`` (``[T, D]``), never forming a ``D × D`` matrix
    to decompose: ``T²·D`` multiply-adds for ``X·Xᵀ`` and ``T³`` for its ``eigh``, against ``D³``.

    ``XᵀX`` and the Gram matrix ``G = X·Xᵀ`` have the same nonzero eigenvalues, and an eigenvector
    ``u`` of ``G`` (eigenvalue ``λ``) gives ``XᵀX``'s as ``v = Xᵀu / √λ``. The cut is that of
    ``XᵀX``: ``λ > rcond · λ_max`` with ``rcond`` defaulting to ``D · eps32`` (the width, not ``T``),
    so the same directions are kept as :func:`pinv_factors` keeps of the explicit ``XᵀX``. Worth it
    while ``T < D`` (a universe of few tokens on a wide layer); correct for any ``T``.

    Args:
        rows: ``[T, D]`` (any float dtype; float32 activations are exact in float64, where every
            product here runs).
        rcond: as for :func:`pinv_factors`.
        explicit: as for :func:`pinv_factors` (the rule compares the kept rank with ``D``).

    Returns:
        The kept directions of ``pinv(XᵀX)`` (float64). No rows, or all-zero rows, give rank 0.
    """
    if rows.ndim != 2:
        raise ValueError(f"rows must be a [T, D] matrix, got shape {tuple(rows.shape)}")
    dim = rows.shape[1]
    cut = _checked_cut(dim, rcond)
    x = rows.to(torch.float64)
    gram_rows = x @ x.mT  # [T, T]
    gram_rows = (gram_rows + gram_rows.mT) * 0.5
    eigenvalues, vectors = torch.linalg.eigh(gram_rows)
    keep = _kept(eigenvalues, cut)
    kept = eigenvalues[keep]
    basis = (x.mT @ vectors[:, keep]) / kept.sqrt()  # [D, k]: Xᵀu/√λ has unit length
    return _factors(basis.contiguous(), kept, dim, explicit)


def _checked_cut(dim: int, rcond: float | None) -> float:
    cut = default_rcond(dim) if rcond is None else rcond
    if not 0.0 <= cut < 1.0:
        raise ValueError(f"rcond must be in [0, 1), got {cut}")
    return cut


def _kept(eigenvalues: torch.Tensor, cut: float) -> torch.Tensor:
    """Which eigenvalues (ascending, as ``eigh`` gives them) a pseudo-inverse keeps: ``λ > cut · λ_max``."""
    lam_max = eigenvalues[-1].clamp_min(0.0) if eigenvalues.numel() else torch.tensor(0.0, dtype=eigenvalues.dtype)
    return (eigenvalues > cut * lam_max) & (eigenvalues > 0)


def _factors(basis: torch.Tensor, eigenvalues: torch.Tensor, dim: int, explicit: bool | None) -> PinvFactors:
    """The kept directions (``basis`` ``[D, k]``, their eigenvalues) in the form :class:`PinvFactors` holds."""
    inverse = 1.0 / eigenvalues
    if explicit is None:
        explicit = 2 * basis.shape[1] > dim
    if explicit:
        return PinvFactors(inverse, matrix=(basis * inverse) @ basis.mT)
    return PinvFactors(inverse, basis=basis)


@lru_cache(maxsize=16)
def _upper_indices(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices of the upper triangle; a model has few distinct widths, so cached."""
    rows, cols = torch.triu_indices(dim, dim)
    return rows, cols


def pack_symmetric(matrix: torch.Tensor) -> torch.Tensor:
    """The upper triangle (diagonal included), row by row: ``D(D+1)/2`` values instead of ``D²``."""
    rows, cols = _upper_indices(matrix.shape[0])
    return matrix[rows, cols].contiguous()


def packed_dim(length: int) -> int:
    """The ``D`` whose upper triangle has ``length`` values (``D(D+1)/2``)."""
    dim = (math.isqrt(8 * length + 1) - 1) // 2
    if dim * (dim + 1) // 2 != length:
        raise ValueError(f"{length} values are not the upper triangle of a square matrix")
    return dim


def unpack_symmetric(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_symmetric`."""
    if packed.numel() != dim * (dim + 1) // 2:
        raise ValueError(f"packed length {packed.numel()} does not fit a {dim}x{dim} symmetric matrix")
    rows, cols = _upper_indices(dim)
    full = torch.empty((dim, dim), dtype=packed.dtype)
    full[rows, cols] = packed
    full[cols, rows] = packed
    return full


# Rows per product in :func:`gram`: the same float32-product / float64-sum split as collection's
# per-batch products, with a bounded temporary.
GRAM_CHUNK_ROWS = 4096


def gram_block(dim: int) -> int:
    """Column block of :func:`add_upper_gram_`: about an eighth of the width, at least 256 wide
    (narrower GEMMs lose more speed than the skipped blocks save)."""
    return max(256, -(-dim // 8))


def add_upper_gram_(total: torch.Tensor, rows: torch.Tensor, *, overwrite: bool = False) -> None:
    """``total += rowsᵀ·rows`` on the block upper triangle only; blocks below it are left as they are.

    ``Σ`` is symmetric, so one block row at a time, ``X[:, i]ᵀ · X[:, i:]`` covers everything
    :func:`mirror_upper_` needs: with 8 blocks, 56% of the full product's multiply-adds (a GEMM
    cannot skip half itself; BLAS ``syrk`` would, but torch does not expose it). Products are
    float32 GEMMs, sums float64. ``overwrite`` stores instead of adding (a fresh, unzeroed total).
    """
    x = rows.to(torch.float32)
    dim = x.shape[1]
    block = gram_block(dim)
    for start in range(0, dim, block):
        product = x[:, start : start + block].mT @ x[:, start:]
        target = total[start : start + block, start:]
        if overwrite:
            target.copy_(product)
        else:
            target.add_(product.to(total.dtype))


def mirror_upper_(matrix: torch.Tensor) -> torch.Tensor:
    """Make ``matrix`` symmetric from its block upper triangle (as :func:`add_upper_gram_` fills
    it), in place, block by block: a whole-matrix ``triu`` and transposed add cost more than the
    products they complete. Returns ``matrix``."""
    dim = matrix.shape[0]
    block = gram_block(dim)
    for start in range(0, dim, block):
        end = start + block
        diagonal = matrix[start:end, start:end]
        diagonal.copy_(diagonal.triu() + diagonal.triu(1).mT)  # exact symmetry, whatever the GEMM did
        matrix[end:, start:end].copy_(matrix[start:end, end:].mT)
    return matrix


def gram(rows: torch.Tensor, chunk: int = GRAM_CHUNK_ROWS) -> torch.Tensor:
    """``XᵀX`` of ``rows`` (``[T, D]``) as float64 ``[D, D]``, on ``rows``' device.

    Each chunk's product is a float32 GEMM summed in float64, exactly how collection accumulates
    its batches, so a concept stored as rows reads back as the sum collection would have kept.
    """
    dim = rows.shape[1]
    if rows.shape[0] == 0:
        return torch.zeros((dim, dim), dtype=torch.float64, device=rows.device)
    total = torch.empty((dim, dim), dtype=torch.float64, device=rows.device)
    for start in range(0, rows.shape[0], chunk):
        add_upper_gram_(total, rows[start : start + chunk], overwrite=start == 0)
    return mirror_upper_(total)
