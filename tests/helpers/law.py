"""Exact laws of whole generations, and the checks that compare generated text with them.

The multi-draft law tests generate ``n`` tokens per generation with drafts of length
>= 4, so a rejection can happen at every draft position, and compare the empirical
law of the generated sequences with the exact one. For a bigram target (its next row
depends only on the last token) the exact law of ``n`` tokens is a product of rows,
computed here in closed form; a lossy codec's law is the same product over the
*committed* rows, built from the codec's own quantiser and the commit rule as the
spec states it (not from the method code under test).

What a check looks at (:func:`check_law`), each a chi-square goodness-of-fit test
with cells of expectation < 5 pooled:

- the marginal of every position (a wrong row at one step shows there and later);
- the joint of every pair of consecutive positions (a wrong *conditional* row shows
  here even when it leaves the marginals alone);
- the joint of all ``n`` positions, pooled (higher-order dependence).

A run passes when every p-value exceeds ``ALPHA / checks`` (Bonferroni within the
run, so a correct method fails a run with probability below ``ALPHA``) and every
marginal's TV is below ``5 / sqrt(N)``. :data:`BUILT_TO_CATCH` is the deviation the
checks are built to catch, and ``tests/test_law_power.py`` measures that they do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xcosd.codecs import get_codec
from xcosd.methods import METHODS, Space

from .stats import ALPHA, Fit, fit

#: The deviation the checks are built to catch at N = 20,000: the joint law of a
#: generation moved by TV 0.02 at one step (every row used at that step off by TV
#: 0.02, towards the draft or towards the uniform row), as a wrong row, a wrong q at
#: one draft position or a wrong commit at one step does.
BUILT_TO_CATCH = 0.02

Row = Callable[[np.ndarray], np.ndarray]


def _normalise(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / v.sum()


def committed_row(method: str, codec: str, p: np.ndarray, space: Space) -> np.ndarray:
    """The row a lossy codec makes the output follow, from the spec's commit rule.

    Codecs that are exact, and methods whose codec compresses the draft's ``q``
    (``sd-uplink``) or nothing (``ar``), leave the target row as it is. A vector sent
    whole (``straightforward``) is the codec's quantised row renormalised. Hybrid
    methods (``xcosd``, ``xcosd-e``) send ``p`` on V_C plus the float32 mass
    ``theta_o`` on V_O: V_C keeps the quantised values, V_O keeps ``p``'s shape with
    mass ``theta_o``, and the whole is renormalised.
    """
    c = get_codec(codec)
    p32 = np.asarray(p, dtype=np.float32)
    if c.exact or METHODS[method].codec_applies_to != "p":
        return _normalise(p32)
    if method == "straightforward":
        return _normalise(c.commit(p32))
    out = np.zeros(p32.shape[0], dtype=np.float64)
    out[space.common_ids] = c.commit(p32[space.common_ids])
    out[space.other_ids] = p32[space.other_ids]  # theta_o crosses as the float32 sum
    return _normalise(out)


def support_law(target: Any, params: Any, n: int) -> np.ndarray:
    """The exact law of ``n`` tokens of a Markov target over its ``support`` (in
    support order; ``start_row`` and ``rows`` over the support, as the real-vocabulary
    pairs of ``tests/session_pairs.py`` have them), each row warped by ``params``."""
    from xcosd.sampling import warp

    size = target.vocab.size

    def row(v: np.ndarray) -> np.ndarray:
        full = np.zeros(size, dtype=np.float32)
        full[target.support] = v
        return np.asarray(warp(full, params), dtype=np.float64)[target.support]

    return markov_law(row(target.start_row), np.stack([row(r) for r in target.rows]), n)


def markov_law(start_row: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """The exact joint law (shape ``(V,) * n``) of ``n`` tokens from a chain whose
    first token follows ``start_row`` and whose next token after ``a`` follows
    ``rows[a]``."""
    joint = np.asarray(start_row, dtype=np.float64)
    for _ in range(n - 1):
        joint = joint[..., :, None] * rows
    return joint


def bigram_law(table: np.ndarray, prompt_ids: list[int], n: int, row: Row) -> np.ndarray:
    """The exact law of ``n`` generated tokens of a bigram ``table`` model after
    ``prompt_ids``; ``row`` maps a raw table row to the row the output follows
    (warp, then commit)."""
    size = table.shape[1]
    start = table[prompt_ids[-1] if prompt_ids else size]
    rows = np.stack([row(table[a]) for a in range(size)])
    return markov_law(row(start), rows, n)


@dataclass
class LawReport:
    """Every check of one run, and whether the run passes."""

    n: int
    fits: dict[str, Fit] = field(default_factory=dict)
    tv_bound: float = 0.0

    @property
    def threshold(self) -> float:
        return ALPHA / max(1, len(self.fits))

    @property
    def failed(self) -> list[str]:
        bad = [k for k, f in self.fits.items() if f.pvalue <= self.threshold]
        bad += [k for k, f in self.fits.items() if k.startswith("pos") and f.tv >= self.tv_bound]
        return bad

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def worst(self) -> tuple[str, Fit]:
        return min(self.fits.items(), key=lambda kv: kv[1].pvalue)

    def __str__(self) -> str:
        name, f = self.worst
        return (f"N={self.n}, {len(self.fits)} checks at p > {self.threshold:.1e}: worst "
                f"{name}: {f}; failed: {self.failed or 'none'}")


def joint_counts(seqs: np.ndarray, size: int) -> np.ndarray:
    """The histogram of sequences ``seqs`` (shape ``(N, n)``) as an ``(size,) * n``
    array."""
    seqs = np.asarray(seqs, dtype=np.int64)
    flat = np.ravel_multi_index(tuple(seqs.T), (size,) * seqs.shape[1])
    return np.bincount(flat, minlength=size ** seqs.shape[1]).reshape((size,) * seqs.shape[1])


def check_counts(counts: np.ndarray, joint: np.ndarray) -> LawReport:
    """Compare the histogram ``counts`` of generated sequences with the exact
    ``joint`` law (both shaped ``(V,) * n``)."""
    n = joint.ndim
    big_n = int(counts.sum())
    report = LawReport(big_n, tv_bound=5.0 / np.sqrt(big_n))
    axes = tuple(range(n))

    def margin(a: np.ndarray, keep: tuple[int, ...]) -> np.ndarray:
        return a.sum(axis=tuple(x for x in axes if x not in keep)).reshape(-1)

    for t in range(n):
        report.fits[f"pos{t + 1}"] = fit(margin(counts, (t,)), margin(joint, (t,)))
    for t in range(1, n):
        report.fits[f"pair{t}{t + 1}"] = fit(margin(counts, (t - 1, t)),
                                            margin(joint, (t - 1, t)))
    if n > 2:
        report.fits["joint"] = fit(counts.reshape(-1), joint.reshape(-1))
    return report


def check_law(seqs: np.ndarray, joint: np.ndarray) -> LawReport:
    """Compare generations ``seqs`` (shape ``(N, n)``, target ids) with the exact
    ``joint`` law (shape ``(V,) * n``)."""
    return check_counts(joint_counts(seqs, joint.shape[0]), joint)


def sample_counts(joint: np.ndarray, big_n: int, rng: np.random.Generator) -> np.ndarray:
    """The histogram of ``big_n`` sequences drawn straight from ``joint`` (for
    measuring power)."""
    p = joint.reshape(-1) / joint.sum()
    return rng.multinomial(big_n, p).reshape(joint.shape)
