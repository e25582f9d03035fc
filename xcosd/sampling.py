"""Sampling warpers and the small sampling primitives every method shares.

The distribution xcosd preserves is the target's *after* its warpers, so the
warpers are part of the contract: the device applies the same settings to its
draft and the server to the target, both through :func:`warp`. Temperature 0 is
greedy: a point mass on the argmax, ties broken by lowest id.

All functions take and return float32 probability rows; sums and comparisons are
done in float64 so both sides of a session get bit-identical results from the
same float32 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidDistribution

#: Tolerance on a row's sum before it counts as "not normalised".
SUM_TOLERANCE = 1e-3


@dataclass(frozen=True)
class SamplingParams:
    """Warper settings, applied identically on both sides of a session.

    ``top_k=0`` and ``top_p=1.0`` disable those warpers; ``temperature=0`` is greedy.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def identity(self) -> bool:
        return self.temperature == 1.0 and self.top_k == 0 and self.top_p == 1.0

    def label(self) -> str:
        """Short human name: ``greedy``, ``T=1``, ``top-k 50``, ``top-p 0.95`` ..."""
        if self.greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1.0:
            parts.append(f"top-p {self.top_p:g}")
        return " ".join(parts)


def check_distribution(p: np.ndarray, *, what: str = "distribution", size: int | None = None) -> None:
    """Raise :class:`InvalidDistribution` unless every row of ``p`` is a finite,
    non-negative vector summing to 1 (within :data:`SUM_TOLERANCE`).

    A wrong sample from a silently broken vector is the one failure a lossless
    method must never have, so the check is strict and says what was wrong.
    """
    a = np.asarray(p)
    if a.ndim == 0:
        raise InvalidDistribution(f"{what}: expected a vector, got a scalar")
    if size is not None and a.shape[-1] != size:
        raise InvalidDistribution(f"{what}: length {a.shape[-1]}, expected {size}")
    if a.shape[-1] == 0:
        raise InvalidDistribution(f"{what}: empty vector")
    if not np.all(np.isfinite(a)):
        raise InvalidDistribution(f"{what}: contains NaN or infinity")
    if np.any(a < 0):
        raise InvalidDistribution(f"{what}: contains negative values")
    s = a.sum(axis=-1, dtype=np.float64)
    if np.any(np.abs(s - 1.0) > SUM_TOLERANCE):
        bad = float(np.atleast_1d(s)[np.argmax(np.abs(np.atleast_1d(s) - 1.0))])
        raise InvalidDistribution(f"{what}: sums to {bad:.6g}, expected 1")


def warp(probs: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Apply temperature, top-k and top-p to probability rows (last axis).

    Returns float32 rows that sum to 1. Temperature is applied in log space
    (``softmax(log p / T)``), so tiny probabilities do not underflow first.
    """
    if params.identity:
        return np.asarray(probs, dtype=np.float32)
    p = np.asarray(probs, dtype=np.float64)
    single = p.ndim == 1
    p = np.atleast_2d(p)
    if params.greedy:
        out = np.zeros_like(p, dtype=np.float32)
        out[np.arange(p.shape[0]), np.argmax(p, axis=-1)] = 1.0
        return out[0] if single else out
    if params.temperature != 1.0:
        with np.errstate(divide="ignore"):
            logp = np.log(p) / params.temperature
        logp -= logp.max(axis=-1, keepdims=True)
        p = np.exp(logp)
        p /= p.sum(axis=-1, keepdims=True)
    if params.top_k and params.top_k < p.shape[-1]:
        p = _keep_top_k(p, params.top_k)
    if params.top_p < 1.0:
        p = _keep_top_p(p, params.top_p)
    p /= p.sum(axis=-1, keepdims=True)
    out32 = p.astype(np.float32)
    return out32[0] if single else out32


def _descending_order(p: np.ndarray) -> np.ndarray:
    """Indices sorting each row by probability descending, ties by lowest id."""
    return np.argsort(-p, axis=-1, kind="stable")


def _top_order(row: np.ndarray, m: int) -> np.ndarray:
    """The ids of the ``m`` largest entries of ``row``, ordered as
    :func:`_descending_order` orders them (descending, ties by lowest id).

    A partition finds the ``m``-th largest value in linear time; only the entries
    at or above it (all of its ties included, so the tie rule is exact) are sorted.
    """
    n = row.shape[0]
    if m >= n:
        return np.argsort(-row, kind="stable")
    threshold = np.partition(row, n - m)[n - m]
    cand = np.flatnonzero(row >= threshold)  # ascending ids
    return cand[np.argsort(-row[cand], kind="stable")][:m]


def _keep_top_k(p: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(p)
    for r in range(p.shape[0]):
        keep = _top_order(p[r], k)
        out[r, keep] = p[r, keep]
    return out


def _keep_top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest prefix (descending order) whose mass reaches ``top_p``.

    Looks at the largest 256 entries first and widens only when they do not hold
    ``top_p`` of the mass, so a peaked row never pays for a full sort.
    """
    out = np.zeros_like(p)
    n = p.shape[-1]
    for r in range(p.shape[0]):
        row = p[r]
        total = row.sum()
        m = min(n, 256)
        while True:
            order = _top_order(row, m)
            sorted_p = row[order]
            before = np.cumsum(sorted_p) - sorted_p  # mass strictly before each token
            drop = before >= top_p * total
            if drop.any() or m >= n:
                break
            m = min(n, 4 * m)
        drop[0] = False
        keep = order[~drop]
        out[r, keep] = row[keep]
    return out


def sample_index(weights: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index with probability proportional to non-negative ``weights``.

    Inverse-CDF on a float64 cumulative sum: one uniform per draw, so the number of
    random numbers consumed never depends on the vector (reproducible across sides).
    """
    c = np.asarray(weights).cumsum(dtype=np.float64)
    total = c[-1]
    if not total > 0:
        raise InvalidDistribution("cannot sample from a vector with no mass")
    u = rng.random() * total
    i = int(c.searchsorted(u, side="right"))
    # guard against u landing on the very end through rounding, or on a zero weight
    i = min(i, c.shape[0] - 1)
    while weights[i] <= 0:
        i -= 1
    return i


def sample_many(weights: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``n`` i.i.d. indices proportional to ``weights`` (inverse CDF)."""
    c = np.cumsum(weights, dtype=np.float64)
    total = c[-1]
    if not total > 0:
        raise InvalidDistribution("cannot sample from a vector with no mass")
    u = rng.random(n) * total
    idx = np.minimum(np.searchsorted(c, u, side="right"), c.shape[0] - 1)
    # a draw can only land on a zero weight through rounding at a boundary: step back
    w = np.asarray(weights)
    bad = w[idx] <= 0
    while np.any(bad):
        idx[bad] -= 1
        bad = w[idx] <= 0
    return idx.astype(np.int64)
