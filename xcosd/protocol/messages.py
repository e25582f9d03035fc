"""Every message of an xcosd session, and their wire form.

A message on the wire is a msgpack **header** (a map whose key ``"t"`` names the
message type) followed by zero or more raw **buffers**: token ids as little-endian
int32, probabilities as little-endian float32, codec payloads as the codec wrote
them. Arrays never go element by element into msgpack: a 4-token draft costs 32
bytes of buffers, not a msgpack list per value.

Each message type is a frozen dataclass with ``to_wire() -> (header, buffers)``;
:func:`from_wire` turns a decoded header and its buffers back into one, checking
every field's type and every buffer's length. Anything malformed raises
:class:`~xcosd.errors.ProtocolError` with a typed ``code`` (see
:mod:`xcosd.protocol.errors`), so a hostile or broken peer gets a precise error and
never a crash. Checks that need session knowledge (is this id inside the target
vocabulary, is this round the current one) are the state machines' job.

The byte layout of every message is tabulated in ``docs/PROTOCOL.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..errors import ProtocolError
from ..methods.base import (
    CandidatesReply,
    Draft,
    FullVectorReply,
    HybridReply,
    Reply,
    TokenReply,
)

#: Version of the message set; a peer speaking another one is refused (code ``version``).
PROTOCOL_VERSION = 1

#: Bounds on header fields, so a hostile header cannot make us allocate much.
MAX_TEXT = 1 << 20  # prompt text, bytes of UTF-8
MAX_NAME = 128  # method / codec / node names
MAX_MESSAGE = 4096  # human-readable error text
MAX_IDS = 1 << 22  # resume ids, V_C arrays
MAX_BUFFERS = 4096
MAX_OPTIONS = 16
MAX_DRAFT = 1 << 16  # drafted ids per round (and accepted ones in a verdict)
MAX_CANDIDATES = 1 << 16  # candidate ids per reply (and V_O spellings sent with them)
MAX_STOP = 64  # stop ids in a welcome
MAX_PIECE = 4096  # bytes of one V_O token's spelling
#: The largest header a legal message needs: an ``open`` whose prompt has
#: ``MAX_TEXT`` bytes, with every other field at its bound, fits with room to
#: spare. A receiver that accepts prompts must use at least this as its
#: ``max_header_bytes``, or it refuses legal prompts as ``too_large`` before it can
#: tell which session they belong to.
MAX_HEADER_BYTES = MAX_TEXT + (64 << 10)

Header = dict[str, Any]
Buffers = list[bytes]


def _bad(what: str, code: str = "bad_field") -> ProtocolError:
    return ProtocolError(what, code=code)


# ------------------------------------------------------------------ field readers


def _get(h: Mapping[str, Any], key: str, t: str) -> Any:
    try:
        return h[key]
    except KeyError:
        raise _bad(f"{t}: missing field {key!r}") from None


def _int(h: Mapping[str, Any], key: str, t: str, lo: int = 0, hi: int = (1 << 63) - 1,
         optional: bool = False) -> Any:
    if optional and h.get(key) is None:
        return None
    v = _get(h, key, t)
    if type(v) is not int:  # bool is an int subclass: refuse it too
        raise _bad(f"{t}: field {key!r} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise _bad(f"{t}: field {key!r} = {v} outside {lo}..{hi}")
    return v


def _float(h: Mapping[str, Any], key: str, t: str, lo: float = -math.inf,
           hi: float = math.inf) -> float:
    v = _get(h, key, t)
    if type(v) not in (int, float):
        raise _bad(f"{t}: field {key!r} must be a number, got {type(v).__name__}")
    f = float(v)
    if not (math.isfinite(f) and lo <= f <= hi):
        raise _bad(f"{t}: field {key!r} = {v!r} outside [{lo}, {hi}]")
    return f


def _str(h: Mapping[str, Any], key: str, t: str, maxlen: int = MAX_NAME,
         optional: bool = False) -> Any:
    if optional and h.get(key) is None:
        return None
    v = _get(h, key, t)
    if not isinstance(v, str):
        raise _bad(f"{t}: field {key!r} must be a string, got {type(v).__name__}")
    if len(v) > maxlen:
        raise _bad(f"{t}: field {key!r} longer than {maxlen}")
    return v


def _text(h: Mapping[str, Any], key: str, t: str, max_bytes: int) -> str:
    """A string bounded in UTF-8 bytes (what it costs on the wire), not characters."""
    v: str = _str(h, key, t, max_bytes)  # characters <= bytes: a cheap first cut
    if len(v) * 4 > max_bytes and len(v.encode()) > max_bytes:
        raise _bad(f"{t}: field {key!r} longer than {max_bytes} bytes of UTF-8")
    return v


def _bool(h: Mapping[str, Any], key: str, t: str, default: bool | None = None) -> bool:
    if default is not None and key not in h:
        return default
    v = _get(h, key, t)
    if not isinstance(v, bool):
        raise _bad(f"{t}: field {key!r} must be a boolean, got {type(v).__name__}")
    return v


def _nbuf(buffers: Sequence[bytes], n: int, t: str) -> None:
    if len(buffers) != n:
        raise _bad(f"{t}: expected {n} buffers, got {len(buffers)}")


def ids_to_bytes(ids: Any) -> bytes:
    """Token ids as little-endian int32 bytes."""
    return np.ascontiguousarray(np.asarray(ids, dtype=np.int64), dtype="<i4").tobytes()


def bytes_to_ids(buf: bytes, t: str, what: str = "ids", n: int | None = None,
                 max_n: int = MAX_IDS) -> np.ndarray:
    """Little-endian int32 bytes -> int64 ids (checked length, never negative)."""
    if len(buf) % 4:
        raise _bad(f"{t}: {what} buffer of {len(buf)} bytes is not a whole number of int32")
    k = len(buf) // 4
    if (n is not None and k != n) or k > max_n:
        raise _bad(f"{t}: {what} has {k} values, expected {n if n is not None else f'<= {max_n}'}")
    a = np.frombuffer(buf, dtype="<i4").astype(np.int64)
    if k and int(a.min()) < 0:
        raise _bad(f"{t}: {what} contains a negative id", code="bad_token")
    return a


def bytes_to_f32(buf: bytes, t: str, what: str, n: int) -> np.ndarray:
    """Little-endian float32 bytes -> float32 array of exactly ``n`` values."""
    if len(buf) != 4 * n:
        raise _bad(f"{t}: {what} has {len(buf)} bytes, expected {4 * n}")
    return np.frombuffer(buf, dtype="<f4").astype(np.float32)


def check_probs(v: np.ndarray, t: str, what: str) -> None:
    """Probability values must be finite and in [0, 1] (``bad_vector`` otherwise)."""
    if v.size and not (np.all(np.isfinite(v)) and float(v.min()) >= 0.0
                       and float(v.max()) <= 1.0 + 1e-6):
        raise ProtocolError(f"{t}: {what} contains NaN, negative or >1 values",
                            code="bad_vector")


# ----------------------------------------------------------------- base class


@dataclass(frozen=True)
class Message:
    """A protocol message. ``TYPE`` is its header tag ``"t"``."""

    TYPE: ClassVar[str] = ""

    def to_wire(self) -> tuple[Header, Buffers]:
        raise NotImplementedError

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> Message:
        raise NotImplementedError


@dataclass(frozen=True)
class SessionMessage(Message):
    """A message about one session ``s`` (an id the edge picked, unique per edge)."""

    s: int


# ------------------------------------------------------------- connection level


@dataclass(frozen=True)
class Hello(Message):
    """Edge -> cloud, first message of a connection.

    ``target_fp``: fingerprint of the target vocabulary the edge already holds
    (``None``: it holds none and asks for it with ``want_vocab``). ``map_fp``: the
    fingerprint of its V_C map, so the cloud can say whether it must be uploaded.
    """

    TYPE: ClassVar[str] = "hello"
    version: int = PROTOCOL_VERSION
    node: str = ""
    target_fp: str | None = None
    map_fp: str | None = None
    want_vocab: bool = False

    def to_wire(self) -> tuple[Header, Buffers]:
        return {"t": self.TYPE, "v": self.version, "node": self.node, "tfp": self.target_fp,
                "mfp": self.map_fp, "vocab": self.want_vocab}, []

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> Hello:
        t = cls.TYPE
        _nbuf(buffers, 0, t)
        v = _int(h, "v", t, 0, 1 << 31)
        return cls(v, _str(h, "node", t), _str(h, "tfp", t, optional=True),
                   _str(h, "mfp", t, optional=True), _bool(h, "vocab", t, False))


@dataclass(frozen=True)
class ServerLimits:
    """What the cloud accepts; sent in :class:`Welcome` so the edge can comply."""

    max_message: int
    max_sessions: int
    max_draft: int
    heartbeat_s: float
    timeout_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"msg": self.max_message, "sess": self.max_sessions, "draft": self.max_draft,
                "hb": self.heartbeat_s, "to": self.timeout_s}

    @classmethod
    def from_dict(cls, d: Any, t: str) -> ServerLimits:
        if not isinstance(d, dict):
            raise _bad(f"{t}: limits must be a map")
        return cls(_int(d, "msg", t, 1), _int(d, "sess", t, 0), _int(d, "draft", t, 0, MAX_DRAFT),
                   _float(d, "hb", t, 0.0), _float(d, "to", t, 0.0))


@dataclass(frozen=True)
class Welcome(Message):
    """Cloud -> edge: who the cloud is, its target vocabulary and its limits.

    ``server_id`` changes on every cloud start, so an edge that sees a new one
    knows its sessions are gone and resumes them.
    """

    TYPE: ClassVar[str] = "welcome"
    version: int
    server_id: str
    target_name: str
    target_fp: str
    target_size: int
    stop_ids: tuple[int, ...]
    limits: ServerLimits
    map_known: bool

    def to_wire(self) -> tuple[Header, Buffers]:
        return {"t": self.TYPE, "v": self.version, "sid": self.server_id,
                "tname": self.target_name, "tfp": self.target_fp, "tsize": self.target_size,
                "stop": list(self.stop_ids), "lim": self.limits.to_dict(),
                "map": self.map_known}, []

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> Welcome:
        t = cls.TYPE
        _nbuf(buffers, 0, t)
        stop = _get(h, "stop", t)
        if (not isinstance(stop, list) or not all(type(x) is int for x in stop)
                or len(stop) > MAX_STOP):
            raise _bad(f"{t}: stop must be a list of integers")
        return cls(_int(h, "v", t, 0, 1 << 31), _str(h, "sid", t), _str(h, "tname", t),
                   _str(h, "tfp", t), _int(h, "tsize", t, 1, 1 << 31), tuple(stop),
                   ServerLimits.from_dict(_get(h, "lim", t), t), _bool(h, "map", t))


@dataclass(frozen=True)
class VocabRequest(Message):
    """Edge -> cloud: send me the target vocabulary (once per connection, if needed)."""

    TYPE: ClassVar[str] = "vocab_get"

    def to_wire(self) -> tuple[Header, Buffers]:
        return {"t": self.TYPE}, []

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> VocabRequest:
        _nbuf(buffers, 0, cls.TYPE)
        return cls()


@dataclass(frozen=True)
class VocabTable(Message):
    """Cloud -> edge: the target vocabulary's id -> bytes table.

    Buffers: ``kinds`` (uint8 per id: 0 unused, 1 regular, 2 special),
    ``lengths`` (int32 per id), ``blob`` (all token bytes concatenated, zstd-compressed
    when ``compressed``).
    """

    TYPE: ClassVar[str] = "vocab"
    name: str
    fingerprint: str
    roles: dict[str, int]
    kinds: bytes
    lengths: bytes
    blob: bytes
    compressed: bool = True

    def to_wire(self) -> tuple[Header, Buffers]:
        return ({"t": self.TYPE, "name": self.name, "fp": self.fingerprint,
                 "roles": dict(self.roles), "z": self.compressed},
                [self.kinds, self.lengths, self.blob])

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> VocabTable:
        t = cls.TYPE
        _nbuf(buffers, 3, t)
        roles = _get(h, "roles", t)
        if not isinstance(roles, dict) or not all(
                isinstance(k, str) and type(v) is int for k, v in roles.items()):
            raise _bad(f"{t}: roles must map strings to ids")
        return cls(_str(h, "name", t), _str(h, "fp", t), dict(roles), bytes(buffers[0]),
                   bytes(buffers[1]), bytes(buffers[2]), _bool(h, "z", t, True))


@dataclass(frozen=True, eq=False)
class VocabMapUpload(Message):
    """Edge -> cloud: the V_C map (target ids ascending, and their draft ids), sent only
    when the cloud does not know ``fingerprint`` yet. The cloud recomputes the
    fingerprint from the arrays and refuses a mismatch."""

    TYPE: ClassVar[str] = "vmap"
    fingerprint: str
    draft_size: int
    common_target_ids: np.ndarray
    common_draft_ids: np.ndarray

    def to_wire(self) -> tuple[Header, Buffers]:
        return ({"t": self.TYPE, "fp": self.fingerprint, "dsize": self.draft_size},
                [ids_to_bytes(self.common_target_ids), ids_to_bytes(self.common_draft_ids)])

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> VocabMapUpload:
        t = cls.TYPE
        _nbuf(buffers, 2, t)
        ct = bytes_to_ids(buffers[0], t, "common target ids")
        cd = bytes_to_ids(buffers[1], t, "common draft ids", n=ct.shape[0])
        return cls(_str(h, "fp", t), _int(h, "dsize", t, 1, 1 << 31), ct, cd)


@dataclass(frozen=True)
class VocabMapAccepted(Message):
    TYPE: ClassVar[str] = "vmap_ok"
    fingerprint: str

    def to_wire(self) -> tuple[Header, Buffers]:
        return {"t": self.TYPE, "fp": self.fingerprint}, []

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> VocabMapAccepted:
        _nbuf(buffers, 0, cls.TYPE)
        return cls(_str(h, "fp", cls.TYPE))


@dataclass(frozen=True)
class Ping(Message):
    """Heartbeat; either side may send it, the other answers :class:`Pong`."""

    TYPE: ClassVar[str] = "ping"
    n: int = 0

    def to_wire(self) -> tuple[Header, Buffers]:
        return {"t": self.TYPE, "n": self.n}, []

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> Ping:
        _nbuf(buffers, 0, cls.TYPE)
        return cls(_int(h, "n", cls.TYPE))


@dataclass(frozen=True)
class Pong(Message):
    TYPE: ClassVar[str] = "pong"
    n: int = 0

    def to_wire(self) -> tuple[Header, Buffers]:
        return {"t": self.TYPE, "n": self.n}, []

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> Pong:
        _nbuf(buffers, 0, cls.TYPE)
        return cls(_int(h, "n", cls.TYPE))


@dataclass(frozen=True)
class Error(Message):
    """A typed error: ``code`` (see :mod:`xcosd.protocol.errors`), a human message,
    and the session ``s`` / round ``r`` it concerns when there is one."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    s: int | None = None
    r: int | None = None

    def to_wire(self) -> tuple[Header, Buffers]:
        h: Header = {"t": self.TYPE, "code": self.code, "msg": self.message[:MAX_MESSAGE]}
        if self.s is not None:
            h["s"] = self.s
        if self.r is not None:
            h["r"] = self.r
        return h, []

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> Error:
        t = cls.TYPE
        _nbuf(buffers, 0, t)
        return cls(_str(h, "code", t), _str(h, "msg", t, MAX_MESSAGE),
                   _int(h, "s", t, optional=True), _int(h, "r", t, optional=True))


