"""A round's random numbers, counted rather than streamed: the one randomness model
of the cloud's verification, on the host and on an accelerator alike.

A stateful generator (``numpy.random.Generator``) hands out numbers in the order they
are asked for, so what a round draws would depend on every draw its session made
before it: a round could not be verified from its own inputs, a restarted cloud
would replay the session's stream from its start, and the host's draws could never
be the device's. Here every uniform is named by ``(key, round, stream, index)``: the
key is the session's seed, the round its number, the stream says what the number is
for, and the index counts the draws of that stream in that round. A uniform is made
by a keyed pseudorandom function of that name: BLAKE2b (RFC 7693) keyed by the seed's
8 bytes, of the message ``(round, stream, index // 8)`` as three little-endian
64-bit words, its 64-byte digest read as eight little-endian 64-bit words, word
``index % 8`` of which gives the uniform by its top 53 bits. A counter-based
generator, as Philox is (Salmon et al., "Parallel random numbers: as easy as 1, 2,
3", SC'11, use AES and Threefry the same way), whose one call (eight numbers) costs
about as much as two draws from numpy's ``Generator`` on the host, where setting a
counter-based bit generator's state costs ten. So a round's verdict and each
follow-up's answer are pure functions of the round's plain data and the target's
rows.

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

import hashlib
import struct
from functools import lru_cache
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
#: uniforms one call makes (a 64-byte digest)
PER_CALL = 8
_MESSAGE = struct.Struct("<QQQ")
_WORDS = struct.Struct("<8Q")
_WORD = struct.Struct("<Q")
_DIGEST = 8 * PER_CALL
_SHIFT = np.uint64(11)
_U64 = np.dtype("<u8")


@lru_cache(maxsize=4096)
def _keyed(key: int) -> Any:
    """BLAKE2b keyed by ``key``, to be copied: keying compresses one whole block, as
    much work as a round's message, so a session's rounds key it once (a few thousand
    sessions' keys kept; one evicted is keyed again, the same bits)."""
    return hashlib.blake2b(key=key.to_bytes(8, "little"), digest_size=64)


def _digest(key: int, round_: int, stream: int, call: int) -> bytes:
    """Call ``call`` of ``(key, round, stream)``, each in ``[0, 2**64)``: the 64 bytes
    whose eight little-endian words give its uniforms (the module docstring's layout,
    written here only)."""
    h = _keyed(key).copy()
    h.update(_MESSAGE.pack(round_, stream, call))
    return h.digest()


@lru_cache(maxsize=256)
def _words_format(n: int) -> struct.Struct:
    """The layout of ``n`` words from a digest's start."""
    return struct.Struct(f"<{n}Q")


def block(key: int, round_: int, stream: int, start: int, n: int) -> list[float]:
    """The ``n`` uniforms from index ``start`` (a multiple of :data:`PER_CALL`) of
    ``(key, round, stream)``: float64 in ``[0, 1)``."""
    k, r, st = int(key) & _MASK64, int(round_) & _MASK64, int(stream) & _MASK64
    out: list[float] = []
    for g in range(start // PER_CALL, -(-(start + n) // PER_CALL)):
        out.extend([(w >> 11) * _SCALE for w in _WORDS.unpack(_digest(k, r, st, g))])
    return out[:n]


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
        fo[members] = np.asarray(block(gk, gr, gs, 0, int(idx.max()) + 1))[idx]
    return out


class Stream:
    """The uniforms of one ``(key, round, stream)``, index 0, 1, 2 ... in the order they
    are asked for: a stand-in for ``numpy.random.Generator`` where only ``random`` is
    called. The first :data:`PER_CALL` are hashed as it is made (a stream is made to
    be drawn from, and a round's draws rarely go past them), the rest as they are
    needed. The digests are kept as bytes and read as they are handed out: a few
    words by ``struct``, many by one numpy view. (A round draws from two or three
    streams, and on a small vocabulary their Python calls are a fair part of its
    verification's cost.)"""

    __slots__ = ("_index", "_key", "_raw", "_round", "_stream")

    def __init__(self, key: int, round_: int, stream: int) -> None:
        # each already in [0, 2**64): made by stream_of / RoundDraws.stream
        self._key = key
        self._round = round_
        self._stream = stream
        self._index = 0
        self._raw = _digest(key, round_, stream, 0)

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
        if size is None:
            self._index = start + 1
            # the first call's words are hashed as the stream is made
            raw = self._raw if start < PER_CALL else self._cover(start + 1)
            return (_WORD.unpack_from(raw, start << 3)[0] >> 11) * _SCALE
        n = int(size)
        self._index = start + n
        raw = self._raw if start + n <= PER_CALL else self._cover(start + n)
        # (w >> 11) < 2**53 converts to float64 exactly, and 2**-53 scales exactly: the
        # same bits as the one-at-a-time path
        return (np.frombuffer(raw, dtype=_U64, count=n, offset=start << 3) >> _SHIFT) * _SCALE

    def first(self, n: int) -> list[float]:
        """The uniforms at indices ``0 .. n - 1`` (a chain's accept tests, named by
        position), leaving the running index alone."""
        raw = self._raw if n <= PER_CALL else self._cover(n)
        return [(w >> 11) * _SCALE for w in _words_format(n).unpack_from(raw)]

    def at(self, index: int) -> float:
        """The uniform at ``index`` (a draw named by its position, as the accelerator
        names it: a chain's accept test by the draft's position, a tree's by the
        node), leaving the running index alone."""
        i = int(index)
        raw = self._raw if i < PER_CALL else self._cover(i + 1)
        return (_WORD.unpack_from(raw, i << 3)[0] >> 11) * _SCALE

    def _cover(self, n: int) -> bytes:
        """The digests, hashed up to index ``n`` at least (whole calls kept; those
        already hashed, as they are)."""
        if n <= len(self._raw) >> 3:
            return self._raw
        raw = self._raw
        for g in range(len(raw) // _DIGEST, -(-n // PER_CALL)):
            raw += _digest(self._key, self._round, self._stream, g)
        self._raw = raw
        return self._raw


class RoundDraws:
    """The random numbers of round ``round`` of the session keyed ``key``: each
    :meth:`stream` starts at index 0, so the same round verified again (a restarted
    cloud, the same call on another thread) draws the same numbers."""

    __slots__ = ("key", "round")

    def __init__(self, key: int, round_: int) -> None:
        self.key = int(key) & _MASK64
        self.round = int(round_) & _MASK64

    def stream(self, stream: int) -> Stream:
        return Stream(self.key, self.round, stream & _MASK64)


#: what a round's verification takes: its counters, or a plain sequential generator
#: (simulations and tests that verify without a session)
Draws = Uniforms | RoundDraws


def stream_of(rng: Draws, stream: int) -> Uniforms:
    """``rng``'s numbers for ``stream``: that stream of a round's counters, or a plain
    generator (or a stream already chosen) as it is."""
    if isinstance(rng, RoundDraws):
        return Stream(rng.key, rng.round, stream & _MASK64)
    return rng


def draw_at(rng: Uniforms, index: int) -> float:
    """The uniform a draw named ``index`` takes: a counted stream's at that index, a
    sequential generator's next."""
    return rng.at(index) if isinstance(rng, Stream) else float(rng.random())


__all__ = ["ACCEPT", "CANDIDATES", "OTHER", "PER_CALL", "TOKEN", "Draws", "RoundDraws", "Stream",
           "Uniforms", "block", "draw_at", "stream_of", "uniforms"]
