"""What every resampling method shares: the round's messages, the accept test, the
commit rule, and the :class:`Method` interface split into server and device halves.

A round (``docs/METHODS.md``, "One round"): the device drafts ``d`` tokens from its TLI
distribution ``q_i`` (over V_C) and uplinks a :class:`Draft`; the server scores the
block once, runs :func:`verify` on the *committed* rows ``p*`` and answers with a
:class:`Verdict`. On a rejection the method decides what crosses the link
(:meth:`Method.on_reject`) and how the device turns it into a token
(:meth:`Method.resolve`), possibly after follow-up requests
(:meth:`Method.on_request`). Everything here is pure: no sockets, no clocks, and
randomness only through the ``numpy.random.Generator`` passed in.

Vectors on the device are in **V_C order** (the target ids of V_C, ascending);
vectors on the server are over all target ids. :class:`Space` converts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Any, ClassVar, Protocol

import numpy as np

from ..codecs import Codec, get_codec
from ..draws import ACCEPT, CANDIDATES, OTHER, TOKEN, Draws, Stream, Uniforms, stream_of
from ..errors import InvalidDistribution, ProtocolError
from ..sampling import Rows, WarpedRows, sample_index
from .shape import TreeShape

#: bytes per token id and per float32 value as counted before framing
ID_BYTES = 4
VALUE_BYTES = 4


# --------------------------------------------------------------------------- space


class Space:
    """The target vocabulary split into V_C (in V_C order) and V_O.

    Built from a :class:`~xcosd.vocab.VocabMap` on real vocabularies, or from a
    bool mask over target ids in tests and simulations.
    """

    def __init__(self, target_size: int, common_ids: np.ndarray, other_mask: np.ndarray | None = None):
        self.target_size = int(target_size)
        self.common_ids = np.ascontiguousarray(np.asarray(common_ids, dtype=np.int64))
        if self.common_ids.size == 0:
            raise InvalidDistribution("V_C is empty: the two vocabularies share no token")
        if np.any(np.diff(self.common_ids) <= 0):
            raise ValueError("common_ids must be strictly ascending target ids (V_C order)")
        self.to_common = np.full(self.target_size, -1, dtype=np.int64)
        self.to_common[self.common_ids] = np.arange(self.common_ids.shape[0])
        if other_mask is None:
            other_mask = self.to_common < 0
        self.other_mask = np.asarray(other_mask, dtype=bool)
        self.other_ids = np.flatnonzero(self.other_mask)

    @classmethod
    def from_mask(cls, common: np.ndarray) -> Space:
        mask = np.asarray(common, dtype=bool)
        return cls(mask.shape[0], np.flatnonzero(mask))

    @classmethod
    def from_vocab_map(cls, vmap: Any) -> Space:
        return cls(vmap.target.size, vmap.common_target_ids, vmap.other_mask)

    @property
    def n_common(self) -> int:
        return int(self.common_ids.shape[0])

    @cached_property
    def common_mask(self) -> np.ndarray:
        return self.to_common >= 0

    @cached_property
    def common_bytes(self) -> bytes:
        """:attr:`common_mask` as one byte per target id: a few ids are looked up in it
        in Python, where indexing the array costs a numpy call per id."""
        return self.common_mask.tobytes()

    def expand(self, v_common: np.ndarray) -> np.ndarray:
        """A V_C-order vector scattered into a float32 vector over all target ids."""
        out = np.zeros(self.target_size, dtype=np.float32)
        out[self.common_ids] = v_common
        return out


# ------------------------------------------------------------------------ messages


@dataclass(frozen=True, eq=False)
class Draft:
    """Uplink of one round: the drafted tokens as target ids and ``q_i(x_i)``.

    ``q_vectors`` (sd-uplink, uhlm) are the encoded draft vectors in V_C order;
    ``verify_mask`` (uhlm) marks the positions the server must verify.

    A round's block, a chain: the tree of shape ``TreeShape.chain(length)``. Every
    block (this one, or a :class:`~xcosd.methods.tree.DraftTree`) answers what the
    state machines ask of a round the same way: its :attr:`shape` and :attr:`depth`,
    the :meth:`path` a verdict accepts and whether it :meth:`rejects`. So they read
    the block, never its kind, save for the one thing the kinds really differ in:
    :attr:`stays_in_context`. A chain answers as its shape would, without building it.
    """

    #: whether the drafts enter the models' contexts as they are drafted and scored: a
    #: chain's do (its accepted drafts stay in the target's and the draft model's
    #: context, the rejected ones are cut back), a tree's never do (scored off to the
    #: side, its accepted path is appended afterwards, as a bonus token is)
    stays_in_context: ClassVar[bool] = True

    ids: np.ndarray
    q_values: np.ndarray
    q_vectors: tuple[bytes, ...] | None = None
    verify_mask: np.ndarray | None = None
    #: how many drafts (a tree's nodes): ``len(ids)``, kept, as both state machines
    #: and the verification read it several times a round
    length: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "length", len(self.ids))

    @cached_property
    def shape(self) -> TreeShape:
        """Where each draft hangs: from the one before it."""
        return TreeShape.chain(self.length)

    @property
    def depth(self) -> int:
        """The most drafts one path holds (a round commits at most ``depth + 1``
        tokens): all of a chain's."""
        return self.length

    def path(self, n: int) -> list[int]:
        """The drafts a verdict of ``n`` accepts, as node indices from the context
        down (``shape.path(n - 1)``): a chain's first ``n``."""
        return list(range(n))

    def rejects(self, n: int) -> bool:
        """Whether a verdict of ``n`` ends in a rejection (the node it names has
        children, ``shape.children[n]``), not in a bonus token; ``False`` for an
        ``n`` outside ``0..length``. A chain's: ``n`` short of its length."""
        return 0 <= n < self.length

    @property
    def tree_label(self) -> str | None:
        """The shape a round's events report (``RoundSettled.shape``,
        ``RoundVerified.shape``): ``None`` for a chain, whose rounds the draft-length
        policy sizes."""
        return None

    def nbytes(self) -> int:
        n = self.length * (ID_BYTES + VALUE_BYTES)
        if self.q_vectors is not None:
            n += sum(len(b) for b in self.q_vectors)
        if self.verify_mask is not None:
            n += (self.length + 7) // 8
        return n


