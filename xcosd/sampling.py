"""Sampling warpers and the small sampling primitives every method shares.

The distribution xcosd preserves is the target's *after* its warpers, so the
warpers are part of the contract: the device applies the same settings to its
draft and the server to the target, both through :func:`warp` (or its batched and
sparse forms, which give the same bits). The rules are Hugging Face transformers'
logits processors, in their order (temperature, top-k, top-p), on probability rows:

* **temperature** ``T``: ``softmax(log p / T)`` (``TemperatureLogitsWarper``);
  ``T = 0`` is greedy: a point mass on the argmax, ties broken by lowest id.
* **top-k** keeps every token whose value is at least the k-th largest, so all the
  tokens tied with the k-th stay (``TopKLogitsWarper``: ``scores < topk(...)[-1]``
  are removed). Before this rule xcosd kept exactly k, breaking ties by lowest id.
* **top-p** sorts ascending, with a *stable* sort (ties in id order, as
  ``torch.sort(stable=True)`` and CUDA's sort order them), and drops every token whose
  cumulative mass (itself and everything below it) is ``<= 1 - top_p``; the top token
  always stays (``min_tokens_to_keep=1``). At a tie straddling the cut the lowest ids
  go first. Masses are float64 sums of the float32 row; each normalised cumulative
  mass is rounded to float32 and compared with ``float32(1 - top_p)``, as
  transformers' float32 ``cumulative_probs <= (1 - top_p)`` does, so masses sitting
  exactly on the threshold go the same way. (With the default unstable CPU sort,
  transformers itself drops an arbitrary subset of such a tie.)

No warper sorts a whole row: top-k compares the row against a lower bound on its
k-th value (the k-th largest of >= k group maxima) and finishes on the few
candidates; top-p finds its cut by a band search around a sampled guess (see
:func:`_top_p_band`). A 262,144-id row takes about a millisecond or less
(``python -m xcosd.bench.sampling``).

A row's result depends on that row only, never on the rows warped with it, and every
reduction is a fixed-order numpy loop (no parallel, order-dependent sums), so both
sides of a session, and a row warped alone, in a block or on demand
(:class:`WarpedRows`), get bit-identical kept sets and values. Sums and comparisons
are done in float64 (float32 where the transformers rule is float32); results are
float32 rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .draws import Uniforms
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

    Returns float32 rows that sum to 1, by the rules in the module docstring. A row's
    result is a pure function of that row: warped alone or in a block, on the edge or
    on the cloud, the same row gives the same bits.
    """
    if params.identity:
        return np.asarray(probs, dtype=np.float32)
    a = np.asarray(probs)
    if params.greedy and a.ndim == 1 and a.shape[0]:
        # what the block path gives one row (a point mass on the first maximum),
        # without its block bookkeeping: verification warps a greedy target's rows
        # one at a time, d + 1 of them a round
        out = np.zeros(a.shape[0], dtype=np.float32)
        out[int(a.argmax())] = 1.0
        return out
    block = _as_block(a)
    out = _warp_block(block, params).dense_rows()
    return out[0] if a.ndim == 1 else out.reshape(a.shape)


class WarpedRows:
    """A block of target rows, each warped the first time it is read.

    Verification reads the rows of a block in order and stops at the first
    rejection: with acceptance ``a`` per draft it reads about ``1 + a + ... + a^d``
    of the ``d + 1`` rows, so warping them on demand skips the rest (at a = 0.5 and
    d = 4, three rows in five) and changes no result: a row's warp is a pure
    function of that row (:func:`warp`, bit for bit), and warping draws no random
    numbers. It offers what verification uses of a row block: ``block[i]`` (a
    float32 row), ``block[i, x]`` (one value), ``len``, ``shape``, and
    ``np.asarray(block)`` (every row, warped).
    """

    __slots__ = ("_params", "_rows", "_warped", "shape")

    def __init__(self, rows: np.ndarray, params: SamplingParams) -> None:
        a = np.asarray(rows)
        if a.ndim != 2:
            raise InvalidDistribution(f"expected a block of rows, got shape {a.shape}")
        self._rows = a
        self._params = params
        self._warped: dict[int, np.ndarray] = {}
        self.shape: tuple[int, int] = (int(a.shape[0]), int(a.shape[1]))

    def row(self, i: int) -> np.ndarray:
        """Row ``i``, warped (once)."""
        i = int(i)
        if i < 0:
            i += self.shape[0]
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"row {i} of a block of {self.shape[0]}")
        out = self._warped.get(i)
        if out is None:
            out = self._warped[i] = warp(self._rows[i], self._params)
        return out

    @property
    def warped_rows(self) -> int:
        """How many rows were warped so far."""
        return len(self._warped)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        if isinstance(key, tuple):
            i, x = key
            return self.row(i)[x]
        return self.row(key)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.stack([self.row(i) for i in range(self.shape[0])])
        return out if dtype is None else out.astype(dtype, copy=False)


