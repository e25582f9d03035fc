"""The probability-codec interface and the commit rule's building block.

A codec turns a float32 probability vector into bytes and back. Lossy codecs are
allowed only because of the **commit rule** (``docs/METHODS.md``, "Choices worth knowing"): the sender
computes ``commit(v) == decode(encode(v))`` and every decision on both sides uses
that committed vector, so the output stays exact with respect to it. Hence the
contract every codec must keep, bit for bit:

* ``decode(encode(v), len(v)) == commit(v)``
* ``commit(commit(v)) == commit(v)``

``decode`` reads bytes from a peer, so it validates everything (length, indices,
NaN, negative values) and raises :class:`CodecError` rather than return a vector
the sender could not have produced. Decoders use only correctly rounded IEEE
operations (no ``exp``/``log``), so the receiver's bits equal the sender's on any
platform.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..errors import CodecError

#: what ``decode`` accepts: a received frame
Buffer = bytes | bytearray | memoryview


def check_input(v: np.ndarray, name: str) -> np.ndarray:
    """``v`` as a contiguous float32 vector; :class:`CodecError` unless finite and
    non-negative (an encoder must not turn a broken vector into valid bytes)."""
    v32 = np.ascontiguousarray(v, dtype=np.float32)
    if v32.ndim != 1:
        raise CodecError(f"{name}: expected a vector, got shape {v32.shape}")
    if v32.size and not (v32.min() >= 0 and np.isfinite(v32.max())):
        raise CodecError(f"{name}: vector has NaN, infinite or negative values")
    return v32


def check_output(v: np.ndarray, name: str) -> np.ndarray:
    """Reject decoded values no encoder emits (NaN, infinity, negative)."""
    if v.size and not (v.min() >= 0 and np.isfinite(v.max())):
        raise CodecError(f"{name}: payload holds NaN, infinite or negative values")
    return v


class Codec(ABC):
    """Encode/decode float32 vectors; ``exact`` codecs have ``commit(v) == v``."""

    #: registry name, e.g. ``"f32"``, ``"topk:50"``, ``"sparse+zstd"``
    name: str = ""
    #: True when ``commit`` is the identity on every float32 vector
    exact: bool = False

    @abstractmethod
    def encode(self, v: np.ndarray) -> bytes:
        """Bytes for the float32 vector ``v``."""

    @abstractmethod
    def decode(self, data: Buffer, n: int) -> np.ndarray:
        """The float32 vector of length ``n`` that ``data`` encodes.

        Raises :class:`CodecError` on malformed input (never returns garbage).
        """

    @abstractmethod
    def max_encoded_size(self, n: int) -> int:
        """The most bytes ``encode`` produces for a vector of length ``n`` (a
        receiver's bound before it decompresses or allocates)."""

    def commit(self, v: np.ndarray) -> np.ndarray:
        """The vector the receiver will see: ``decode(encode(v))``."""
        v32 = np.ascontiguousarray(v, dtype=np.float32)
        if self.exact:
            return v32
        return self.decode(self.encode(v32), v32.shape[0])

    def encoded_size(self, v: np.ndarray) -> int:
        """Bytes ``encode(v)`` produces (codecs with a fixed size override this)."""
        return len(self.encode(np.ascontiguousarray(v, dtype=np.float32)))

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class F32(Codec):
    """Raw little-endian float32: exact, ``4 * n`` bytes."""

    name = "f32"
    exact = True

    def encode(self, v: np.ndarray) -> bytes:
        return check_input(v, self.name).astype("<f4", copy=False).tobytes()

    def decode(self, data: Buffer, n: int) -> np.ndarray:
        size = memoryview(data).nbytes
        if size != 4 * n:
            raise CodecError(f"f32: {size} bytes cannot hold {n} float32 values")
        return check_output(np.frombuffer(data, dtype="<f4").astype(np.float32), self.name)

    def max_encoded_size(self, n: int) -> int:
        return 4 * n

    def encoded_size(self, v: np.ndarray) -> int:
        return 4 * int(np.shape(v)[0])