@dataclass(frozen=True, eq=False)
class TokenReply:
    """One target token chosen by the server (bonus, or a server-side resample)."""

    token: int

    def nbytes(self) -> int:
        return ID_BYTES


@dataclass(frozen=True, eq=False)
class FullVectorReply:
    """Straightforward: ``p_j`` over all of V_T, encoded with the session codec."""

    data: bytes

    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True, eq=False)
class HybridReply:
    """Hybrid resampling: ``p_j`` over V_C (encoded), the scalar ``theta_o`` and,
    with ``hr_presample``, one ``y ~ p_j | V_O`` drawn up front (``other_token``)."""

    data: bytes
    theta_o: float
    other_token: int | None = None

    def nbytes(self) -> int:
        return len(self.data) + VALUE_BYTES + (ID_BYTES if self.other_token is not None else 0)


@dataclass(frozen=True, eq=False)
class CandidatesReply:
    """SR-DV: ``K`` candidates ``y_k ~ p_j`` (target ids) with their values ``p_j(y_k)``."""

    ids: np.ndarray
    values: np.ndarray

    def nbytes(self) -> int:
        return int(self.ids.shape[0]) * (ID_BYTES + VALUE_BYTES)


Reply = TokenReply | FullVectorReply | HybridReply | CandidatesReply


class RequestKind(StrEnum):
    """The follow-ups a device may ask for after a rejection."""

    #: more candidates (SR-DV)
    MORE = "more"
    #: the HR payload instead (SR-DV after ``M`` candidate rounds)
    FALLBACK = "fallback"
    #: one sample from ``p_j`` restricted to V_O (HR when the coin picks V_O)
    OTHER = "other"


class Answer(StrEnum):
    """What the server draws to answer a rejection or a follow-up: a method's server
    half as plain data. A method names its answers (:attr:`Method.rejection`,
    :meth:`Method.follow_up`); the host carries each kind out with numpy
    (:meth:`Method.answer`) and the accelerator with torch, batched over the sessions
    that want the same kind (xcosd/accel/verify.py). So which answer a method gives,
    and which follow-up it refuses, is written once, in the method."""

    #: a token from ``p*_j`` (target-resample)
    TOKEN = "token"
    #: ``argmax p*_j`` (greedy-resample)
    ARGMAX = "argmax"
    #: a token from ``max(0, p*_j - q_j)`` (sd-uplink, uhlm)
    RESIDUAL = "residual"
    #: ``p_j`` whole, encoded (straightforward)
    FULL = "full"
    #: ``p_j`` over V_C and ``theta_o``, a V_O token drawn up front or not (xcosd)
    HYBRID = "hybrid"
    #: ``K`` candidates from ``p*_j`` without ``x_j`` (xcosd-e)
    CANDIDATES = "candidates"
    #: a token from ``p*_j`` restricted to V_O (HR's coin chose V_O)
    OTHER = "other"