#: a block of target rows as verification reads it: warped rows, or rows warped on
#: demand
Rows = np.ndarray | WarpedRows


@dataclass(frozen=True, eq=False)
class Kept:
    """One warped row, as :func:`warp_kept` gives it.

    When the warpers keep few tokens, ``ids`` holds them (ascending) and ``probs`` their
    float64 probabilities; otherwise ``ids`` is None and ``probs`` is the whole float32
    warped row. Either way ``warp`` of the same row is ``probs`` as float32, scattered.
    """

    ids: np.ndarray | None
    probs: np.ndarray


def warp_kept(row: np.ndarray, params: SamplingParams) -> Kept:
    """Warp one row, returning a small kept set sparsely.

    The edge only needs the V_C part of its warped draft row; with top-k or a peaked
    top-p row that is a few hundred tokens, so it need not build (and gather from) a
    dense 200k-entry row at every drafted position.
    """
    if params.identity:
        return Kept(None, np.asarray(row, dtype=np.float32))
    a = np.asarray(row)
    if a.ndim != 1:
        raise ValueError("warp_kept takes one row")
    if params.greedy:  # a point mass on the first maximum, as _warp_block keeps it
        if a.shape[0] == 0:
            raise InvalidDistribution("cannot warp an empty vector")
        return Kept(np.array([int(np.argmax(a))], dtype=np.int64), _ONE)
    res = _warp_block(_as_block(a), params)
    if 0 in res.dense:
        return Kept(None, res.dense[0])
    return Kept(res.ids, res.probs)


# ------------------------------------------------------------------- internals

#: groups whose maxima bound the k-th largest value from below (:func:`_top_candidates`)
_MIN_GROUPS = 1024
#: the band search samples about this many entries of the row to guess the threshold
_BAND_SAMPLE = 4096
#: rows up to this long are sorted whole in top-p (a band search costs more there)
WHOLE_ROW_MAX = 4096
#: from this many such rows in a block on, top-p sorts them all at once
#: (:func:`_top_p_short`): one row alone is cheaper through :func:`_top_p_band`
SHORT_ROWS_TOGETHER = 2

_NO_IDS = np.zeros(0, dtype=np.int64)
_NO_PROBS = np.zeros(0, dtype=np.float64)
#: a greedy row's kept probability (read only: shared by every greedy Kept)
_ONE = np.ones(1, dtype=np.float64)
_ONE.flags.writeable = False


@dataclass
class _Warped:
    """A warped block of ``n`` rows over ``size`` ids: the small kept sets sparsely
    (``rows``, ``ids``, float64 ``probs``, sorted by row then id) and the rows whose
    kept set is large as dense float32 rows (``dense``), or every row dense as one
    float32 block (``block``: a block of short rows cut together, handed on as made)."""

    n: int
    size: int
    rows: np.ndarray
    ids: np.ndarray
    probs: np.ndarray
    dense: dict[int, np.ndarray] = field(default_factory=dict)
    block: np.ndarray | None = None

    def dense_rows(self) -> np.ndarray:
        if self.block is not None:
            return self.block
        if self.n == 1 and 0 in self.dense:
            return self.dense[0][None]
        out = np.zeros((self.n, self.size), dtype=np.float32)
        out[self.rows, self.ids] = self.probs.astype(np.float32)
        for r, row in self.dense.items():
            out[r] = row
        return out


def _as_block(a: np.ndarray) -> np.ndarray:
    """The rows as a C-contiguous 2-D block: float64 input stays float64, anything else
    is float32 (models give float32 rows; no float64 copy of a 262k row is made)."""
    if a.ndim == 0 or a.shape[-1] == 0:
        raise InvalidDistribution("cannot warp an empty vector")
    dtype = np.float64 if a.dtype == np.float64 else np.float32
    return np.ascontiguousarray(a.reshape(-1, a.shape[-1]), dtype=dtype)


