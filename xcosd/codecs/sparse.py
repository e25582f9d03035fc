"""Index/value codecs: ``sparse`` (every non-zero, exact), ``topk:K`` and ``head:K``.

After top-k or top-p warping a row has few non-zeros, and sending their indices
and float32 values is exact and far smaller than the dense row. Layout::

    u8 index_width | u32 count | indices | f32 values

Indices are ascending. ``index_width`` 4 stores them as ``u32``; 2 and 1 store
the gaps between consecutive indices (the first relative to 0) as ``u16`` / ``u8``
when every gap fits, which is common for dense selections and compresses well
under ``+zstd`` either way. Values are the float32 bits, unchanged, so ``sparse``
is exact (``commit`` is the identity up to the sign of zero).

``topk:K`` keeps the ``K`` largest entries (ties to the lowest index) and sends
them the same way; it is lossy, and the commit rule's renormalisation
(``xcosd.methods.commit``) turns what it keeps into the committed distribution.
It selects with one ``np.partition`` over 64-bit keys, the value's bits above
the complemented index, so every key is distinct and the K largest keys are the
K largest values with ties to the lowest index: a 4-gram row, whose entries
mostly share a handful of backed-off values, costs what any other row does (a
partition of the values themselves slows down 30-50x on such duplicates).

``head:K`` sends what ``topk:K`` sends plus one float32: the mean of the entries it
leaves out, which the committed row holds at every position outside the head.
Where a draft's row is a proposal (a draft tree's branching rows: the draft samples
from the row it commits), truncating it to its top ``K`` moves all the tail's mass
onto the head, and a draft whose tail the target shares (a smoothed n-gram's, or
any row at a high temperature) loses that much acceptance at every branching node;
the flat tail keeps the head's values and the tail's total, for 4 more bytes.
Layout: ``topk:K``'s, then ``f32 tail``. The tail value is the float64 mean of the
left-out entries rounded once to float32, so a committed row commits to itself:
its tail entries are that one value, whose float64 sum over ``n - K`` positions is
exact and whose mean is the value again.
"""

from __future__ import annotations

import struct
import sys

import numpy as np

from ..errors import CodecError
from .base import Buffer, Codec, check_input

_HEAD = struct.Struct("<BI")
_WIDTHS = {1: "<u1", 2: "<u2", 4: "<u4"}


def encode_pairs(idx: np.ndarray, vals: np.ndarray) -> bytes:
    """Bytes for ascending ``idx`` (int64) and their float32 ``vals``."""
    k = int(idx.size)
    if k == 0:
        return _HEAD.pack(4, 0)
    gaps = np.empty_like(idx)
    gaps[0] = idx[0]
    np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    top = int(gaps.max())
    if top < 256:
        width, stored = 1, gaps
    elif top < 65536:
        width, stored = 2, gaps
    else:
        width, stored = 4, idx
    return b"".join((_HEAD.pack(width, k), stored.astype(_WIDTHS[width]).data,
                     np.ascontiguousarray(vals, dtype="<f4").data))


def _dense_gaps(nz: np.ndarray) -> tuple[int, np.ndarray] | None:
    """For a mask with few False entries (a dense row's zeros): the index width and
    the stored gaps of its True positions, as :func:`encode_pairs` writes them, built
    from the runs of zeros alone (the gap after a run of ``r`` zeros is ``r + 1``,
    every other gap 1), which spares an int64 index per entry and its differences.
    None when the mask is not that dense, is all zeros, or a gap needs ``u32``."""
    n = nz.size
    k = int(np.count_nonzero(nz))
    if k == 0 or n - k > n // 32:
        return None
    zeros = np.flatnonzero(~nz)
    if zeros.size:
        breaks = np.flatnonzero(np.diff(zeros) != 1) + 1
        first = np.concatenate(([0], breaks))  # each run's first and past-last zero
        past = np.concatenate((breaks, [zeros.size]))
        run = past - first
        after = zeros[first] + run  # the position just after each run
        keep = after < n  # a run at the end is followed by nothing
        # the entry after a run is the (after - zeros so far)-th non-zero; a run at
        # position 0 makes the first gap (the first index itself) its length
        at = after[keep] - past[keep]
        gap = run[keep] + (zeros[first][keep] != 0)
        top = int(gap.max()) if gap.size else 1
    else:
        top = 1
    if top >= 65536:
        return None
    gaps = np.ones(k, dtype="<u1" if top < 256 else "<u2")
    gaps[0] = 0  # the first index relative to 0, unless a run starts at 0
    if zeros.size:
        gaps[at] = gap
    return (1 if top < 256 else 2), gaps