# ---------------------------------------------------------------- session level


@dataclass(frozen=True, eq=False)
class Open(SessionMessage):
    """Edge -> cloud: start session ``s``.

    The prompt travels as **text**: the cloud tokenises it with the target's
    tokenizer (its context is canonical, in target ids) and the device with its
    own. ``resume`` holds target ids already generated, when a session is resumed
    after a cloud restart: the cloud's context becomes prompt + resume, so no token
    is lost or repeated. ``seed`` seeds the cloud's half of the session's
    randomness (``None``: fresh entropy).

    ``prompt_ids``: the prompt as **target ids** instead of text (then ``prompt`` is
    empty), for callers that hold a tokenised context: the cloud's context is exactly
    these ids (no tokenisation, no special tokens added), as if the target had been
    given them. On the wire: header ``"pi": true`` and a second buffer after
    ``resume``; absent, the message is the text form unchanged.
    """

    TYPE: ClassVar[str] = "open"
    seq: int
    map_fp: str
    method: str
    codec: str
    options: dict[str, Any]
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    prompt: str
    max_new_tokens: int
    resume: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    prompt_ids: np.ndarray | None = None

    def to_wire(self) -> tuple[Header, Buffers]:
        h: dict[str, Any] = {
            "t": self.TYPE, "s": self.s, "seq": self.seq, "fp": self.map_fp,
            "m": self.method, "c": self.codec, "o": dict(self.options),
            "T": float(self.temperature), "k": self.top_k, "p": float(self.top_p),
            "seed": self.seed, "prompt": self.prompt, "max": self.max_new_tokens}
        bufs = [ids_to_bytes(self.resume)]
        if self.prompt_ids is not None:
            h["pi"] = True
            bufs.append(ids_to_bytes(self.prompt_ids))
        return h, bufs

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> Open:
        t = cls.TYPE
        by_ids = h.get("pi", False)
        if by_ids is not True and by_ids is not False:
            raise _bad(f"{t}: pi must be a boolean")
        _nbuf(buffers, 2 if by_ids else 1, t)
        opts = _get(h, "o", t)
        if not isinstance(opts, dict) or len(opts) > MAX_OPTIONS or not all(
                isinstance(k, str) and len(k) <= MAX_NAME and type(v) in (int, float, bool)
                for k, v in opts.items()):
            raise _bad(f"{t}: options must map names to numbers or booleans")
        prompt = _text(h, "prompt", t, MAX_TEXT)
        if by_ids and prompt:
            raise _bad(f"{t}: a prompt given as ids carries no text")
        return cls(_int(h, "s", t), _int(h, "seq", t), _str(h, "fp", t), _str(h, "m", t),
                   _str(h, "c", t), dict(opts), _float(h, "T", t, 0.0, 1e6),
                   _int(h, "k", t, 0, 1 << 31), _float(h, "p", t, 0.0, 1.0),
                   _int(h, "seed", t, 0, (1 << 64) - 1, optional=True),
                   prompt, _int(h, "max", t, 0, 1 << 31),
                   bytes_to_ids(buffers[0], t, "resume ids"),
                   bytes_to_ids(buffers[1], t, "prompt ids") if by_ids else None)