def _segments(rows: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of each row's run in ``rows`` (sorted ascending)."""
    starts = np.searchsorted(rows, np.arange(n))
    return starts, np.diff(np.append(starts, rows.shape[0]))


def _warp_block(block: np.ndarray, params: SamplingParams) -> _Warped:
    n, size = block.shape
    if params.greedy:
        # np.argmax returns the first maximum: ties broken by lowest id
        return _Warped(n, size, np.arange(n), np.argmax(block, axis=-1), np.ones(n))
    temp = params.temperature
    if params.top_k and params.top_k < size:
        # top-k commutes with the temperature (a monotone map), so it runs first and
        # the temperature only touches the k survivors
        rows, ids, vals = _top_candidates(block, params.top_k)
        w = vals.astype(np.float64)
        if temp != 1.0:
            w = _temper_sparse(w, rows, n, temp)
        if params.top_p < 1.0:
            return _top_p_sparse(n, size, rows, ids, w, params.top_p)
        starts, _ = _segments(rows, n)
        total = np.add.reduceat(w, starts)
        return _Warped(n, size, rows, ids, w / total[rows])
    if temp != 1.0:
        block = _temper_dense(block, temp)
    if params.top_p < 1.0:
        return _top_p_dense(block, params.top_p)
    return _Warped(n, size, _NO_IDS, _NO_IDS, _NO_PROBS,
                   {r: block[r].astype(np.float32) for r in range(n)})


def _top_candidates(block: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every entry at or above its row's ``m``-th largest value, ties included (as
    ``TopKLogitsWarper`` keeps them), as ``(rows, ids, values)`` sorted by row, then id.

    Zeros are never candidates (they carry no mass, so keeping them changes nothing).
    No full sort and no partition of the whole row: the maxima of ``G >= m`` disjoint
    groups are ``G`` distinct entries, so their ``m``-th largest is a lower bound on the
    row's. Only the groups whose maximum reaches it can hold entries that do (a few
    times ``m`` groups, unless ties at the top are everywhere: then the whole row is
    compared); they leave a few hundred candidates, and the exact ``m``-th value is
    found among those.
    """
    n, size = block.shape
    groups = max(4 * m, _MIN_GROUPS)
    per = size // groups
    tiny = np.finfo(block.dtype).smallest_subnormal
    g_rows = g_ids = None
    if per >= 4:
        # strided groups {j, j + G, j + 2G, ...}: a maximum over axis 1 is one SIMD pass
        grid = block[:, : per * groups].reshape(n, per, groups)
        gmax = grid.max(axis=1)
        bound = np.maximum(np.partition(gmax, groups - m, axis=1)[:, groups - m], tiny)
        g_rows, g_ids = np.nonzero(gmax >= bound[:, None])
    else:
        bound = np.maximum(np.partition(block, size - m, axis=1)[:, size - m], tiny)
    if g_rows is not None and g_ids is not None and g_rows.shape[0] * 4 <= n * groups:
        # only groups whose maximum reaches the bound hold candidates (a few times m
        # of them): compare those, not the whole row
        sub = grid[g_rows, :, g_ids]  # (groups hit, per)
        hit_g, hit_p = np.nonzero(sub >= bound[g_rows][:, None])
        rows = g_rows[hit_g]
        ids = hit_p * groups + g_ids[hit_g]
        vals = sub[hit_g, hit_p]
        rest = block[:, per * groups:]  # the < G ids past the last full stride
        if rest.shape[1]:
            t_rows, t_ids = np.nonzero(rest >= bound[:, None])
            rows = np.concatenate((rows, t_rows))
            ids = np.concatenate((ids, t_ids + per * groups))
            vals = np.concatenate((vals, rest[t_rows, t_ids]))
        order = np.lexsort((ids, rows))
        rows, ids, vals = rows[order], ids[order], vals[order]
    else:  # small rows, or ties at the top in most groups: one compare of the rows
        flat = np.flatnonzero(block >= bound[:, None])
        rows, ids = np.divmod(flat, size)
        vals = block.ravel()[flat]
    starts, counts = _segments(rows, n)
    if np.any(counts == 0):
        raise InvalidDistribution("cannot warp a row with no mass")
    order = np.lexsort((-vals, rows))  # per row, largest first
    kth = vals[order[starts + np.minimum(counts, m) - 1]]
    kth[counts < m] = 0  # fewer than m non-zeros: the m-th largest is 0, keep them all
    keep = vals >= kth[rows]
    return rows[keep], ids[keep], vals[keep]


def _temper_sparse(w: np.ndarray, rows: np.ndarray, n: int, temp: float) -> np.ndarray:
    """``p ** (1/T)`` up to a per-row factor, in log space (no underflow before the
    shift): the temperature of the candidates that top-k kept."""
    starts, _ = _segments(rows, n)
    top = np.maximum.reduceat(w, starts)
    with np.errstate(divide="ignore"):
        return np.exp((np.log(w) - np.log(top)[rows]) / temp)


def _temper_dense(block: np.ndarray, temp: float) -> np.ndarray:
    """``softmax(log p / T)`` of whole rows. A float32 row is tempered in float32, as
    transformers divides its float32 logits by the temperature (a float64 log and exp
    of a 262k row cost several times more); only the normalising sum is float64.
    float64 input stays float64."""
    dtype = np.float64 if block.dtype == np.float64 else np.float32
    with np.errstate(divide="ignore"):
        x = np.log(block.astype(dtype, copy=False))
    x /= dtype(temp)
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, dtype=np.float64, keepdims=True).astype(dtype)
    return x


def _top_p_sparse(n: int, size: int, rows: np.ndarray, ids: np.ndarray, w: np.ndarray,
                  top_p: float) -> _Warped:
    """Top-p over the candidate sets top-k left (sorted by row, then id), vectorised
    over rows.

    The rule is ``TopPLogitsWarper``'s with a stable sort: in ascending (value, id)
    order, drop each token whose cumulative mass (itself and everything below) is at or
    below ``1 - top_p`` of the row's mass; the top token always stays. The candidates
    are walked from the top: a token's cumulative mass is ``total - above``, ``above``
    being the float64 mass before it in (value desc, id desc) order.
    """
    order = np.lexsort((-ids, -w, rows))
    r_s, i_s, w_s = rows[order], ids[order], w[order]
    starts, counts = _segments(r_s, n)
    pos = np.arange(r_s.shape[0]) - starts[r_s]
    # one padded row per row, zeros after the candidates: the running sums of the real
    # entries are exactly a per-row running sum, whatever the other rows hold
    pad = np.zeros((n, int(counts.max(initial=0)) + 1))
    pad[r_s, pos + 1] = w_s
    above = np.cumsum(pad, axis=1)  # above[r, i]: mass of row r's first i candidates
    total = above[np.arange(n), counts]
    removed = _at_or_below(total[r_s] - above[r_s, pos], total[r_s], top_p)
    removed[pos == 0] = False  # min_tokens_to_keep=1
    keep = ~removed
    kept_mass = above[np.arange(n), np.bincount(r_s[keep], minlength=n)]
    r_k, i_k = r_s[keep], i_s[keep]
    p_k = w_s[keep] / kept_mass[r_k]
    back = np.lexsort((i_k, r_k))
    return _Warped(n, size, r_k[back], i_k[back], p_k[back])


def _at_or_below(mass: np.ndarray | float, total: np.ndarray | float, top_p: float
                 ) -> np.ndarray:
    """Whether a cumulative mass is dropped by top-p, compared as transformers compares
    it: the normalised cumulative mass rounded to float32 against ``1 - top_p`` rounded
    to float32 (its float32 ``cumulative_probs <= (1 - top_p)``). Masses sitting exactly
    on the threshold (``1/820`` steps against ``top_p=0.9``) then go the same way."""
    return np.asarray(np.asarray(mass / total).astype(np.float32) <= np.float32(1.0 - top_p))


def _top_p_dense(block: np.ndarray, top_p: float) -> _Warped:
    """Top-p of whole rows: float32 rows of up to :data:`WHOLE_ROW_MAX` ids all at once
    (:func:`_top_p_short`), longer ones one :func:`_top_p_band` each (O(V) work a row)."""
    n, size = block.shape
    if n >= SHORT_ROWS_TOGETHER and block.dtype == np.float32 and size <= WHOLE_ROW_MAX:
        return _Warped(n, size, _NO_IDS, _NO_IDS, _NO_PROBS, block=_top_p_short(block, top_p))
    rows, ids, probs = [_NO_IDS], [_NO_IDS], [_NO_PROBS]
    dense: dict[int, np.ndarray] = {}
    for r in range(n):
        kept = _top_p_band(block[r], top_p)
        if isinstance(kept, tuple):
            rows.append(np.full(kept[0].shape[0], r))
            ids.append(kept[0])
            probs.append(kept[1])
        else:
            dense[r] = kept
    return _Warped(n, size, np.concatenate(rows), np.concatenate(ids),
                   np.concatenate(probs), dense)


def _top_p_band(w: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
    """Top-p of one whole row without sorting it.

    A strided sample of the row, sorted, guesses the value where the cut falls (the
    sample's mass below a value, times the stride, estimates the row's: the dropped
    tail is made of many small entries, so the estimate is good there). Only the
    entries between two sample values around the guess (the band, about a thousand)
    are sorted; the mass above the band is one masked sum over the smaller side of the
    row. The rule is :func:`_top_p_sparse`'s (cumulative mass ``total - above``, ties at
    the cut dropped lowest id first). If the cut is not inside the band (a bad guess)
    the band widens until it is, at worst to the whole row.

    Returns ``(ids, float64 probs)`` when few entries are kept, else the float32 row.
    """
    total = float(np.add.reduce(w, dtype=np.float64))  # np.sum's reduction, less its wrapper
    if not total > 0:
        raise InvalidDistribution("cannot warp a row with no mass")
    size = w.shape[0]
    if size <= WHOLE_ROW_MAX:
        # a short row is sorted whole at once (the band of the loop's last resort):
        # cheaper than sampling it to find a band
        return _top_p_whole(w, total, top_p)
    stride = max(1, size // _BAND_SAMPLE)
    sample = np.sort(w[::stride])
    cum = np.cumsum(sample, dtype=np.float64) * stride
    guess = int(np.searchsorted(cum, (1.0 - top_p) * total, side="right"))
    half = 16
    while True:
        lo, hi = guess - half, guess + half
        v_lo = sample[lo] if lo > 0 else None
        v_hi = sample[hi] if hi < sample.shape[0] else None
        if v_lo is not None and v_lo == v_hi:
            tied = _top_p_tie(w, v_lo, total, top_p)
            if tied is not None:
                return tied
        # the mass above the band, and the band's values, with masked passes only: an
        # index list of a big side of the row (np.flatnonzero) costs more than the rest
        idx: np.ndarray | None = None
        few_low = hi * stride  # entries up to v_hi (estimated from the sample)
        few_high = (sample.shape[0] - lo) * stride  # entries from v_lo up
        if v_hi is not None and few_low < size // 2:
            if few_low * 16 < size:  # a sparse mask: compressing it is cheap
                low_vals = w[w <= v_hi]
                above = total - float(np.sum(low_vals, dtype=np.float64))
                vals = low_vals[low_vals >= v_lo] if v_lo is not None else low_vals
            else:
                low = w <= v_hi
                above = total - float(np.sum(w * low, dtype=np.float64))
                vals = w[low & (w >= v_lo)] if v_lo is not None else w[low]
        elif v_lo is not None and few_high * 64 <= size:
            idx = np.flatnonzero(w >= v_lo)  # few entries from v_lo up: keep their ids
            sub = w[idx]
            inband = sub <= v_hi if v_hi is not None else np.ones(sub.shape[0], dtype=bool)
            above = float(np.sum(sub[~inband], dtype=np.float64))
            vals = sub[inband]
        elif v_lo is not None and few_high * 16 < size:
            high_vals = w[w >= v_lo]
            inband = high_vals <= v_hi if v_hi is not None else np.ones(high_vals.shape[0], bool)
            above = float(np.sum(high_vals[~inband], dtype=np.float64))
            vals = high_vals[inband]
        elif v_hi is not None:
            high = w > v_hi
            above = float(np.sum(w * high, dtype=np.float64))
            vals = w[~high & (w >= v_lo)] if v_lo is not None else w[~high]
        else:
            above = 0.0
            vals = w[w >= v_lo] if v_lo is not None else w
        sv = np.sort(vals)[::-1]
        run = np.cumsum(np.concatenate(([above], sv.astype(np.float64))))
        removed = _at_or_below(total - run[:-1], total, top_p)
        if (v_hi is not None and removed[0]) or (v_lo is not None and not removed[-1]):
            half *= 4  # the cut is above or below the band
            continue
        removed[0] = False  # (the row's top token) min_tokens_to_keep=1
        j = int(np.argmax(removed)) if removed[-1] else sv.shape[0]
        last = sv[j - 1]  # the smallest kept value
        # entries equal to `last`: the first (j - f) of them in sv are kept, and a
        # stable ascending sort would drop the lowest ids first
        f = int(np.count_nonzero(sv > last))
        ties = int(np.count_nonzero(sv == last))
        drop_ties = ties - (j - f)
        if idx is not None:
            keep = sub > last
            tie_at = np.flatnonzero(sub == last)
            keep[tie_at[drop_ties:]] = True
            return idx[keep], sub[keep].astype(np.float64) / run[j]
        out = _scaled_from(w, last, 1.0 / float(run[j]))
        if drop_ties:
            out[np.flatnonzero(w == last)[:drop_ties]] = 0.0
        return out


def _top_p_whole(w: np.ndarray, total: float, top_p: float) -> np.ndarray:
    """:func:`_top_p_band` of a short row (``total``: its float64 mass), sorted whole:
    the band search's last resort, the band being the whole row, with the steps
    whose results it knows spared (the top token, which always stays, is not
    compared; the ties past the cut are counted only when there are some). Its
    steps on a block's rows side by side are :func:`_top_p_short`; one row alone
    is cheaper here."""
    sv = np.sort(w)[::-1]
    c = np.add.accumulate(sv.astype(np.float64))  # c[k]: the mass of sv[0 .. k]
    n = sv.shape[0]
    # entry k >= 1 goes when the mass from it down, total - c[k - 1], is at or below
    # 1 - top_p; the first that goes ends the kept ones (the masses only fall)
    removed = _at_or_below(total - c[:-1], total, top_p)
    j = 1 + int(np.argmax(removed)) if n > 1 and removed[-1] else n
    last = sv[j - 1]  # the smallest kept value
    out = _scaled_from(w, last, 1.0 / float(c[j - 1]))
    if j < n and sv[j] == last:
        # entries equal to it past the cut (right after it, sorted) go, the lowest
        # ids first, as a stable ascending sort would drop them
        drop = int(np.count_nonzero(sv[j:] == last))
        out[np.flatnonzero(w == last)[:drop]] = 0.0
    return out


def _top_p_short(block: np.ndarray, top_p: float) -> np.ndarray:
    """:func:`_top_p_whole` of every row of a float32 block of short rows at once, the
    same steps on a block's rows side by side: for each row the float32 row that
    :func:`_top_p_band` gives it alone, bit for bit. A batch of target rows (a
    vocabulary of a few hundred or thousand ids, d + 1 rows a session) is thus cut
    with a few dozen numpy calls instead of a few dozen a row."""
    n, size = block.shape
    # each row's own reduction (the pairwise sum np.sum gives that row)
    total = np.add.reduce(block, axis=1, dtype=np.float64)
    if not np.all(total > 0):
        raise InvalidDistribution("cannot warp a row with no mass")
    sv = np.sort(block, axis=1)[:, ::-1]
    c = np.cumsum(sv, axis=1, dtype=np.float64)  # c[:, k]: the mass of sv[:, 0 .. k]
    r = np.arange(n)
    if size > 1:
        removed = _at_or_below(total[:, None] - c[:, :-1], total[:, None], top_p)
        j = np.where(removed[:, -1], 1 + np.argmax(removed, axis=1), size)
    else:
        j = np.ones(n, dtype=np.int64)
    last = sv[r, j - 1]
    out = block * (1.0 / c[r, j - 1]).astype(np.float32)[:, None]
    out *= block >= last[:, None]
    for i in np.flatnonzero((j < size) & (sv[r, np.minimum(j, size - 1)] == last)):
        drop = int(np.count_nonzero(sv[i, j[i]:] == last[i]))
        out[i, np.flatnonzero(block[i] == last[i])[:drop]] = 0.0
    return out


def _scaled_from(w: np.ndarray, last: np.floating, scale: float) -> np.ndarray:
    """float32 ``w * scale`` where ``w >= last``, 0 elsewhere. On a float32 row the
    product comes first and the mask multiplies it in place (one temporary less
    than masking first; the same bits, as ``x * 1`` is ``x``)."""
    if w.dtype == np.float32:
        out = w * np.float32(scale)
        out *= w >= last
        return out
    out = (w * (w >= last)).astype(np.float32)
    out *= np.float32(scale)
    return out


def _top_p_tie(w: np.ndarray, v: np.floating, total: float, top_p: float
               ) -> np.ndarray | None:
    """Top-p of one row whose cut falls inside the group of entries equal to ``v``
    (a model's floor value, shared by most of a row, makes such groups of 100k+).

    :func:`_top_p_band`'s rule without sorting or summing the group entry by entry:
    the cumulative mass of the group's ``i``-th token from the top is
    ``total - (above + i * v)`` (``i * v`` is exact in float64), which falls with
    ``i``, so the first dropped one is found by bisection. The group's highest ids
    are the ones kept. Returns the float32 row, or None when the cut is not inside
    the group (the caller's band search goes on)."""
    tied = w == v
    c = int(np.count_nonzero(tied))
    if c == 0:
        return None
    above = float(np.sum(w * (w > v), dtype=np.float64))
    vv = float(v)

    def removed(i: int) -> bool:
        return bool(_at_or_below(total - (above + i * vv), total, top_p))

    if removed(0) or not removed(c - 1):
        return None  # the cut is above the group, or below it
    lo, hi = 0, c - 1  # removed(lo) is False, removed(hi) is True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if removed(mid):
            hi = mid
        else:
            lo = mid
    keep_ties = hi  # tokens 0 .. hi - 1 of the group (from the top) stay
    out = _scaled_from(w, v, 1.0 / (above + keep_ties * vv))
    out[np.flatnonzero(tied)[: c - keep_ties]] = 0.0  # the group's lowest ids
    return out


#: rows longer than this are sampled through block sums (:func:`_block_cumulative`)
_SAMPLE_BLOCK = 1024


def _block_cumulative(w: np.ndarray) -> np.ndarray:
    """Running float64 mass at the end of each block of :data:`_SAMPLE_BLOCK` entries.

    A draw then needs a running sum over one block only, instead of a float64 cumsum of
    the whole 128k-262k row (the one O(V) pass left is a SIMD block reduction).
    """
    n = w.shape[0]
    full = n // _SAMPLE_BLOCK
    sums = np.empty(-(-n // _SAMPLE_BLOCK))
    sums[:full] = np.add.reduce(w[: full * _SAMPLE_BLOCK].reshape(full, _SAMPLE_BLOCK),
                                axis=1, dtype=np.float64)
    if full < sums.shape[0]:
        sums[full] = np.sum(w[full * _SAMPLE_BLOCK:], dtype=np.float64)
    return np.cumsum(sums)


def _draw(w: np.ndarray, blocks: np.ndarray | None, c: np.ndarray | None, u: float) -> int:
    """The index where the running mass first exceeds ``u`` (inverse CDF)."""
    if blocks is None:
        assert c is not None
        i = min(int(c.searchsorted(u, side="right")), c.shape[0] - 1)
    else:
        b = min(int(blocks.searchsorted(u, side="right")), blocks.shape[0] - 1)
        lo = b * _SAMPLE_BLOCK
        seg = np.cumsum(w[lo: lo + _SAMPLE_BLOCK], dtype=np.float64)
        if b:
            seg += blocks[b - 1]
        i = lo + min(int(seg.searchsorted(u, side="right")), seg.shape[0] - 1)
    # u can land on the very end through rounding, or on a zero weight: step back
    while i > 0 and w[i] <= 0:
        i -= 1
    return i


def _prepare(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None,
                                           float]:
    w = np.asarray(weights)
    if w.shape[0] > 4 * _SAMPLE_BLOCK:
        blocks = _block_cumulative(w)
        c = None
        total = float(blocks[-1])
    else:
        blocks = None
        # widened first, then accumulated: the same running sums as a cumsum that
        # casts as it goes, in about half its time on a few hundred entries
        c = np.add.accumulate(w.astype(np.float64))
        total = float(c[-1])
    if not total > 0:
        raise InvalidDistribution("cannot sample from a vector with no mass")
    return w, blocks, c, total


def sample_index(weights: np.ndarray, rng: Uniforms) -> int:
    """Draw one index with probability proportional to non-negative ``weights``.

    Inverse-CDF on float64 running sums: one uniform per draw, so the number of random
    numbers consumed never depends on the vector (reproducible across sides).
    """
    w, blocks, c, total = _prepare(weights)
    return _draw(w, blocks, c, rng.random() * total)


def sample_many(weights: np.ndarray, n: int, rng: Uniforms) -> np.ndarray:
    """Draw ``n`` i.i.d. indices proportional to ``weights`` (inverse CDF).

    A long row and few draws (SR-DV's K = 20 candidates per rejection from a
    128k-262k row) go through the block sums (:func:`sample_index`'s path): one
    block reduction of the row, then running sums over the blocks the draws fall in
    only, all draws in one vectorized pass. Otherwise one float64 cumsum of the row
    serves every draw in one vectorized search (K up to 65,536). Both give the
    first index whose running mass exceeds the draw, one uniform per draw.
    """
    w = np.asarray(weights)
    if w.shape[0] > 4 * _SAMPLE_BLOCK and n * 4 <= -(-w.shape[0] // _SAMPLE_BLOCK):
        w, blocks, _, total = _prepare(w)
        assert blocks is not None
        return _draw_blocks(w, blocks, rng.random(n) * total)
    # widened first, then accumulated: the running sums of a cumsum that casts as
    # it goes, in about half its time (as _prepare)
    c = np.add.accumulate(w.astype(np.float64))
    total = float(c[-1]) if c.shape[0] else 0.0
    if not total > 0:
        raise InvalidDistribution("cannot sample from a vector with no mass")
    u = rng.random(n) * total
    # searched in all but the last running sum: a draw past them all (u at the very
    # end, through rounding) lands on the last index, as a clamp would put it. The
    # first running sum above u is where the mass rises, so a draw lands on a zero
    # weight only there, and only when the row ends in one: stepped back then alone
    idx = c[:-1].searchsorted(u, side="right")
    if not w[-1] > 0:
        return _step_back(w, idx)
    return idx.astype(np.int64, copy=False)


def _draw_blocks(w: np.ndarray, blocks: np.ndarray, u: np.ndarray) -> np.ndarray:
    """:func:`_draw` for every target in ``u`` at once: the block each falls in, then
    the running sums of those blocks only (each block's from the mass before it, as
    :func:`_draw` sums it), stacked in block order so one search serves every draw;
    a draw is kept inside its block, as :func:`_draw` keeps it."""
    nb = blocks.shape[0]
    b = np.minimum(blocks.searchsorted(u, side="right"), nb - 1)
    sel, row = np.unique(b, return_inverse=True)
    full = w.shape[0] // _SAMPLE_BLOCK
    seg = np.zeros((sel.shape[0], _SAMPLE_BLOCK), dtype=np.float64)
    whole = sel < full
    seg[whole] = w[: full * _SAMPLE_BLOCK].reshape(full, _SAMPLE_BLOCK)[sel[whole]]
    if not whole.all():  # the short last block, zero-padded (its sums stay flat)
        tail = w[full * _SAMPLE_BLOCK:]
        seg[~whole, : tail.shape[0]] = tail
    np.cumsum(seg, axis=1, out=seg)
    seg += np.where(sel > 0, blocks[np.maximum(sel - 1, 0)], 0.0)[:, None]
    pos = seg.ravel().searchsorted(u, side="right")
    lo = row * _SAMPLE_BLOCK
    start = sel[row] * _SAMPLE_BLOCK
    last = np.minimum(_SAMPLE_BLOCK, w.shape[0] - start) - 1  # a short last block's end
    return _step_back(w, start + np.clip(pos - lo, 0, last))


def _step_back(w: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """A draw can land on the very end through rounding, or on a zero weight: step
    back to the nearest index with weight."""
    bad = (w[idx] <= 0) & (idx > 0)
    while bad.any():
        idx[bad] -= 1
        bad = (w[idx] <= 0) & (idx > 0)
    return idx.astype(np.int64)
