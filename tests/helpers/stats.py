"""Goodness-of-fit helpers for the exactness tests.

A lossless method's emitted token must follow a known distribution. We compare
empirical counts with it two ways: Pearson's chi-square (p-value above a fixed
threshold; cells with tiny expectation are pooled so the test stays valid) and
total variation (within a few 1/sqrt(N)). Seeds are fixed, so every test is
deterministic; the lossy baselines must fail the very same check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import special

#: ~100 chi-square checks run in the suite: at 1e-4 a correct method trips one of
#: them with probability ~1 %, while every lossy baseline scores p < 1e-30.
ALPHA = 1e-4
TV_FACTOR = 3.0


@dataclass
class Fit:
    pvalue: float
    tv: float
    n: int
    tv_bound: float

    @property
    def ok(self) -> bool:
        return self.pvalue > ALPHA and self.tv < self.tv_bound

    def __str__(self) -> str:
        return f"chi2 p={self.pvalue:.3g} TV={self.tv:.4f} (bound {self.tv_bound:.4f}, N={self.n})"


def fit(counts: np.ndarray, expected: np.ndarray) -> Fit:
    counts = np.asarray(counts, dtype=np.float64)
    p = np.asarray(expected, dtype=np.float64)
    p = p / p.sum()
    n = int(counts.sum())
    tv = 0.5 * float(np.abs(counts / n - p).sum())
    bound = TV_FACTOR / np.sqrt(n)
    if np.any(counts[p == 0] > 0):
        return Fit(0.0, tv, n, bound)
    exp = p * n
    keep = exp >= 5
    obs_cells = counts[keep]
    exp_cells = exp[keep]
    if (~keep).any() and exp[~keep].sum() > 0:
        obs_cells = np.append(obs_cells, counts[~keep].sum())
        exp_cells = np.append(exp_cells, exp[~keep].sum())
    if obs_cells.shape[0] < 2:
        return Fit(1.0 if np.allclose(obs_cells, exp_cells) else 0.0, tv, n, bound)
    return Fit(pearson_pvalue(obs_cells, exp_cells), tv, n, bound)


def pearson_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square p-value (``len - 1`` degrees of freedom): what
    ``scipy.stats.chisquare`` computes, without its per-call overhead (the power
    tests run it thousands of times)."""
    stat = float(np.sum((observed - expected) ** 2 / expected))
    return float(special.chdtrc(observed.shape[0] - 1, stat))


def histogram(tokens: list[int] | np.ndarray, size: int) -> np.ndarray:
    return np.bincount(np.asarray(tokens, dtype=np.int64), minlength=size)


def assert_exact(tokens: list[int] | np.ndarray, expected: np.ndarray, label: str = "") -> Fit:
    f = fit(histogram(tokens, expected.shape[0]), expected)
    assert f.ok, f"{label}: not distributed as expected: {f}"
    return f


def assert_not_exact(tokens: list[int] | np.ndarray, expected: np.ndarray, label: str = "") -> Fit:
    f = fit(histogram(tokens, expected.shape[0]), expected)
    assert not f.ok, f"{label}: a lossy method passed the exactness test: {f}"
    return f