@dataclass(frozen=True)
class Opened(SessionMessage):
    """Cloud -> edge: session ``s`` is open; ``prompt_tokens`` target tokens of context."""

    TYPE: ClassVar[str] = "opened"
    prompt_tokens: int

    def to_wire(self) -> tuple[Header, Buffers]:
        return {"t": self.TYPE, "s": self.s, "n": self.prompt_tokens}, []

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> Opened:
        _nbuf(buffers, 0, cls.TYPE)
        return cls(_int(h, "s", cls.TYPE), _int(h, "n", cls.TYPE))


@dataclass(frozen=True, eq=False)
class DraftMsg(SessionMessage):
    """Edge -> cloud: round ``r`` of session ``s``.

    ``token``: the token the device resolved at the previous round's rejection (the
    cloud does not know it yet), ``None`` after a full acceptance. ``draft`` holds
    the drafted target ids, ``q_i(x_i)`` and, for sd-uplink / uhlm, the encoded
    draft vectors and the verify mask. A draft of length 0 asks the cloud to
    sample the next token itself (``ar``, or one token left to generate).

    Buffers: ``ids`` (int32 x d), ``q`` (float32 x d), then ``mask`` (uint8 x d)
    when ``"mk"``, then ``"nv"`` encoded vectors.
    """

    TYPE: ClassVar[str] = "draft"
    seq: int
    r: int
    token: int | None
    draft: Draft

    def to_wire(self) -> tuple[Header, Buffers]:
        d = self.draft
        bufs = [ids_to_bytes(d.ids), np.ascontiguousarray(d.q_values, dtype="<f4").tobytes()]
        h: Header = {"t": self.TYPE, "s": self.s, "seq": self.seq, "r": self.r,
                     "tok": self.token}
        if d.verify_mask is not None:
            h["mk"] = True
            bufs.append(np.asarray(d.verify_mask, dtype=np.uint8).tobytes())
        if d.q_vectors is not None:
            h["nv"] = len(d.q_vectors)
            bufs.extend(d.q_vectors)
        return h, bufs

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> DraftMsg:
        t = cls.TYPE
        mk = _bool(h, "mk", t, False)
        nv = _int(h, "nv", t, 0, MAX_BUFFERS, optional=True)
        _nbuf(buffers, 2 + int(mk) + (nv or 0), t)
        ids = bytes_to_ids(buffers[0], t, "draft ids", max_n=MAX_DRAFT)
        q = bytes_to_f32(buffers[1], t, "q values", ids.shape[0])
        check_probs(q, t, "q values")
        if ids.shape[0] and not float(q.min()) > 0.0:
            raise ProtocolError(f"{t}: a drafted token has q(x) = 0", code="bad_vector")
        mask = None
        if mk:
            raw = buffers[2]
            if len(raw) != ids.shape[0]:
                raise _bad(f"{t}: mask has {len(raw)} bytes for {ids.shape[0]} drafts")
            mask = np.frombuffer(raw, dtype=np.uint8).astype(bool)
        vectors = tuple(bytes(b) for b in buffers[2 + int(mk):]) if nv is not None else None
        return cls(_int(h, "s", t), _int(h, "seq", t), _int(h, "r", t),
                   _int(h, "tok", t, optional=True, hi=(1 << 31) - 1),
                   Draft(ids=ids, q_values=q, q_vectors=vectors, verify_mask=mask))