def answer_stream(kind: Answer, state: RejectState | Any) -> int:
    """The stream of a round's counters (:mod:`xcosd.draws`) an answer of ``kind``
    draws from, on the host and on the accelerator: a token from a row (``token``,
    ``residual``) ``TOKEN``; a token of ``V_O`` (``other``, and the presample of the
    ``hybrid`` payload, which excludes asking for it) ``OTHER``; SR-DV's ``c``-th
    candidates ``CANDIDATES + c``, ``c`` read before the answer counts it. ``argmax``
    and ``full`` draw nothing."""
    if kind is Answer.CANDIDATES:
        return CANDIDATES + int(state.candidate_rounds)
    if kind in (Answer.OTHER, Answer.HYBRID):
        return OTHER
    return TOKEN


class CommitRule(StrEnum):
    """How a method's codec commits ``p`` (``docs/METHODS.md``, "Choices worth
    knowing"): both the host (:meth:`Method.commit_row`) and the accelerator read it."""

    #: ``p* = p``: no codec on ``p`` (or an exact one)
    NONE = "none"
    #: ``p`` sent whole (straightforward): :func:`~xcosd.methods.commit.committed_full`
    FULL = "full"
    #: ``p`` over V_C plus ``theta_o`` (xcosd, xcosd-e):
    #: :func:`~xcosd.methods.commit.committed_hybrid`
    HYBRID = "hybrid"


@dataclass(frozen=True)
class Request:
    """A device's follow-up after a rejection: ``more`` candidates (SR-DV), the HR
    ``fallback`` payload (SR-DV after ``M`` rounds), or an ``other`` sample (the
    paper's HR variant, when the coin picks V_O)."""

    kind: RequestKind

    KINDS: ClassVar[tuple[RequestKind, ...]] = tuple(RequestKind)

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ProtocolError(f"unknown follow-up request {self.kind!r}", code="bad_message")
        object.__setattr__(self, "kind", RequestKind(self.kind))  # a plain string is typed

    def nbytes(self) -> int:
        return 1


@dataclass(frozen=True, eq=False)
class Verdict:
    """The server's answer to a :class:`Draft`: how many drafts it accepted and the
    method's payload (a bonus :class:`TokenReply` when all were accepted)."""

    accepted: int
    reply: Reply

    def nbytes(self) -> int:
        return ID_BYTES + self.reply.nbytes()


# --------------------------------------------------------------------- round state


@dataclass(eq=False)
class RejectState:
    """What the server keeps about one rejection until the device has its token."""

    p_raw: np.ndarray  # the target row before the codec (float32, over V_T)
    p_star: np.ndarray  # the committed row every decision uses (float32, over V_T)
    rejected: int  # the rejected draft x_j (target id)
    q_common: np.ndarray | None = None  # the device's committed q_j (sd-uplink, uhlm)
    candidate_rounds: int = 0
    fallback_sent: bool = False


class KeptReject(Protocol):
    """A rejection kept where the target's rows are, not in a :class:`RejectState`
    (on an accelerator: ``xcosd.accel.verify.DeviceReject``): its committed row, and
    its follow-ups answered there by the method's own rules. The protocol holds one
    without knowing, or importing, what computes it."""

    p_star: Any
    rejected: int

    def answer(self, method: Method, request: Request, space: Space) -> Reply:
        """The payload of ``request`` (the method says what it draws and when it
        refuses: :meth:`Method.follow_up`)."""
        ...


@dataclass(eq=False)
class DeviceState:
    """What the device keeps about one rejection while it resolves it."""

    q_common: np.ndarray  # q_j in V_C order, exactly the vector x_j was drawn from
    rejected: int
    candidate_rounds: int = 0
    trials: int = 0
    fallbacks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------- pure helpers