def decode_pairs(data: Buffer, n: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Validated ``(where, values)``; :class:`CodecError` on any inconsistency.

    ``where`` is the ascending int64 indices, or, for gap-coded indices that are
    mostly consecutive (a dense row's), the boolean mask of the ``n`` positions
    they select: built from the few gaps other than 1, which spares a serial
    prefix sum over every gap and a scatter by index (0.3 ms against 1.2 ms on a
    262,144-entry row).
    """
    mv = memoryview(data).cast("B")
    if mv.nbytes < _HEAD.size:
        raise CodecError(f"{name}: {mv.nbytes} bytes is shorter than the header")
    width, k = _HEAD.unpack_from(mv, 0)
    if width not in _WIDTHS:
        raise CodecError(f"{name}: bad index width {width}")
    if k > n:
        raise CodecError(f"{name}: {k} entries for a vector of {n}")
    if mv.nbytes != _HEAD.size + k * (width + 4):
        raise CodecError(f"{name}: {mv.nbytes} bytes do not hold {k} entries of width {width}")
    stored = np.frombuffer(mv, dtype=_WIDTHS[width], count=k, offset=_HEAD.size)
    vals = np.frombuffer(mv, dtype="<f4", count=k, offset=_HEAD.size + k * width)
    if k and not (vals.min() > 0 and np.isfinite(vals.max())):
        raise CodecError(f"{name}: values must be finite and positive")
    if k == 0:
        return np.zeros(0, dtype=np.int64), vals
    if width == 4:
        idx = stored.astype(np.int64)
        if np.any(np.diff(idx) <= 0):
            raise CodecError(f"{name}: indices are not strictly ascending")
        last = int(idx[-1])
    else:
        jumps = np.flatnonzero(stored != 1)  # gaps other than 1 (the first gap is idx[0])
        if jumps.size and np.any(stored[jumps[jumps > 0]] == 0):
            raise CodecError(f"{name}: repeated index (zero gap)")
        last = int(stored.sum(dtype=np.int64))
    if last >= n:
        raise CodecError(f"{name}: index {last} out of range for {n}")
    if width == 4:
        return idx, vals
    if jumps.size > k // 32:
        return np.cumsum(stored, dtype=np.int64), vals
    return _kept_mask(stored, jumps, last, n), vals


def _kept_mask(stored: np.ndarray, jumps: np.ndarray, last: int, n: int) -> np.ndarray:
    """The positions that gap-coded indices select, as a mask over ``n``, from the
    gaps other than 1 (at ``jumps``; every other gap moves on by one). ``last``
    is the final index."""
    mask = np.ones(n, dtype=bool)
    mask[: int(stored[0])] = False  # the first gap is the first index
    mask[last + 1:] = False
    jumps = jumps[jumps > 0]
    if not jumps.size:
        return mask
    gaps = stored[jumps].astype(np.int64)
    # index j is j + 1 + the sum of (gap - 1) over gaps 0 .. j: only jumps add to it
    ends = jumps + int(stored[0]) + np.cumsum(gaps - 1)
    lengths = gaps - 1  # positions skipped just before each jump's index
    starts = ends - lengths
    total = int(lengths.sum())
    offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    mask[offsets + np.arange(total)] = False
    return mask


def _scatter(where: np.ndarray, vals: np.ndarray, n: int) -> np.ndarray:
    """The float32 vector of length ``n`` with ``vals`` at ``where`` (indices or a
    mask), zero elsewhere."""
    if vals.size == n:  # every entry (indices strictly ascending in [0, n))
        return vals.astype(np.float32)
    out = np.zeros(n, dtype=np.float32)
    out[where] = vals
    return out


class Sparse(Codec):
    """Every non-zero as (index, float32 value): exact, ``5 + 8 k`` bytes at most."""

    name = "sparse"
    exact = True

    def encode(self, v: np.ndarray) -> bytes:
        v32 = check_input(v, self.name)
        nz = v32 != 0
        dense = _dense_gaps(nz)
        if dense is None:
            return encode_pairs(np.flatnonzero(nz), v32[nz])
        width, gaps = dense
        vals = np.ascontiguousarray(v32[nz], dtype="<f4")
        return b"".join((_HEAD.pack(width, gaps.size), gaps.data, vals.data))

    def decode(self, data: Buffer, n: int) -> np.ndarray:
        where, vals = decode_pairs(data, n, self.name)
        return _scatter(where, vals, n)

    def max_encoded_size(self, n: int) -> int:
        return _HEAD.size + 8 * n


class TopK(Codec):
    """The ``k`` largest entries (ties to the lowest index) as index/value pairs."""

    def __init__(self, k: int) -> None:
        if k < 1:
            raise CodecError(f"topk: K must be >= 1, got {k}")
        self.k = k
        self.name = f"topk:{k}"

    def keep(self, v32: np.ndarray) -> np.ndarray:
        """Ascending indices of the kept non-zero entries."""
        nz = v32 != 0
        n, k = v32.size, self.k
        if np.count_nonzero(nz) <= k:
            return np.flatnonzero(nz)
        bits = v32.view(np.uint32)
        if int(bits.max()) >= 0x80000000:  # -0.0 (the only signed input): a plain zero
            bits = bits & np.uint32(0x7FFFFFFF)
        # key = value bits << 32 | (n - 1 - index): a larger value, then a lower index,
        # makes a larger key; more than k entries are non-zero, so the k largest
        # keys are all non-zero entries
        keys = np.empty(n, dtype=np.uint64)
        words = keys.view(np.uint32).reshape(n, 2)
        hi = 1 if sys.byteorder == "little" else 0
        words[:, hi] = bits
        words[:, 1 - hi] = np.arange(n - 1, -1, -1, dtype=np.uint32)
        keys.partition(n - k)
        top = keys[n - k:]
        idx = (n - 1) - (top & np.uint64(0xFFFFFFFF)).astype(np.int64)
        if k > n // 16:  # a mask is cheaper than a sort for many indices
            kept = np.zeros(n, dtype=bool)
            kept[idx] = True
            return np.flatnonzero(kept)
        idx.sort()
        return idx

    def encode(self, v: np.ndarray) -> bytes:
        v32 = check_input(v, self.name)
        idx = self.keep(v32)
        return encode_pairs(idx, v32[idx])

    def pairs(self, data: Buffer, n: int) -> tuple[np.ndarray, np.ndarray]:
        """:func:`decode_pairs`, refusing more than ``k`` entries."""
        where, vals = decode_pairs(data, n, self.name)
        if vals.size > self.k:
            raise CodecError(f"{self.name}: {vals.size} entries, at most {self.k} allowed")
        return where, vals

    def decode(self, data: Buffer, n: int) -> np.ndarray:
        where, vals = self.pairs(data, n)
        return _scatter(where, vals, n)

    def commit(self, v: np.ndarray) -> np.ndarray:
        v32 = check_input(v, self.name)
        idx = self.keep(v32)
        return _scatter(idx, v32[idx], v32.shape[0])

    def max_encoded_size(self, n: int) -> int:
        return _HEAD.size + 8 * min(n, self.k)


_TAIL = struct.Struct("<f")


class Head(TopK):
    """``topk:K``'s head, and the rest of the row as one flat float32 value (the mean
    of the entries left out) at every position outside it."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.name = f"head:{k}"

    def _split(self, v32: np.ndarray) -> tuple[np.ndarray, np.float32]:
        """The head's ascending indices and the tail's float32 value."""
        idx = self.keep(v32)
        rest = v32.size - idx.size
        if rest == 0:
            return idx, np.float32(0.0)
        out = np.ones(v32.size, dtype=bool)
        out[idx] = False
        tail = np.float32(float(np.sum(v32[out], dtype=np.float64)) / rest)
        if idx.size:  # rounding never lifts the tail above the head's least value
            tail = min(tail, v32[idx].min())
        return idx, np.float32(tail)

    def encode(self, v: np.ndarray) -> bytes:
        v32 = check_input(v, self.name)
        idx, tail = self._split(v32)
        return encode_pairs(idx, v32[idx]) + _TAIL.pack(tail)

    def decode(self, data: Buffer, n: int) -> np.ndarray:
        mv = memoryview(data).cast("B")
        if mv.nbytes < _HEAD.size + _TAIL.size:
            raise CodecError(f"{self.name}: {mv.nbytes} bytes is shorter than the header")
        where, vals = self.pairs(mv[: mv.nbytes - _TAIL.size], n)
        (tail,) = _TAIL.unpack_from(mv, mv.nbytes - _TAIL.size)
        tail = np.float32(tail)
        if not (np.isfinite(tail) and tail >= 0):
            raise CodecError(f"{self.name}: the tail value must be finite and >= 0")
        # a tail only follows a full head (fewer non-zeros than K leave none), and
        # never above the head's least value
        if tail > 0 and (vals.size == n or vals.size < self.k or tail > vals.min()):
            raise CodecError(f"{self.name}: a tail value no encoder sends")
        out = _scatter(where, vals, n)
        if tail > 0:
            out[out == 0] = tail  # every head value is > 0
        return out

    def commit(self, v: np.ndarray) -> np.ndarray:
        v32 = check_input(v, self.name)
        idx, tail = self._split(v32)
        out = np.full(v32.shape[0], tail, dtype=np.float32)
        out[idx] = v32[idx]
        return out

    def max_encoded_size(self, n: int) -> int:
        return super().max_encoded_size(n) + _TAIL.size