# -- the method's payload (shared by Verdict and FollowUp) --------------------


def reply_to_wire(reply: Reply, h: Header, other_bytes: Mapping[int, bytes]) -> Buffers:
    """Write a method reply into header ``h``; return its buffers.

    ``other_bytes`` maps each V_O target id the reply names to its bytes: the
    device knows only V_C by id, so target-only tokens travel with their spelling.
    """
    if other_bytes:
        h["ob"] = [[int(k), bytes(v)] for k, v in other_bytes.items()]
    if isinstance(reply, TokenReply):
        h["k"], h["tok"] = "tok", int(reply.token)
        return []
    if isinstance(reply, FullVectorReply):
        h["k"] = "full"
        return [reply.data]
    if isinstance(reply, HybridReply):
        h["k"], h["th"] = "hr", float(reply.theta_o)
        h["o"] = None if reply.other_token is None else int(reply.other_token)
        return [reply.data]
    if isinstance(reply, CandidatesReply):
        h["k"] = "cand"
        return [ids_to_bytes(reply.ids), np.ascontiguousarray(reply.values, dtype="<f4").tobytes()]
    raise TypeError(f"not a method reply: {type(reply).__name__}")


def reply_from_wire(h: Mapping[str, Any], buffers: Sequence[bytes],
                    t: str) -> tuple[Reply, dict[int, bytes]]:
    kind = _str(h, "k", t)
    ob_raw = h.get("ob") or []
    if not isinstance(ob_raw, list) or len(ob_raw) > MAX_CANDIDATES:
        raise _bad(f"{t}: ob must be a list of [id, bytes] pairs")
    other: dict[int, bytes] = {}
    for pair in ob_raw:
        if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int
                and isinstance(pair[1], bytes) and pair[0] >= 0 and len(pair[1]) <= MAX_PIECE):
            raise _bad(f"{t}: ob must be a list of [id, bytes] pairs")
        other[pair[0]] = pair[1]
    reply: Reply
    if kind == "tok":
        _nbuf(buffers, 0, t)
        reply = TokenReply(_int(h, "tok", t, hi=(1 << 31) - 1))
    elif kind == "full":
        _nbuf(buffers, 1, t)
        reply = FullVectorReply(bytes(buffers[0]))
    elif kind == "hr":
        _nbuf(buffers, 1, t)
        theta = _float(h, "th", t, 0.0, 1.0 + 1e-6)
        reply = HybridReply(bytes(buffers[0]), theta, _int(h, "o", t, optional=True,
                                                            hi=(1 << 31) - 1))
    elif kind == "cand":
        _nbuf(buffers, 2, t)
        ids = bytes_to_ids(buffers[0], t, "candidates", max_n=MAX_CANDIDATES)
        vals = bytes_to_f32(buffers[1], t, "candidate values", ids.shape[0])
        check_probs(vals, t, "candidate values")
        reply = CandidatesReply(ids=ids, values=vals)
    else:
        raise _bad(f"{t}: unknown reply kind {kind!r}")
    return reply, other