def verify(p_star: Rows, ids: np.ndarray, q_values: np.ndarray, rng: Uniforms,
           mask: np.ndarray | None = None) -> int:
    """Standard speculative verification: accept ``x_i`` while ``u < p(x_i)/q(x_i)``.

    ``p_star`` has one committed row per draft position (at least ``len(ids)``).
    One uniform is drawn per *examined* position, in order: a round's counted
    stream names it by the position, as the accelerator does. Positions where
    ``mask`` is False are accepted without a test (uhlm's confident tokens).
    """
    d = int(ids.shape[0])
    named = rng.first(d) if isinstance(rng, Stream) else None
    # as Python numbers once: indexing the arrays costs a numpy call per element
    xs, qs = ids.tolist(), q_values.tolist()
    for i in range(d):
        if mask is not None and not mask[i]:
            continue
        x = xs[i]
        q = float(qs[i])
        p = float(p_star[i, x])
        if not q > 0:
            raise InvalidDistribution(f"draft {i} has q(x) = {q}: a drafted token must have q > 0")
        u = named[i] if named is not None else rng.random()
        if not u * q < p:  # u < p/q without dividing
            return i
    return d


def fixed_total(v: np.ndarray) -> float:
    """The float64 total of ``v`` by a fixed pairwise tree: the vector zero-padded to a
    power of two, then halved (``x[:h] + x[h:]``) until one element is left.

    Every step is one IEEE addition per element, so the bits do not depend on the
    library or the device: ``xcosd.accel.sums.fixed_sum`` adds in the same pattern in
    torch, on a GPU too, and a committed row made there is the one a device decodes here.
    """
    a = np.asarray(v)
    n = a.shape[0]
    if n == 0:
        return 0.0
    width = 1 << (n - 1).bit_length()
    y = np.zeros(width, dtype=np.float64)
    y[:n] = a
    while width > 1:
        width //= 2
        y = y[:width] + y[width:]
    return float(y[0])


def normalise(v: np.ndarray, extra: float = 0.0) -> np.ndarray:
    """``v / (total(v) + extra)`` in float64, rounded to float32: the committed vector.

    Used identically by both sides, so both get the same bits; the total is
    :func:`fixed_total`'s, which the accelerator path reproduces bit for bit.
    """
    total = fixed_total(v) + float(extra)
    if not total > 0:
        raise InvalidDistribution("committed vector has no mass")
    return (np.asarray(v, dtype=np.float64) / total).astype(np.float32)


def residual_sample(p: np.ndarray, q: np.ndarray, rng: Uniforms) -> int:
    """Sample from ``max(0, p - q) / Z``, or from ``p`` when rounding made ``Z == 0``."""
    r = np.maximum(np.asarray(p, dtype=np.float64) - q, 0.0)
    if not r.sum() > 0:
        return sample_index(p, rng)
    return sample_index(r, rng)


# ------------------------------------------------------------------------ methods


