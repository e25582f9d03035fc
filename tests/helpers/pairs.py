"""Adversarial (target, draft) pairs for the exactness tests.

V_C is scattered over the target ids (never a sorted prefix), so an id-mapping
mistake cannot hide behind a lucky layout.
"""

from __future__ import annotations

import numpy as np


def scatter_mask(size: int, n_common: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mask = np.zeros(size, dtype=bool)
    mask[rng.choice(size, n_common, replace=False)] = True
    return mask


def _row(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    return (v / v.sum()).astype(np.float32)


def vo_heavy(d: int = 1, size: int = 16, n_common: int = 8, seed: int = 0):
    """Most of the residual lies in V_O: the target puts 85 % of its mass on
    target-only tokens while the draft (confined to V_C) over-proposes a few."""
    rng = np.random.default_rng(seed)
    common = scatter_mask(size, n_common, seed)
    rows, drafts = [], []
    for _ in range(d + 1):
        p = np.zeros(size)
        p[common] = 0.15 * rng.dirichlet(np.ones(n_common))
        p[~common] = 0.85 * rng.dirichlet(np.ones(size - n_common))
        rows.append(_row(p))
    for _ in range(d):
        q = np.zeros(size)
        q[common] = rng.dirichlet(0.3 * np.ones(n_common))
        drafts.append(_row(q))
    return np.stack(rows), np.stack(drafts), common


def z_small(size: int = 16, n_common: int = 10, seed: int = 1):
    """``Z`` close to 0: target and draft almost agree on V_C, a sliver on V_O."""
    rng = np.random.default_rng(seed)
    common = scatter_mask(size, n_common, seed)
    q = np.zeros(size)
    q[common] = rng.dirichlet(np.ones(n_common))
    p = q * (1 + 0.01 * rng.standard_normal(size))
    p[~common] = 1e-4
    p = np.clip(p, 0, None)
    return _row(p), _row(q), common


def random_pair(d: int, size: int = 20, n_common: int = 12, seed: int = 2):
    """Generic rows: Dirichlet targets over all ids, Dirichlet drafts over V_C."""
    rng = np.random.default_rng(seed)
    common = scatter_mask(size, n_common, seed)
    target = np.stack([_row(rng.dirichlet(0.7 * np.ones(size))) for _ in range(d + 1)])
    drafts = []
    for _ in range(d):
        q = np.zeros(size)
        q[common] = rng.dirichlet(0.7 * np.ones(n_common))
        drafts.append(_row(q))
    return target, np.stack(drafts), common


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p.astype(np.float64) - q, 0)
    return r / r.sum()