@dataclass(frozen=True, eq=False)
class VerdictMsg(SessionMessage):
    """Cloud -> edge: round ``r`` accepted ``accepted`` drafts; ``reply`` is the bonus
    token (all accepted) or the method's rejection payload."""

    TYPE: ClassVar[str] = "verdict"
    r: int
    accepted: int
    reply: Reply
    other_bytes: dict[int, bytes] = field(default_factory=dict)
    #: the cloud's measured compute for this round (its batch), microseconds; 0 = unknown
    compute_us: int = 0

    def to_wire(self) -> tuple[Header, Buffers]:
        h: Header = {"t": self.TYPE, "s": self.s, "r": self.r, "n": self.accepted}
        if self.compute_us:
            h["us"] = int(self.compute_us)
        return h, reply_to_wire(self.reply, h, self.other_bytes)

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> VerdictMsg:
        t = cls.TYPE
        reply, other = reply_from_wire(h, buffers, t)
        us = _int(h, "us", t, optional=True) or 0
        return cls(_int(h, "s", t), _int(h, "r", t), _int(h, "n", t, 0, MAX_DRAFT), reply, other,
                   us)


@dataclass(frozen=True)
class RequestMsg(SessionMessage):
    """Edge -> cloud: a follow-up after a rejection (``more``, ``fallback``, ``other``)."""

    TYPE: ClassVar[str] = "request"
    seq: int
    r: int
    kind: str

    def to_wire(self) -> tuple[Header, Buffers]:
        return {"t": self.TYPE, "s": self.s, "seq": self.seq, "r": self.r, "k": self.kind}, []

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> RequestMsg:
        t = cls.TYPE
        _nbuf(buffers, 0, t)
        kind = _str(h, "k", t)
        if kind not in ("more", "fallback", "other"):
            raise _bad(f"{t}: unknown follow-up request {kind!r}")
        return cls(_int(h, "s", t), _int(h, "seq", t), _int(h, "r", t), kind)


