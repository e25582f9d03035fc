"""Index/value codecs: ``sparse`` (every non-zero, exact) and ``topk:K``.

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
"""

from __future__ import annotations

import struct

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
    gaps = np.diff(idx, prepend=0)
    top = int(gaps.max())
    if top < 256:
        width, stored = 1, gaps
    elif top < 65536:
        width, stored = 2, gaps
    else:
        width, stored = 4, idx
    return b"".join((_HEAD.pack(width, k), stored.astype(_WIDTHS[width]).tobytes(),
                     vals.astype("<f4", copy=False).tobytes()))


def decode_pairs(data: Buffer, n: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Validated ``(indices, values)``; :class:`CodecError` on any inconsistency."""
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
    if width == 4:
        idx = stored.astype(np.int64)
        if k and (np.any(np.diff(idx) <= 0)):
            raise CodecError(f"{name}: indices are not strictly ascending")
    else:
        if k > 1 and np.any(stored[1:] == 0):
            raise CodecError(f"{name}: repeated index (zero gap)")
        idx = np.cumsum(stored, dtype=np.int64)
    if k and (idx[-1] >= n):
        raise CodecError(f"{name}: index {int(idx[-1])} out of range for {n}")
    if k and not (vals.min() > 0 and np.isfinite(vals.max())):
        raise CodecError(f"{name}: values must be finite and positive")
    return idx, vals.astype(np.float32)


def _scatter(idx: np.ndarray, vals: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.float32)
    out[idx] = vals
    return out


class Sparse(Codec):
    """Every non-zero as (index, float32 value): exact, ``5 + 8 k`` bytes at most."""

    name = "sparse"
    exact = True

    def encode(self, v: np.ndarray) -> bytes:
        v32 = check_input(v, self.name)
        idx = np.flatnonzero(v32)
        return encode_pairs(idx, v32[idx])

    def decode(self, data: Buffer, n: int) -> np.ndarray:
        idx, vals = decode_pairs(data, n, self.name)
        return _scatter(idx, vals, n)

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
        nz = np.flatnonzero(v32)
        if nz.size <= self.k:
            return nz
        vals = v32[nz]
        # the k-th largest value, then all above it and the lowest-index ties at it
        kth = np.partition(vals, nz.size - self.k)[nz.size - self.k]
        above = nz[vals > kth]
        ties = nz[vals == kth][: self.k - above.size]
        return np.sort(np.concatenate((above, ties)))

    def encode(self, v: np.ndarray) -> bytes:
        v32 = check_input(v, self.name)
        idx = self.keep(v32)
        return encode_pairs(idx, v32[idx])

    def decode(self, data: Buffer, n: int) -> np.ndarray:
        idx, vals = decode_pairs(data, n, self.name)
        if idx.size > self.k:
            raise CodecError(f"{self.name}: {idx.size} entries, at most {self.k} allowed")
        return _scatter(idx, vals, n)

    def commit(self, v: np.ndarray) -> np.ndarray:
        v32 = check_input(v, self.name)
        idx = self.keep(v32)
        return _scatter(idx, v32[idx], v32.shape[0])

    def max_encoded_size(self, n: int) -> int:
        return _HEAD.size + 8 * min(n, self.k)
