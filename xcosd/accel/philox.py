"""Philox4x32-10, the counter-based generator every draw on the accelerator path uses.

A stateful generator (numpy's ``Generator``, torch's) hands out numbers in the order
they are asked for, so a session's draws would depend on what else was drawn before
them in the same call: on how sessions were batched. Philox (Salmon et al., "Parallel
random numbers: as easy as 1, 2, 3", SC'11) is a keyed bijection of a 128-bit counter
instead: a draw is a pure function of ``(key, counter)``. The cloud keys it with the
session's seed and counts ``(round, stream, index)``, so a session's draws are the same
whether it is verified alone or beside 200 others, on the CPU or on a GPU, before or
after a restart.

A round needs few uniforms (one per draft, one per draw, ``K`` per candidate round):
they are made on the host in numpy's uint64 arithmetic, where a product of two 32-bit
words is exact, and cross to the device as one small array. The known-answer vectors
of the reference implementation (Random123's ``kat_vectors``) are checked in
``tests/test_accel.py``.
"""

from __future__ import annotations

import numpy as np

_MASK = np.uint64(0xFFFFFFFF)
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_32 = np.uint64(32)
#: rounds of the standard Philox4x32-10
ROUNDS = 10

Words = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def philox4x32(counter: Words, key: tuple[np.ndarray, np.ndarray],
               rounds: int = ROUNDS) -> Words:
    """Philox4x32 of ``counter`` (four 32-bit words) under ``key`` (two words), each a
    uint64 array holding values in ``[0, 2**32)``; shapes broadcast."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) for k in key)
    for r in range(rounds):
        if r:
            k0 = (k0 + _W0) & _MASK
            k1 = (k1 + _W1) & _MASK
        p0 = c0 * _M0  # < 2**64: exact
        p1 = c2 * _M1
        c0, c1, c2, c3 = (p1 >> _32) ^ c1 ^ k0, p1 & _MASK, (p0 >> _32) ^ c3 ^ k1, p0 & _MASK
    return c0, c1, c2, c3


def uniforms(key: np.ndarray | int, round_: np.ndarray | int, stream: np.ndarray | int,
             index: np.ndarray | int) -> np.ndarray:
    """float64 uniforms in ``[0, 1)`` (53 random bits each), one per broadcast element
    of ``(key, round, stream, index)``: the key is a 64-bit seed, the counter
    ``(index, stream, round mod 2**32, round div 2**32)``."""
    k = np.asarray(key, dtype=np.uint64)
    r = np.asarray(round_, dtype=np.uint64)
    a, b, _, _ = philox4x32(
        (np.asarray(index, dtype=np.uint64) & _MASK, np.asarray(stream, dtype=np.uint64) & _MASK,
         r & _MASK, r >> _32), (k & _MASK, k >> _32))
    bits = (a >> np.uint64(5)) * np.uint64(1 << 26) + (b >> np.uint64(6))  # 27 + 26 bits
    return np.asarray(bits, dtype=np.float64) * (1.0 / (1 << 53))


__all__ = ["ROUNDS", "philox4x32", "uniforms"]
