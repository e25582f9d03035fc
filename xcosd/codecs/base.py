"""The probability-codec interface and the commit rule's building block.

A codec turns a float32 probability vector into bytes and back. Lossy codecs are
allowed only because of the **commit rule** (``ALGORITHMS.md``): the sender
computes ``commit(v) == decode(encode(v))`` and every decision on both sides uses
that committed vector, so the output stays exact with respect to it. Hence the
contract every codec must keep, bit for bit:

* ``decode(encode(v), len(v)) == commit(v)``
* ``commit(commit(v)) == commit(v)``
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..errors import CodecError


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
    def decode(self, data: bytes, n: int) -> np.ndarray:
        """The float32 vector of length ``n`` that ``data`` encodes.

        Raises :class:`CodecError` on malformed input (never returns garbage).
        """

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
        return np.ascontiguousarray(v, dtype="<f4").tobytes()

    def decode(self, data: bytes, n: int) -> np.ndarray:
        if len(data) != 4 * n:
            raise CodecError(f"f32: {len(data)} bytes cannot hold {n} float32 values")
        return np.frombuffer(data, dtype="<f4").astype(np.float32)

    def encoded_size(self, v: np.ndarray) -> int:
        return 4 * int(np.shape(v)[0])