@dataclass(frozen=True, eq=False)
class FollowUp(SessionMessage):
    """Cloud -> edge: the answer to a :class:`RequestMsg` (same payload kinds as a verdict)."""

    TYPE: ClassVar[str] = "reply"
    r: int
    reply: Reply
    other_bytes: dict[int, bytes] = field(default_factory=dict)

    def to_wire(self) -> tuple[Header, Buffers]:
        h: Header = {"t": self.TYPE, "s": self.s, "r": self.r}
        return h, reply_to_wire(self.reply, h, self.other_bytes)

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> FollowUp:
        t = cls.TYPE
        reply, other = reply_from_wire(h, buffers, t)
        return cls(_int(h, "s", t), _int(h, "r", t), reply, other)


@dataclass(frozen=True)
class Close(SessionMessage):
    """Edge -> cloud: session ``s`` is over; the cloud frees its state."""

    TYPE: ClassVar[str] = "close"
    seq: int

    def to_wire(self) -> tuple[Header, Buffers]:
        return {"t": self.TYPE, "s": self.s, "seq": self.seq}, []

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> Close:
        _nbuf(buffers, 0, cls.TYPE)
        return cls(_int(h, "s", cls.TYPE), _int(h, "seq", cls.TYPE))


MESSAGE_TYPES: dict[str, type[Message]] = {
    m.TYPE: m
    for m in (Hello, Welcome, VocabRequest, VocabTable, VocabMapUpload, VocabMapAccepted, Ping,
              Pong, Error, Open, Opened, DraftMsg, VerdictMsg, RequestMsg, FollowUp, Close)
}


def from_wire(header: Any, buffers: Sequence[bytes]) -> Message:
    """The message a decoded header and its buffers describe, fully checked."""
    if not isinstance(header, dict):
        raise _bad("header is not a map", code="bad_frame")
    t = header.get("t")
    if not isinstance(t, str):
        raise _bad("header has no message type 't'", code="bad_frame")
    cls = MESSAGE_TYPES.get(t)
    if cls is None:
        raise ProtocolError(f"unknown message type {t[:MAX_NAME]!r}", code="unknown_type")
    if len(buffers) > MAX_BUFFERS:
        raise _bad(f"{t}: too many buffers ({len(buffers)})")
    try:
        return cls.from_wire(header, buffers)
    except ProtocolError:
        raise
    except (TypeError, ValueError, KeyError, OverflowError) as e:
        raise _bad(f"{t}: malformed ({e})") from e


def session_of(header: Any) -> int | None:
    """The session id a (possibly malformed) header names, if it names one cleanly,
    so an error about it can be addressed to that session."""
    if isinstance(header, dict):
        s = header.get("s")
        if type(s) is int and s >= 0:
            return s
    return None
