"""16-bit floats: ``f16`` (IEEE half) and ``bf16`` (bfloat16), ``2 * n`` bytes.

Both round to nearest even. ``f16`` keeps 11 significant bits but flushes values
under 6e-8 to zero and loses precision under 6e-5 (subnormals), so a dense
vector's long tail suffers; ``bf16`` keeps float32's exponent range (no tail is
lost) with 8 significant bits. Each decoded value is a representable 16-bit
number, so re-encoding is exact (``commit`` is idempotent).

Both directions are integer arithmetic on the bit patterns (and, for ``f16``
subnormals, one exactly rounded float addition): numpy's own float16 casts take
a slow path whenever a result or an input is subnormal, which a dense row's tail
hits on most entries (20-30 ms per 262,144-entry row against about 1 ms here).
The ``f16`` encoder's output is bit for bit what ``astype('<f2')`` gives
(``tests/test_codecs.py`` checks it on edge cases and random bit patterns).
"""

from __future__ import annotations

import numpy as np

from ..errors import CodecError
from .base import Buffer, Codec, check_input, check_output

_U13 = np.uint32(13)
_ONE = np.uint32(1)
#: float32 bits of 2^-14, half's smallest normal: below it the half is subnormal
_HALF_NORMAL = np.uint32(113 << 23)
#: rebias the exponent (127 -> 15) and add the round-half-down part of the rounding
_REBIAS = np.uint32((0xFFF - (112 << 23)) & 0xFFFFFFFF)
_HALF_INF = np.uint32(0x7C00)
#: 0.5 has a float32 ulp of 2^-24, a half subnormal's unit: adding it rounds to
#: that unit (to nearest even, in hardware), and its bits come off as an integer
_ALIGN = np.float32(0.5)
_ALIGN_BITS = np.uint32(0x3F000000)
_SIGN = np.uint32(0x80000000)
#: every half's float32 value, indexed by its bits (the conversion is exact)
_HALF_TO_F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(
    np.float32)


def _check_len(data: Buffer, n: int, name: str) -> None:
    size = memoryview(data).nbytes
    if size != 2 * n:
        raise CodecError(f"{name}: {size} bytes cannot hold {n} 16-bit values")


def f32_to_f16_bits(v32: np.ndarray) -> np.ndarray:
    """IEEE half bits (``uint16``) of the non-negative float32 vector ``v32``,
    rounded to nearest even, overflow to infinity: ``v32.astype('<f2')`` exactly.

    Normal halves take the usual integer rounding on the 13 dropped bits; halves
    under 2^-14 are ``x + 0.5`` in float32, whose rounding to a multiple of 2^-24
    is the subnormal half's rounding. ``-0.0`` (the only signed input an encoder
    accepts) keeps its sign.
    """
    bits = v32.view(np.uint32)
    signed = bool(bits.size) and int(bits.max()) >= int(_SIGN)
    u = bits & np.uint32(0x7FFFFFFF) if signed else bits
    r = u >> _U13
    r &= _ONE  # odd kept mantissa: a tie rounds up to even
    r += u
    r += _REBIAS
    r >>= _U13
    np.minimum(r, _HALF_INF, out=r)  # past the largest half: infinity
    sub = np.add(u.view(np.float32), _ALIGN).view(np.uint32)
    sub -= _ALIGN_BITS
    # take ``sub`` under 2^-14, ``r`` above, without branches (a masked copy slows
    # down fivefold on a row whose entries straddle 2^-14 at random); every buffer
    # is reused, as fresh megabyte temporaries cost page faults on each call
    below = np.subtract(u.view(np.int32), np.int32(_HALF_NORMAL),
                        out=u.view(np.int32) if signed else None)
    below >>= np.int32(31)  # all ones under 2^-14, else 0
    sub ^= r
    sub &= below.view(np.uint32)
    r ^= sub
    if signed:  # -0.0 keeps its sign
        np.right_shift(bits, np.uint32(16), out=sub)
        sub &= np.uint32(0x8000)
        r |= sub
    return r.astype("<u2")


class F16(Codec):
    name = "f16"

    def encode(self, v: np.ndarray) -> bytes:
        return f32_to_f16_bits(check_input(v, self.name)).tobytes()

    def decode(self, data: Buffer, n: int) -> np.ndarray:
        _check_len(data, n, self.name)
        h = np.frombuffer(data, dtype="<u2")
        # past the largest finite half: infinity, NaN or a sign bit (-0.0 is a valid zero)
        if (h.size and int(h.max()) >= int(_HALF_INF)
                and np.any((h >= _HALF_INF) & (h != 0x8000))):
            raise CodecError(f"{self.name}: payload holds NaN, infinite or negative "
                                 "values")
        return np.take(_HALF_TO_F32, h)

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
