"""8-bit codecs with a per-vector scale: ``n + 5`` bytes.

Layout: ``f32 scale`` (the vector's maximum), one grid byte, then one code byte
per entry; code 0 is exactly zero and the largest entry always gets code 255, so
the scale is kept exactly. Three quantisers share it:

* ``q8:lin``  — ``p = scale * c / 255``, round to nearest. Everything under
  ``scale / 510`` becomes 0: on a dense 150k-token row that is most of the tail.
* ``q8:sqrt`` — ``p = scale * (c / 255)^2``; a finer grid near zero, but still a
  floor at ``scale / 260100`` and coarse steps just above it.
* ``q8:log``  — ``p = scale * 2^(-(255 - c) / s)`` for ``c >= 1``, rounded to the
  nearest code in the log domain, with ``s`` steps per octave: whichever of
  8, 16, 32, 64, 128 predicts the lowest TV for this vector (the grid byte says
  which; see :func:`_choose_steps`). Every kept value has a bounded *relative* error
  (±4.4 % at ``s = 8``, ±0.27 % at ``s = 128``) and at ``s = 8`` only entries
  under ``3.4e-10 * scale`` are dropped.

``q8`` is ``q8:log``: a language model's probabilities spread over many orders
of magnitude and most of a dense row's mass sits in its tail, where the linear
and square-root grids are coarsest. On Zipf and Gaussian-logit rows over 152k
ids its TV(p, p*) is about 1e-2 dense and 1-5e-3 after top-p / top-k, against
0.1-0.5 (lin) and 0.02-0.05 (sqrt) dense; ``xcosd/bench/codecs.py`` measures all three
on the same rows.

The encoder works in float32 (a vectorised ``log2``, a square root or a product
per entry: about 1-2 ms per 262,144-entry row, where float64 took 8-17 ms): each
entry's code is the float64 formula's rounding whenever the float32 estimate lies
more than 1/64 of a step from a rounding boundary (its error is bounded by 2e-3 of
a step, and measures under 1e-4), and the few entries closer than that are coded
with the float64 formula itself, so the codes are the float64 quantiser's. The
grid choice sums each candidate's dropped mass in float32 and redoes the sums in
float64 when two predicted costs lie within 1e-4 of each other, so it picks what
the float64 sums pick.

Decoding uses only exact operations: the 128 constants ``2^(-j/128)`` are written
out below as hex literals, multiplied by the scale in float64 (correctly
rounded), scaled by an exact power of two and rounded once to float32, so the
receiver gets the sender's bits on any platform. Levels under float32's smallest
normal number decode to 0 (and are encoded as 0) so that re-encoding a committed
vector reproduces it exactly.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from ..errors import CodecError
from .base import Buffer, Codec, check_input, check_output

#: f32 scale, then the grid byte (log: index into _LOG_STEPS; others: 0)
_HEAD = struct.Struct("<fB")
_TINY = float(np.finfo(np.float32).tiny)

#: 2^(-j/128) for j = 0..127, exactly as float64 (hex literals: the same bits everywhere)
_LOG_FRACTIONS = np.array([float.fromhex(h) for h in (
    "0x1.0000000000000p+0", "0x1.fd3c22b8f71f1p-1", "0x1.fa7c1819e90d8p-1", "0x1.f7bfdad9cbe14p-1",
    "0x1.f50765b6e4540p-1", "0x1.f252b376bba97p-1", "0x1.efa1bee615a27p-1", "0x1.ecf482d8e67f1p-1",
    "0x1.ea4afa2a490dap-1", "0x1.e7a51fbc74c83p-1", "0x1.e502ee78b3ff6p-1", "0x1.e264614f5a129p-1",
    "0x1.dfc97337b9b5fp-1", "0x1.dd321f301b460p-1", "0x1.da9e603db3285p-1", "0x1.d80e316c98398p-1",
    "0x1.d5818dcfba487p-1", "0x1.d2f87080d89f2p-1", "0x1.d072d4a07897cp-1", "0x1.cdf0b555dc3fap-1",
    "0x1.cb720dcef9069p-1", "0x1.c8f6d9406e7b5p-1", "0x1.c67f12e57d14bp-1", "0x1.c40ab5fffd07ap-1",
    "0x1.c199bdd85529cp-1", "0x1.bf2c25bd71e09p-1", "0x1.bcc1e904bc1d2p-1", "0x1.ba5b030a1064ap-1",
    "0x1.b7f76f2fb5e47p-1", "0x1.b59728de5593ap-1", "0x1.b33a2b84f15fbp-1", "0x1.b0e07298db666p-1",
    "0x1.ae89f995ad3adp-1", "0x1.ac36bbfd3f37ap-1", "0x1.a9e6b5579fdbfp-1", "0x1.a799e1330b358p-1",
    "0x1.a5503b23e255dp-1", "0x1.a309bec4a2d33p-1", "0x1.a0c667b5de565p-1", "0x1.9e86319e32323p-1",
    "0x1.9c49182a3f090p-1", "0x1.9a0f170ca07bap-1", "0x1.97d829fde4e50p-1", "0x1.95a44cbc8520fp-1",
    "0x1.93737b0cdc5e5p-1", "0x1.9145b0b91ffc6p-1", "0x1.8f1ae99157736p-1", "0x1.8cf3216b5448cp-1",
    "0x1.8ace5422aa0dbp-1", "0x1.88ac7d98a6699p-1", "0x1.868d99b4492edp-1", "0x1.8471a4623c7adp-1",
    "0x1.82589994cce13p-1", "0x1.80427543e1a12p-1", "0x1.7e2f336cf4e62p-1", "0x1.7c1ed0130c132p-1",
    "0x1.7a11473eb0187p-1", "0x1.780694fde5d3fp-1", "0x1.75feb564267c9p-1", "0x1.73f9a48a58174p-1",
    "0x1.71f75e8ec5f74p-1", "0x1.6ff7df9519484p-1", "0x1.6dfb23c651a2fp-1", "0x1.6c012750bdabfp-1",
    "0x1.6a09e667f3bcdp-1", "0x1.68155d44ca973p-1", "0x1.6623882552225p-1", "0x1.6434634ccc320p-1",
    "0x1.6247eb03a5585p-1", "0x1.605e1b976dc09p-1", "0x1.5e76f15ad2148p-1", "0x1.5c9268a5946b7p-1",
    "0x1.5ab07dd485429p-1", "0x1.58d12d497c7fdp-1", "0x1.56f4736b527dap-1", "0x1.551a4ca5d920fp-1",
    "0x1.5342b569d4f82p-1", "0x1.516daa2cf6642p-1", "0x1.4f9b2769d2ca7p-1", "0x1.4dcb299fddd0dp-1",
    "0x1.4bfdad5362a27p-1", "0x1.4a32af0d7d3dep-1", "0x1.486a2b5c13cd0p-1", "0x1.46a41ed1d0057p-1",
    "0x1.44e086061892dp-1", "0x1.431f5d950a897p-1", "0x1.4160a21f72e2ap-1", "0x1.3fa4504ac801cp-1",
    "0x1.3dea64c123422p-1", "0x1.3c32dc313a8e5p-1", "0x1.3a7db34e59ff7p-1", "0x1.38cae6d05d866p-1",
    "0x1.371a7373aa9cbp-1", "0x1.356c55f929ff1p-1", "0x1.33c08b26416ffp-1", "0x1.32170fc4cd831p-1",
    "0x1.306fe0a31b715p-1", "0x1.2ecafa93e2f56p-1", "0x1.2d285a6e4030bp-1", "0x1.2b87fd0dad990p-1",
    "0x1.29e9df51fdee1p-1", "0x1.284dfe1f56381p-1", "0x1.26b4565e27cddp-1", "0x1.251ce4fb2a63fp-1",
    "0x1.2387a6e756238p-1", "0x1.21f49917ddc96p-1", "0x1.2063b88628cd6p-1", "0x1.1ed5022fcd91dp-1",
    "0x1.1d4873168b9aap-1", "0x1.1bbe084045cd4p-1", "0x1.1a35beb6fcb75p-1", "0x1.18af9388c8deap-1",
    "0x1.172b83c7d517bp-1", "0x1.15a98c8a58e51p-1", "0x1.1429aaea92de0p-1", "0x1.12abdc06c31ccp-1",
    "0x1.11301d0125b51p-1", "0x1.0fb66affed31bp-1", "0x1.0e3ec32d3d1a2p-1", "0x1.0cc922b7247f7p-1",
    "0x1.0b5586cf9890fp-1", "0x1.09e3ecac6f383p-1", "0x1.0874518759bc8p-1", "0x1.0706b29ddf6dep-1",
    "0x1.059b0d3158574p-1", "0x1.04315e86e7f85p-1", "0x1.02c9a3e778061p-1", "0x1.0163da9fb3335p-1",
)])
#: steps per octave the log quantiser may use (byte 4 of the payload is log2(s) - 3)
_LOG_STEPS = (8, 16, 32, 64, 128)


def _flush(lv: np.ndarray, scale: float) -> np.ndarray:
    """Subnormal levels become 0 (their bits would not survive re-encoding); code
    255 is the scale itself, always."""
    lv[lv < _TINY] = 0.0
    lv[255] = scale
    return lv


def _levels_log(scale: float, steps: int) -> np.ndarray:
    """The 256 decoded values for ``scale`` and ``steps`` per octave (float32;
    index = code)."""
    k = 255 - np.arange(256)  # steps below the scale
    frac = _LOG_FRACTIONS[(k % steps) * (128 // steps)]
    lv = np.ldexp(scale * frac, -(k // steps)).astype(np.float32)
    lv[0] = 0.0
    return _flush(lv, scale)


def _levels_lin(scale: float, steps: int = 0) -> np.ndarray:
    lv = (scale * np.arange(256, dtype=np.float64) / 255.0).astype(np.float32)
    return _flush(lv, scale)


def _levels_sqrt(scale: float, steps: int = 0) -> np.ndarray:
    c = np.arange(256, dtype=np.float64)
    lv = (scale * ((c * c) / 65025.0)).astype(np.float32)
    return _flush(lv, scale)


#: float32 estimates this close to a rounding boundary (in steps) are recomputed in
#: float64; the estimates' error is bounded by 2e-3 steps (and measures under 1e-4)
_NEAR = np.float32(0.5 - 1 / 64)
#: scales whose float32 arithmetic is exact enough (the tiniest and largest fall back
#: to float64 throughout)
_FAST_SCALES = (2.0 ** -80, 2.0 ** 100)
#: predicted costs closer than this (relative) are recomputed in float64
_TIE = 1e-4
_SAMPLE = 64
_LN2 = float(np.log(2))


def _cost(dropped: float, steps: int) -> float:
    return dropped + (1.0 - dropped) * _LN2 / (8 * steps)


def _floor(scale: float, steps: int) -> float:
    """Entries under this are dropped by a grid of ``steps`` per octave."""
    return scale * 2.0 ** (-254.5 / steps)


def _choose_steps_exact(v32: np.ndarray, scale: float) -> int:
    """:func:`_choose_steps` with every sum in float64."""
    v = v32[v32 > 0].astype(np.float64)
    total = float(v.sum())
    best, best_cost = _LOG_STEPS[0], np.inf
    for steps in _LOG_STEPS:
        dropped = float(v[v < _floor(scale, steps)].sum()) / total
        cost = _cost(dropped, steps)
        if cost < best_cost:
            best, best_cost = steps, cost
    return best


def _choose_steps(v32: np.ndarray, scale: float, work: np.ndarray | None = None) -> int:
    """The grid with the lowest predicted TV(p, p*) (``work``: scratch of
    ``v32``'s size and itemsize, or None).

    A finer grid halves the rounding error but covers half as many octaves, so
    entries below its floor are dropped. Rounding in the log domain leaves a
    relative error spread evenly over ``±ln2 / (2 s)``, which costs about
    ``kept_mass * ln2 / (8 s)`` in TV; dropping costs the dropped mass. Both are
    cheap to predict, so the encoder picks the minimum (the decoder only reads
    the choice).

    Each dropped mass is one float32 pass over the bit patterns (an entry is under
    a floor exactly when its bits are under the floor's, rounded up to float32),
    and most are never needed: the dropped mass only grows with ``s``, so a grid's
    cost is at least its own rounding term plus the mass a coarser grid already
    drops, and grids whose bound exceeds the best cost so far are skipped (a dense
    row needs two passes, a sharp one none when its smallest entry is above every
    floor). Predicted costs within :data:`_TIE` of each other are settled by
    :func:`_choose_steps_exact` (float32 sums are good to ~1e-6).
    """
    total = float(v32.sum())
    if not (total > 0 and math.isfinite(total)):
        return _choose_steps_exact(v32, scale)
    bits = v32.view(np.int32)
    buf = np.empty_like(bits) if work is None else work.view(np.int32)
    # the smallest non-zero entry's bits (0 wraps round to the largest): a grid whose
    # floor is at or under it drops nothing
    smallest = int(np.subtract(v32.view(np.uint32), np.uint32(1),
                               out=buf.view(np.uint32)).min()) + 1

    def dropped(steps: int) -> float:
        floor = _floor(scale, steps)
        f = np.float32(floor)
        if float(f) < floor:
            f = np.nextafter(f, np.float32(np.inf))
        if int(f.view(np.int32)) <= smallest:
            return 0.0
        np.subtract(bits, f.view(np.int32), out=buf)  # negative where bits < floor's
        np.right_shift(buf, 31, out=buf)  # all ones there, else 0 (-0.0's bits wrap)
        np.bitwise_and(buf, bits, out=buf)
        return float(buf.view(np.float32).sum()) / total

    def bound(steps: int) -> float:  # no grid costs less than this
        below = max((d for s, d in known.items() if s < steps), default=0.0)
        return _cost(below, steps)

    known: dict[int, float] = {}
    # coarse grids typically win on dense rows: start there and go finer
    order = [*_LOG_STEPS[1:], _LOG_STEPS[0]]
    best = np.inf
    for steps in order:
        if bound(steps) > best * (1 + _TIE):
            continue
        known[steps] = dropped(steps)
        best = min(best, _cost(known[steps], steps))
    costs = {s: _cost(d, s) for s, d in known.items()}
    ranked = sorted(costs.values())
    if len(ranked) > 1 and ranked[1] - ranked[0] <= _TIE * ranked[1]:
        return _choose_steps_exact(v32, scale)
    return min(costs, key=lambda s: costs[s])


def _on_log_lattice(x: float, scale: float) -> bool:
    """Whether ``x`` is ``scale * 2^(-K/128)`` rounded to float32 for some ``K >= 0``:
    a point of the 128-steps grid extended below its 255 codes. Every log grid's
    levels lie on it (a grid of ``s`` steps writes its ``k``-th level as the
    lattice's ``k * 128 / s``-th, the same fraction and octave, so the same bits),
    so an entry off it is on no grid: one scalar test spares a raw row the search
    for the grid a committed vector is on."""
    if not 0.0 < x <= scale:
        return False
    k = round(-math.log2(x / scale) * 128)
    if k < 0:
        return False
    return float(np.float32(math.ldexp(scale * float(_LOG_FRACTIONS[k % 128]), -(k // 128)))) == x


def _first_nonzeros(v32: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` non-zero entries (all of them if fewer), in order."""
    end = 1024
    while True:
        idx = np.flatnonzero(v32[:end] != 0)
        if idx.size >= k or end >= v32.size:
            return v32[idx[:k]]
        end *= 16


class Q8(Codec):
    """8-bit codes against the vector's maximum; ``kind`` picks the quantiser."""

    KINDS = ("log", "lin", "sqrt")

    def __init__(self, kind: str = "log") -> None:
        if kind not in self.KINDS:
            raise CodecError(f"q8: unknown quantiser {kind!r}; known: {self.KINDS}")
        self.kind = kind
        self.name = "q8" if kind == "log" else f"q8:{kind}"
        self._levels = {"log": _levels_log, "lin": _levels_lin, "sqrt": _levels_sqrt}[kind]

    def _codes_exact(self, v: np.ndarray, scale: float, steps: int) -> np.ndarray:
        """The quantiser's definition: float64, nearest code (before flushing)."""
        v64 = v.astype(np.float64)
        if self.kind == "lin":
            c = np.rint(v64 * (255.0 / scale))
        elif self.kind == "sqrt":
            c = np.rint(np.sqrt(v64 / scale) * 255.0)
        else:
            with np.errstate(divide="ignore"):
                k = np.rint(-np.log2(v64 / scale) * steps)
            c = np.where(v64 > 0, 255.0 - np.minimum(k, 255.0), 0.0)
        return np.clip(c, 0, 255).astype(np.uint8)

    def _estimate(self, v32: np.ndarray, scale: float, steps: int, lowest: int,
                  out: np.ndarray) -> np.ndarray:
        """Each entry's code position plus one half in float32, in ``out`` (the code
        is its floor), within 2e-3 of the float64 formula's; positions under
        ``lowest - 1`` (zeros among them) are raised to it.

        Entries far below the scale (zeros and subnormals among them) are raised
        first, on their bits, to a normal number that still codes to 0: float
        arithmetic on zeros and subnormals takes a slow path on x86.
        """
        octaves = 20 if self.kind != "log" else 40  # code 0 from there down
        low = np.float32(scale * 2.0 ** -octaves).view(np.int32)
        # as int32, -0.0 is the most negative: it is raised too
        x = np.maximum(v32.view(np.int32), low, out=out.view(np.int32)).view(np.float32)
        if self.kind == "lin":
            x *= np.float32(255.0 / scale)
        elif self.kind == "sqrt":
            x *= np.float32(1.0 / scale)
            np.sqrt(x, out=x)
            x *= np.float32(255.0)
        if self.kind != "log":
            x += np.float32(0.5)
            return x
        # 255 + s * log2(v / scale), with v scaled by a power of two (exactly) so
        # that the scale lands in [1, 2) and float32's log2 is precise where it matters
        m, e = math.frexp(scale)
        x *= np.float32(2.0 ** (1 - e))
        np.log2(x, out=x)
        x *= np.float32(steps)
        x += np.float32(255.5 - steps * math.log2(2.0 * m))
        np.maximum(x, np.float32(lowest - 0.5), out=x)
        return x

    def _codes(self, v32: np.ndarray, scale: float, steps: int, levels: np.ndarray,
               work: np.ndarray) -> np.ndarray:
        """The codes of ``v32``: nearest by :meth:`_codes_exact`, then those whose
        level is 0 (subnormal) sent as 0 (``work``: float32 scratch of its size)."""
        lowest = int(np.argmax(levels[1:] > 0)) + 1  # levels[255] = scale > 0
        if _FAST_SCALES[0] <= scale <= _FAST_SCALES[1]:
            y = self._estimate(v32, scale, steps, lowest, work)
            codes = y.astype(np.uint8)  # nearest, ties up (ties are redone below)
            y -= codes
            y -= np.float32(0.5)
            np.abs(y, out=y)  # 0.5 - the distance from the rounding boundary
            near = np.flatnonzero(y > _NEAR)
            if near.size:
                codes[near] = self._codes_exact(v32[near], scale, steps)
        else:
            codes = self._codes_exact(v32, scale, steps)
        if lowest > 1:  # levels that decode to 0 are sent as 0
            codes[codes < lowest] = 0
        return codes

    def _on_grid(self, v32: np.ndarray, sample: np.ndarray, scale: float, steps: int,
                 work: np.ndarray, codes: np.ndarray | None = None) -> np.ndarray | None:
        """``v32``'s codes on the log grid of ``steps`` if every entry is exactly one
        of its levels, else None (a raw row fails on ``sample``, its first few
        non-zero entries, before any full pass)."""
        levels = self._levels(scale, steps)
        if not np.array_equal(levels[self._codes_exact(sample, scale, steps)], sample):
            return None
        if codes is None:
            codes = self._codes(v32, scale, steps, levels, work)
        return codes if np.array_equal(np.take(levels, codes, out=work), v32) else None

    def encode(self, v: np.ndarray) -> bytes:
        v32 = check_input(v, self.name)
        scale = float(v32.max()) if v32.size else 0.0
        if scale == 0.0:
            return _HEAD.pack(0.0, 0) + bytes(v32.size)
        # one scratch vector for every pass: fresh megabyte temporaries cost page
        # faults on each call
        work = np.empty_like(v32)
        steps = _choose_steps(v32, scale, work) if self.kind == "log" else 0
        codes = self._codes(v32, scale, steps, self._levels(scale, steps), work)
        if self.kind == "log":
            sample = _first_nonzeros(v32, _SAMPLE)
            if (_on_log_lattice(float(sample[0]), scale)
                    and self._on_grid(v32, sample, scale, steps, work, codes) is None):
                # A vector that already lies on another grid (a committed vector)
                # keeps it, so that commit(commit(v)) == commit(v) whatever the cost
                # model says.
                for other in _LOG_STEPS:
                    exact = None if other == steps else self._on_grid(v32, sample, scale,
                                                                      other, work)
                    if exact is not None:
                        steps, codes = other, exact
                        break
        # the maximum gets code 255 (its log position is exactly 0 steps below the
        # scale; lin and sqrt land on 255 within float64 rounding)
        param = _LOG_STEPS.index(steps) if steps else 0
        return _HEAD.pack(scale, param) + codes.tobytes()

    def decode(self, data: Buffer, n: int) -> np.ndarray:
        mv = memoryview(data).cast("B")
        if mv.nbytes != n + _HEAD.size:
            raise CodecError(f"{self.name}: {mv.nbytes} bytes cannot hold {n} codes + header")
        scale, param = _HEAD.unpack_from(mv, 0)
        if not (np.isfinite(scale) and scale >= 0):
            raise CodecError(f"{self.name}: bad scale {scale!r}")
        if param >= (len(_LOG_STEPS) if self.kind == "log" else 1):
            raise CodecError(f"{self.name}: bad grid byte {param}")
        codes = np.frombuffer(mv, dtype=np.uint8, offset=_HEAD.size)
        top = int(codes.max()) if n else 0
        if (scale == 0.0 and top != 0) or (scale > 0 and top != 255):
            raise CodecError(f"{self.name}: codes do not match the scale "
                             f"(scale {scale!r}, largest code {top})")
        steps = _LOG_STEPS[param] if self.kind == "log" else 0
        # every output is one of the 256 levels: check those, not the whole vector
        return np.take(check_output(self._levels(scale, steps), self.name), codes)

    def max_encoded_size(self, n: int) -> int:
        return n + _HEAD.size

    def encoded_size(self, v: np.ndarray) -> int:
        return int(np.shape(v)[0]) + _HEAD.size
