"""16-bit floats: ``f16`` (IEEE half) and ``bf16`` (bfloat16), ``2 * n`` bytes.

Both round to nearest even. ``f16`` keeps 11 significant bits but flushes values
under 6e-8 to zero and loses precision under 6e-5 (subnormals), so a dense
vector's long tail suffers; ``bf16`` keeps float32's exponent range (no tail is
lost) with 8 significant bits. Each decoded value is a representable 16-bit
number, so re-encoding is exact (``commit`` is idempotent).
"""

from __future__ import annotations

import numpy as np

from ..errors import CodecError
from .base import Buffer, Codec, check_input, check_output


def _check_len(data: Buffer, n: int, name: str) -> None:
    size = memoryview(data).nbytes
    if size != 2 * n:
        raise CodecError(f"{name}: {size} bytes cannot hold {n} 16-bit values")


class F16(Codec):
    name = "f16"

    def encode(self, v: np.ndarray) -> bytes:
        return check_input(v, self.name).astype("<f2").tobytes()

    def decode(self, data: Buffer, n: int) -> np.ndarray:
        _check_len(data, n, self.name)
        return check_output(np.frombuffer(data, dtype="<f2").astype(np.float32), self.name)

    def max_encoded_size(self, n: int) -> int:
        return 2 * n

    def encoded_size(self, v: np.ndarray) -> int:
        return 2 * int(np.shape(v)[0])


class BF16(Codec):
    name = "bf16"

    def encode(self, v: np.ndarray) -> bytes:
        u = check_input(v, self.name).view(np.uint32)
        # round to nearest, ties to even, on the 16 dropped bits
        r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return r.astype("<u2").tobytes()

    def decode(self, data: Buffer, n: int) -> np.ndarray:
        _check_len(data, n, self.name)
        u = np.frombuffer(data, dtype="<u2").astype(np.uint32) << np.uint32(16)
        return check_output(u.view(np.float32), self.name)

    def max_encoded_size(self, n: int) -> int:
        return 2 * n

    def encoded_size(self, v: np.ndarray) -> int:
        return 2 * int(np.shape(v)[0])
