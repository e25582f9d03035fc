"""A round's random numbers, counted rather than streamed: the one randomness model
of the cloud's verification, on the host and on an accelerator alike.

A stateful generator (``numpy.random.Generator``) hands out numbers in the order they
are asked for, so what a round draws would depend on every draw its session made
before it: a round could not be verified from its own inputs, a restarted cloud
would replay the session's stream from its start, and the host's draws could never
be the device's. Here every uniform is named by ``(key, round, stream, index)``: the
key is the session's seed, the round its number, the stream says what the number is
for, and the index counts the draws of that stream in that round. The bits are
Philox4x64-10's (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC'11), a keyed bijection of a counter, as numpy implements it in C
(``numpy.random.Philox``: a bit stream numpy keeps stable across versions, NEP 19):
keyed by the seed, its counter ``(index // 4 + 1, 0, stream, round)``, word
``index % 4`` of the block, whose top 53 bits make the uniform. One counter gives
four uniforms, and a stream's numbers for a round cost one call into C (about as
much as two draws from a stateful generator), where Philox in Python integers costs
microseconds per number. So a round's verdict and each follow-up's answer are pure
functions of the round's plain data and the target's rows.

The streams (the accelerator's, :mod:`xcosd.accel.verify`, use the same):

* :data:`ACCEPT`: the accept tests, one per tested draft (a chain's position, in
  order; a tree's tested children, in the walk's order);
* :data:`TOKEN`: a token drawn from a row (the bonus, a terminal or a residual token);
* :data:`OTHER`: a token of ``V_O`` (hybrid resampling's presample, its ``other``);
* :data:`CANDIDATES` ``+ c``: SR-DV's ``c``-th round of candidates.

A round's legitimate answers never draw the same stream twice (the presample and the
``other`` follow-up exclude each other; each candidate round has its own stream), so
every number a device conditions on is a fresh one. A follow-up asked again gets the
same answer, where a stateful stream would hand a hostile peer a fresh draw for each
repeat. The stream objects here have the one method the host's draws call,
``random(size=None)``, so every host method draws from them unchanged.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Protocol, overload

import numpy as np


class Uniforms(Protocol):
    """What every host draw takes: ``numpy.random.Generator`` (sequential, where that
    is the design: a device's drafts, simulations) or a round's :class:`Stream`."""

    @overload
    def random(self) -> float: ...
    @overload
    def random(self, size: int) -> Any: ...


#: the stream numbers of a round's counters (see the module docstring)
ACCEPT, TOKEN, OTHER, CANDIDATES = 0, 1, 2, 3

_MASK64 = (1 << 64) - 1
_SCALE = 1.0 / (1 << 53)
#: past this many uniforms at once a stream asks numpy's C implementation (one call
#: into C, about 4 us); up to it, Philox in Python integers (about 3 us per counter, four
#: uniforms each: a round's accept tests and its token draw take one counter each)
_IN_C = 8
_local = threading.local()
_M0, _M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
_W0, _W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B


@functools.lru_cache(maxsize=4096)
def _schedule(k0: int, k1: int) -> tuple[tuple[int, int], ...]:
    """The ten round keys under ``(k0, k1)`` (a session's rounds share its key)."""
    out = []
    for r in range(10):
        if r:
            k0 = (k0 + _W0) & _MASK64
            k1 = (k1 + _W1) & _MASK64
        out.append((k0, k1))
    return tuple(out)


def philox4x64(counter: tuple[int, int, int, int], key: tuple[int, int]
               ) -> tuple[int, int, int, int]:
    """Philox4x64-10 of ``counter`` under ``key`` in Python integers: numpy's bits
    (tested against ``numpy.random.Philox`` and Random123's known answers)."""
    c0, c1, c2, c3 = counter
    for k0, k1 in _schedule(*key):
        p0 = c0 * _M0
        p1 = c2 * _M1
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & _MASK64, (p0 >> 64) ^ c3 ^ k1, p0 & _MASK64
    return c0, c1, c2, c3


def _counter_uniforms(key: int, round_: int, stream: int, b: int) -> list[float]:
    """The four uniforms of counter block ``b`` (indices ``4b .. 4b + 3``)."""
    words = philox4x64((b + 1, 0, stream & _MASK64, round_ & _MASK64), (key, 0))
    return [(w >> 11) * _SCALE for w in words]


def _generator() -> np.random.Philox:
    """This thread's Philox (a bit generator's state is not shared across threads:
    the scheduler's worker and the event loop draw at once)."""
    bg = getattr(_local, "bg", None)
    if bg is None:
        bg = _local.bg = np.random.Philox(key=0)
    return bg


def block(key: int, round_: int, stream: int, start: int, n: int) -> np.ndarray:
    """The uniforms at indices ``start .. start + n - 1`` of ``(key, round, stream)``
    (float64 in ``[0, 1)``, 53 random bits each); ``start`` a multiple of 4."""
    bg = _generator()
    bg.state = {
        "bit_generator": "Philox",
        "state": {"counter": np.array([start // 4, 0, int(stream) & _MASK64,
                                       int(round_) & _MASK64], dtype=np.uint64),
                  "key": np.array([int(key) & _MASK64, 0], dtype=np.uint64)},
        "buffer": np.zeros(4, dtype=np.uint64), "buffer_pos": 4,
        "has_uint32": 0, "uinteger": 0,
    }
    return (bg.random_raw(n) >> np.uint64(11)).astype(np.float64) * _SCALE


def uniforms(key: Any, round_: Any, stream: Any, index: Any) -> np.ndarray:
    """The uniform at each broadcast element of ``(key, round, stream, index)``: the
    accelerator's draws for a batch of sessions, one :func:`block` per distinct
    ``(key, round, stream)``."""
    k, r, s, i = np.broadcast_arrays(*(np.asarray(a, dtype=np.uint64)
                                       for a in (key, round_, stream, index)))
    out = np.empty(k.shape, dtype=np.float64)
    if not out.size:
        return out
    fi, fo = i.reshape(-1).astype(np.int64), out.reshape(-1)
    triples = np.stack([a.reshape(-1) for a in (k, r, s)], axis=1)
    uniq, inv = np.unique(triples, axis=0, return_inverse=True)
    order = np.argsort(inv.reshape(-1), kind="stable")
    bounds = np.searchsorted(inv.reshape(-1)[order], np.arange(len(uniq) + 1))
    for g, (gk, gr, gs) in enumerate(uniq.tolist()):
        members = order[bounds[g]:bounds[g + 1]]
        idx = fi[members]
        top = int(idx.max()) + 1
        vals = (Stream(gk, gr, gs).random(top) if top > 1
                else np.array([Stream(gk, gr, gs).random()]))
        fo[members] = vals[idx]
    return out


class Stream:
    """The uniforms of one ``(key, round, stream)``, index 0, 1, 2 ... in the order they
    are asked for: a stand-in for ``numpy.random.Generator`` where only ``random`` is
    called. Computed a counter (four) at a time, or in one call into C when many are
    asked for at once."""

    __slots__ = ("_cache", "_index", "_key", "_round", "_stream")

    def __init__(self, key: int, round_: int, stream: int) -> None:
        self._key = int(key) & _MASK64
        self._round = int(round_)
        self._stream = int(stream)
        self._index = 0
        self._cache: list[float] = []

    @property
    def drawn(self) -> int:
        """How many uniforms this stream handed out."""
        return self._index

    @overload
    def random(self, size: None = None) -> float: ...
    @overload
    def random(self, size: int) -> np.ndarray: ...

    def random(self, size: int | None = None) -> Any:
        start = self._index
        n = 1 if size is None else int(size)
        self._index = start + n
        self._cover(start + n)
        if size is None:
            return self._cache[start]
        return np.array(self._cache[start:start + n], dtype=np.float64)

    def at(self, index: int) -> float:
        """The uniform at ``index`` (a draw named by its position, as the accelerator
        names it: a chain's accept test by the draft's position, a tree's by the
        node), leaving the running index alone."""
        self._cover(int(index) + 1)
        return self._cache[int(index)]

    def _cover(self, n: int) -> None:
        cache = self._cache
        have = len(cache)  # always a multiple of 4
        if n <= have:
            return
        if n - have > _IN_C:
            cache.extend(block(self._key, self._round, self._stream, have,
                               -(-(n - have) // 4) * 4).tolist())
            return
        while len(cache) < n:
            cache.extend(_counter_uniforms(self._key, self._round, self._stream,
                                           len(cache) // 4))


class RoundDraws:
    """The random numbers of round ``round`` of the session keyed ``key``: each
    :meth:`stream` starts at index 0, so the same round verified again (a restarted
    cloud, the same call on another thread) draws the same numbers."""

    __slots__ = ("key", "round")

    def __init__(self, key: int, round_: int) -> None:
        self.key = int(key) & _MASK64
        self.round = int(round_)

    def stream(self, stream: int) -> Stream:
        return Stream(self.key, self.round, stream)


#: what a round's verification takes: its counters, or a plain sequential generator
#: (simulations and tests that verify without a session)
Draws = Uniforms | RoundDraws


def stream_of(rng: Draws, stream: int) -> Uniforms:
    """``rng``'s numbers for ``stream``: that stream of a round's counters, or a plain
    generator (or a stream already chosen) as it is."""
    return rng.stream(stream) if isinstance(rng, RoundDraws) else rng


def draw_at(rng: Uniforms, index: int) -> float:
    """The uniform a draw named ``index`` takes: a counted stream's at that index, a
    sequential generator's next."""
    return rng.at(index) if isinstance(rng, Stream) else float(rng.random())


__all__ = ["ACCEPT", "CANDIDATES", "OTHER", "TOKEN", "Draws", "RoundDraws", "Stream",
           "Uniforms", "block", "draw_at", "philox4x64", "stream_of", "uniforms"]