class Method:
    """One resampling method: pure server and device halves of a round.

    Subclasses set ``name`` and ``lossless`` and override what differs. The
    defaults are standard speculative decoding's: exact commit (``p* = p``), the
    ratio test, a bonus token on full acceptance.
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    #: False for ``ar``: the device sends no drafts
    drafts: ClassVar[bool] = True
    #: which vector the codec compresses: "p" (downlink), "q" (uplink) or None
    codec_applies_to: ClassVar[str | None] = None
    #: how the codec commits ``p`` (where it applies to ``p``)
    commit_rule: ClassVar[CommitRule] = CommitRule.NONE
    #: what the server answers a rejection with (``None``: ``ar``, which never drafts)
    rejection: ClassVar[Answer | None] = None

    def __init__(self, codec: Codec | str | None = None, **options: Any) -> None:
        self.codec: Codec = get_codec(codec) if isinstance(codec, str) else (codec or get_codec("f32"))
        if options:
            raise TypeError(f"{self.name}: unknown options {sorted(options)}")

    def __repr__(self) -> str:
        return f"<method {self.name} codec={self.codec.name}>"

    def options(self) -> dict[str, Any]:
        """The method's own options, as sent in the session handshake."""
        return {}

    # -- device: drafting ---------------------------------------------------

    def draft_row(self, q_common: np.ndarray) -> np.ndarray:
        """The vector the device samples draft ``i`` from (sd-uplink commits it)."""
        return q_common

    def draft_message(self, ids: np.ndarray, q_rows: list[np.ndarray], space: Space) -> Draft:
        """Uplink for drafts ``ids`` (target ids) drawn from ``q_rows`` (V_C order)."""
        pos = space.to_common[ids].tolist()
        # .item: Python floats (exact for float32 values), not numpy scalars to inspect
        q_values = np.array([q.item(p) for q, p in zip(q_rows, pos, strict=True)],
                            dtype=np.float32)
        return Draft(ids=np.asarray(ids, dtype=np.int64), q_values=q_values)

    # -- server -------------------------------------------------------------

    def commit_row(self, p: np.ndarray, space: Space) -> np.ndarray:
        """The committed row ``p*`` every decision uses (``p`` itself by default)."""
        return np.asarray(p, dtype=np.float32)

    def commit_rows(self, rows: Rows, space: Space) -> Rows:
        """:meth:`commit_row` for each row of a verified block (one call per block).

        Where the commit is the identity, a block warped on demand
        (:class:`~xcosd.sampling.WarpedRows`) stays so: verification then warps only
        the rows it reads."""
        if self.codec_applies_to != "p" or self.codec.exact:
            return rows if isinstance(rows, WarpedRows) else np.asarray(rows, dtype=np.float32)
        return np.stack([self.commit_row(r, space) for r in np.asarray(rows, dtype=np.float32)])

    def verify(self, p_star: Rows, draft: Draft, space: Space, rng: Draws) -> int:
        return verify(p_star, draft.ids, draft.q_values, stream_of(rng, ACCEPT))

    def server_q(self, draft: Draft, j: int, space: Space) -> np.ndarray | None:
        """The device's q_j as the server knows it (only methods that uplink vectors)."""
        return None

    def bonus(self, p_star: np.ndarray, rng: Draws) -> TokenReply:
        return TokenReply(sample_index(p_star, stream_of(rng, TOKEN)))

    def on_reject(self, state: RejectState, space: Space, rng: Draws) -> Reply:
        """The payload of a rejection: :attr:`rejection`, drawn on the host."""
        if self.rejection is None:
            raise ProtocolError(f"{self.name} sends no drafts to reject", code="internal")
        kind = self.rejection
        return self.answer(kind, state, space, stream_of(rng, answer_stream(kind, state)))

    def follow_up(self, state: RejectState | Any, request: Request) -> Answer:
        """What ``request`` asks the server to draw after a rejection, once checked
        against the method's limits (a typed ``bad_request`` otherwise), with
        ``state`` marked for what the answer commits to (SR-DV's fallback). The host
        and the accelerator both ask this, each with its own kind of ``state``."""
        raise ProtocolError(f"{self.name} takes no follow-up request {request.kind!r}",
                            code="bad_request")

    def on_request(self, state: RejectState, request: Request, space: Space,
                   rng: Draws) -> Reply:
        """A follow-up's payload: :meth:`follow_up`, drawn on the host (from the
        round's stream for that kind: :func:`answer_stream`)."""
        kind = self.follow_up(state, request)
        return self.answer(kind, state, space, stream_of(rng, answer_stream(kind, state)))

    def answer(self, kind: Answer, state: RejectState, space: Space,
               rng: Uniforms) -> Reply:
        """``kind`` drawn on the host, for the kinds every method may give; a method
        whose answers need its own options (HR's payload, SR-DV's candidates) adds
        those."""
        if kind is Answer.TOKEN:
            return TokenReply(sample_index(state.p_star, rng))
        if kind is Answer.ARGMAX:
            return TokenReply(int(np.argmax(state.p_star)))
        if kind is Answer.RESIDUAL:
            assert state.q_common is not None
            return TokenReply(residual_sample(state.p_star, space.expand(state.q_common), rng))
        if kind is Answer.FULL:
            return FullVectorReply(self.codec.encode(state.p_raw))
        raise ProtocolError(f"{self.name} does not answer with {kind}", code="internal")

    # -- device: resolving a rejection -------------------------------------

    def resolve(self, reply: Reply, state: DeviceState, space: Space,
                rng: Uniforms) -> int | Request:
        """The token the device emits, or a follow-up :class:`Request`."""
        if isinstance(reply, TokenReply):
            return reply.token
        raise ProtocolError(f"{self.name} cannot use a {type(reply).__name__}", code="bad_message")
