"""Every message of an xcosd session, and their wire form.

A message on the wire is a msgpack **header** (a map whose key ``"t"`` names the
message type) followed by zero or more raw **buffers**: token ids as little-endian
int32, probabilities as little-endian float32, codec payloads as the codec wrote
them. Arrays never go element by element into msgpack: a 4-token draft costs 32
bytes of buffers, not a msgpack list per value.

Names: a message class is named for what its wire type ``"t"`` carries (``hello``
-> :class:`Hello`, ``open`` -> :class:`Open`, ``vmap`` -> :class:`VocabMapUpload`);
the four whose name is already a method payload's (``draft``, ``verdict``,
``request``, ``reply``: :class:`~xcosd.methods.base.Draft` and friends travel
*inside* them) carry a ``Msg`` suffix: :class:`DraftMsg`, :class:`VerdictMsg`,
:class:`RequestMsg`, :class:`ReplyMsg`.

Each message type is a frozen dataclass that declares its header keys
(``FIELDS``, a table of :class:`~xcosd.protocol.fields.Field`: attribute, wire
key, type, bounds) and its buffers (``BUFFERS``); :class:`Message` encodes and
decodes every message from those tables, checking every field's type and range
and every buffer's length, so a bound is written once. The few parts whose shape
depends on other fields (a draft's optional mask and vectors, a reply's payload
kind, an open's prompt ids) are the ``_extra_*`` hooks of their messages.
Anything malformed raises :class:`~xcosd.errors.ProtocolError` with a typed
``code`` (see :mod:`xcosd.protocol.errors`), so a hostile or broken peer gets a
precise error and never a crash. Checks that need session knowledge (is this id
inside the target vocabulary, is this round the current one) are the state
machines' job.

The byte layout of every message is tabulated in ``docs/PROTOCOL.md``;
``tests/test_wire_golden.py`` pins the bytes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import numpy as np

from ..errors import ErrorCode, ProtocolError
from ..methods.base import (
    CandidatesReply,
    Draft,
    FullVectorReply,
    HybridReply,
    Reply,
    RequestKind,
    TokenReply,
)
from ..methods.round import RoundRedo
from ..methods.tree import MAX_NODES, DraftTree
from .fields import (
    INT_MAX,
    MAX_IDS,
    MAX_NAME,
    SMALL,
    TOKEN_MAX,
    Buf,
    Buffers,
    BufKind,
    Field,
    Header,
    Kind,
    bad,
    bytes_to_f32,
    bytes_to_ids,
    check_count,
    check_probs,
    decode_buffers,
    decode_fields,
    encode_buffers,
    encode_fields,
    f32_to_bytes,
    ids_to_bytes,
    omit_falsy,
    omit_none,
    read_bool,
    read_int,
    read_str,
)

#: Version of the message set; a peer speaking another one is refused (code ``version``).
#: 4: ``render`` / ``rendered`` (prompts tokenised and chats rendered by the target),
#: and an ``error`` may name the render request it answers (``n``).
#: 5: draft trees (a block's ``"tp"`` / ``"tc"`` / ``"tx"`` and its parents and rows,
#: :func:`draft_to_wire`), the welcome's ``max_tree``, and a tree verdict's ``n``
#: naming the node the walk stopped at.
#: 6: a vocabulary table marks the ids its tokenizer writes where ids share their
#: bytes (``kinds`` 3), and replies no longer carry V_O spellings (``ob``): the edge
#: spells every target id from the table it holds since the handshake.
PROTOCOL_VERSION = 7

#: Bounds on header fields, so a hostile header cannot make us allocate much.
MAX_TEXT = 1 << 20  # prompt text, bytes of UTF-8
MAX_MESSAGE = 4096  # human-readable error text
MAX_BUFFERS = 4096
MAX_OPTIONS = 16
MAX_DRAFT = 1 << 16  # drafted ids per round (and accepted ones in a verdict)
MAX_CANDIDATES = 1 << 16  # candidate ids per reply
MAX_CANDIDATE_ROUNDS = 1 << 10  # SR-DV's M: candidate replies per rejection
MAX_STOP = 64  # stop ids in a welcome
MAX_RESUME = 1 << 20  # target ids generated before a resume (a session's whole output)
MAX_CHAT = 1024  # messages of one chat to render
#: the roles a chat message may have (the target's template is given these)
CHAT_ROLES = ("system", "user", "assistant")
#: The largest header a legal message needs: an ``open`` whose prompt has
#: ``MAX_TEXT`` bytes, with every other field at its bound, fits with room to
#: spare. A receiver that accepts prompts must use at least this as its
#: ``max_header_bytes``, or it refuses legal prompts as ``too_large`` before it can
#: tell which session they belong to.
MAX_HEADER_BYTES = MAX_TEXT + (64 << 10)


# ----------------------------------------------------------------- base class


@dataclass(frozen=True)
class Message:
    """A protocol message. ``TYPE`` is its header tag ``"t"``; ``FIELDS`` and
    ``BUFFERS`` declare its wire form."""

    TYPE: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[Field, ...]] = ()
    BUFFERS: ClassVar[tuple[Buf, ...]] = ()

    def to_wire(self) -> tuple[Header, Buffers]:
        """``(header, buffers)``: ``"t"``, then the fields in table order."""
        h = encode_fields(self, self.FIELDS, {"t": self.TYPE})
        bufs = encode_buffers(self, self.BUFFERS)
        bufs.extend(self._extra_to_wire(h))
        return h, bufs

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> Message:
        """The message ``h`` and ``buffers`` describe, every field checked."""
        t = cls.TYPE
        n = cls._buffer_count(h, t)
        if n is not None:
            check_count(buffers, n, t)
        kw = decode_fields(h, cls.FIELDS, t)
        kw.update(decode_buffers(buffers, cls.BUFFERS, t))
        kw.update(cls._extra_from_wire(h, buffers, t, kw))
        return cls(**kw)

    # hooks for the parts whose shape depends on other fields

    def _extra_to_wire(self, h: Header) -> Buffers:
        """Add header keys after the table's; return buffers after ``BUFFERS``."""
        return []

    @classmethod
    def _buffer_count(cls, h: Mapping[str, Any], t: str) -> int | None:
        """How many buffers ``h`` announces (``None``: the hook checks)."""
        return len(cls.BUFFERS)

    @classmethod
    def _extra_from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes], t: str,
                         kw: dict[str, Any]) -> dict[str, Any]:
        return {}


#: the session id, first field of every session message
S = Field("s", "s", Kind.INT)
#: in every answer of the cloud: the ``seq`` of the edge message it answers, so the
#: edge can tell a late or duplicated answer from the one it waits for
ACK = Field("ack", "a", Kind.INT, nullable=True, default=0, omit=omit_falsy)


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
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("version", "v", Kind.INT, hi=1 << 31),
        Field("node", "node", Kind.STR),
        Field("target_fp", "tfp", Kind.STR, nullable=True),
        Field("map_fp", "mfp", Kind.STR, nullable=True),
        Field("want_vocab", "vocab", Kind.BOOL, default=False),
    )
    version: int = PROTOCOL_VERSION
    node: str = ""
    target_fp: str | None = None
    map_fp: str | None = None
    want_vocab: bool = False


@dataclass(frozen=True)
class ServerLimits:
    """What the cloud accepts; sent in :class:`Welcome` so the edge can comply."""

    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("max_message", "msg", Kind.INT, lo=1),
        Field("max_sessions", "sess", Kind.INT),
        Field("max_draft", "draft", Kind.INT, hi=MAX_DRAFT),
        Field("heartbeat_s", "hb", Kind.FLOAT, lo=0.0, hi=math.inf),
        Field("timeout_s", "to", Kind.FLOAT, lo=0.0, hi=math.inf),
        Field("max_tree", "tree", Kind.INT, hi=MAX_NODES, nullable=True, default=0,
              omit=omit_falsy),
        Field("context", "ctx", Kind.INT, nullable=True, default=0, omit=omit_falsy),
    )
    max_message: int
    max_sessions: int
    max_draft: int
    heartbeat_s: float
    timeout_s: float
    #: the most nodes of a draft tree the cloud verifies; 0: chains only (an edge
    #: asked for trees drafts chains there, ``xcosd/protocol/edge.py``)
    max_tree: int = 0
    #: the target's context: the most positions one session holds, its prompt and
    #: everything generated after it (0: no bound known). An open past it is refused
    #: ``context_length`` before any compute; the edge checks it first
    context: int = 0

    def to_dict(self) -> dict[str, Any]:
        return encode_fields(self, self.FIELDS)

    @classmethod
    def from_dict(cls, d: Any, t: str) -> ServerLimits:
        if not isinstance(d, dict):
            raise bad(f"{t}: limits must be a map")
        return cls(**decode_fields(d, cls.FIELDS, t))


@dataclass(frozen=True)
class Welcome(Message):
    """Cloud -> edge: who the cloud is, its target vocabulary and its limits.

    ``server_id`` changes on every cloud start, so an edge that sees a new one
    knows its sessions are gone and resumes them.
    """

    TYPE: ClassVar[str] = "welcome"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("version", "v", Kind.INT, hi=1 << 31),
        Field("server_id", "sid", Kind.STR),
        Field("target_name", "tname", Kind.STR),
        Field("target_fp", "tfp", Kind.STR),
        Field("target_size", "tsize", Kind.INT, lo=1, hi=1 << 31),
        Field("stop_ids", "stop", Kind.INTS, size=MAX_STOP),
        Field("limits", "lim", Kind.NESTED, nested=ServerLimits),
        Field("map_known", "map", Kind.BOOL),
    )
    version: int
    server_id: str
    target_name: str
    target_fp: str
    target_size: int
    stop_ids: tuple[int, ...]
    limits: ServerLimits
    map_known: bool


@dataclass(frozen=True)
class VocabRequest(Message):
    """Edge -> cloud: send me the target vocabulary (once per connection, if needed)."""

    TYPE: ClassVar[str] = "vocab_get"


@dataclass(frozen=True)
class VocabTable(Message):
    """Cloud -> edge: the target vocabulary's id -> bytes table.

    Buffers: ``kinds`` (uint8 per id: 0 unused, 1 regular, 2 special, 3 regular and
    the tokenizer's own spelling of bytes other ids spell too),
    ``lengths`` (int32 per id), ``blob`` (all token bytes concatenated, zstd-compressed
    when ``compressed``).
    """

    TYPE: ClassVar[str] = "vocab"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("name", "name", Kind.STR),
        Field("fingerprint", "fp", Kind.STR),
        Field("roles", "roles", Kind.ROLES),
        Field("compressed", "z", Kind.BOOL, default=True),
    )
    BUFFERS: ClassVar[tuple[Buf, ...]] = (
        Buf("kinds", BufKind.RAW), Buf("lengths", BufKind.RAW), Buf("blob", BufKind.RAW))
    name: str
    fingerprint: str
    roles: dict[str, int]
    kinds: bytes
    lengths: bytes
    blob: bytes
    compressed: bool = True


@dataclass(frozen=True, eq=False)
class VocabMapUpload(Message):
    """Edge -> cloud: the V_C map (target ids ascending, and their draft ids), sent only
    when the cloud does not know ``fingerprint`` yet. The cloud recomputes the
    fingerprint from the arrays and refuses a mismatch."""

    TYPE: ClassVar[str] = "vmap"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("fingerprint", "fp", Kind.STR),
        Field("draft_size", "dsize", Kind.INT, lo=1, hi=1 << 31),
    )
    BUFFERS: ClassVar[tuple[Buf, ...]] = (
        Buf("common_target_ids", BufKind.IDS, "common target ids"),
        Buf("common_draft_ids", BufKind.IDS, "common draft ids",
            same_len_as="common_target_ids"),
    )
    fingerprint: str
    draft_size: int
    common_target_ids: np.ndarray
    common_draft_ids: np.ndarray


@dataclass(frozen=True)
class VocabMapAccepted(Message):
    TYPE: ClassVar[str] = "vmap_ok"
    FIELDS: ClassVar[tuple[Field, ...]] = (Field("fingerprint", "fp", Kind.STR),)
    fingerprint: str


@dataclass(frozen=True)
class Ping(Message):
    """Heartbeat; either side may send it, the other answers :class:`Pong`."""

    TYPE: ClassVar[str] = "ping"
    FIELDS: ClassVar[tuple[Field, ...]] = (Field("n", "n", Kind.INT),)
    n: int = 0


@dataclass(frozen=True)
class Pong(Message):
    TYPE: ClassVar[str] = "pong"
    FIELDS: ClassVar[tuple[Field, ...]] = (Field("n", "n", Kind.INT),)
    n: int = 0


def _known_code(code: str) -> ErrorCode | str:
    """A received code as its enum member; one this side does not know (a newer
    peer) stays a string and becomes a ``protocol`` error that names it."""
    return ErrorCode(code) if code in ErrorCode.__members__.values() else code


@dataclass(frozen=True)
class Error(Message):
    """A typed error: ``code`` (see :mod:`xcosd.protocol.errors`), a human message,
    and the session ``s`` / round ``r`` or the render request ``n`` it concerns
    when there is one."""

    TYPE: ClassVar[str] = "error"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("code", "code", Kind.STR, from_wire=_known_code),
        Field("message", "msg", Kind.STR, size=MAX_MESSAGE,
              to_wire=lambda m: m[:MAX_MESSAGE]),
        Field("s", "s", Kind.INT, nullable=True, omit=omit_none),
        Field("r", "r", Kind.INT, nullable=True, omit=omit_none),
        Field("n", "n", Kind.INT, nullable=True, omit=omit_none),
    )
    code: ErrorCode | str
    message: str
    s: int | None = None
    r: int | None = None
    n: int | None = None


@dataclass(frozen=True)
class Render(Message):
    """Edge -> cloud: a prompt as target ids, made by the target: ``text`` by its
    tokenizer (exactly what an ``open`` with that text would start from), or
    ``chat`` by its chat template, the generation prompt added (the context a
    chat's answer is generated from, so its law is the target's own answer).

    ``n`` numbers the request on its connection; the answer
    (:class:`Rendered`, or an :class:`Error` with the same ``n``) carries it back,
    so many may be in flight. Exactly one of ``text`` and ``chat`` is given. On the
    wire ``chat`` is a list of ``[role, content]`` pairs (key ``"chat"``), at most
    :data:`MAX_CHAT` of them, roles from :data:`CHAT_ROLES`, all contents together
    at most :data:`MAX_TEXT` bytes of UTF-8.

    By reference (``base``): the request continues an earlier one of this
    connection, named by its digest (:func:`xcosd.protocol.contexts.render_key`),
    whose first ``keep`` messages (a chat) or characters (a text) it repeats: only
    the rest travels, so a chat's turn costs the uplink its new messages, not its
    history. The answer is then relative too (:class:`Rendered`). A ``base`` the
    cloud no longer holds is refused ``no_context``; the edge asks again in full."""

    TYPE: ClassVar[str] = "render"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("n", "n", Kind.INT),
        Field("text", "text", Kind.TEXT, size=MAX_TEXT, nullable=True, omit=omit_none),
        Field("base", "b", Kind.STR, nullable=True, omit=omit_none),
        Field("keep", "bk", Kind.INT, nullable=True, default=0, omit=omit_falsy),
    )
    n: int
    text: str | None = None
    chat: tuple[tuple[str, str], ...] | None = None
    #: the digest of the earlier request this one continues (``None``: a whole one)
    base: str | None = None
    #: how much of it this one repeats: messages of a chat, characters of a text
    keep: int = 0

    def _extra_to_wire(self, h: Header) -> Buffers:
        if self.chat is not None:
            h["chat"] = [[role, content] for role, content in self.chat]
        return []

    @classmethod
    def _extra_from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes], t: str,
                         kw: dict[str, Any]) -> dict[str, Any]:
        raw = h.get("chat")
        if (raw is None) == (kw["text"] is None):
            raise bad(f"{t}: exactly one of text and chat")
        if kw["keep"] and kw["base"] is None:
            raise bad(f"{t}: keep without a base")
        if raw is None:
            return {}
        # by reference, the rest of a chat may be empty (the same chat again)
        least = 0 if kw["base"] is not None else 1
        if not isinstance(raw, list) or not least <= len(raw) <= MAX_CHAT:
            raise bad(f"{t}: chat must be a list of {least}..{MAX_CHAT} messages")
        out: list[tuple[str, str]] = []
        size = 0
        for m in raw:
            if not (isinstance(m, list) and len(m) == 2 and m[0] in CHAT_ROLES
                    and isinstance(m[1], str)):
                raise bad(f"{t}: a chat message is [role, content] with a role of "
                          f"{', '.join(CHAT_ROLES)}")
            size += len(m[1].encode())
            if size > MAX_TEXT:
                raise bad(f"{t}: chat longer than {MAX_TEXT} bytes of UTF-8")
            out.append((m[0], m[1]))
        return {"chat": tuple(out)}


@dataclass(frozen=True, eq=False)
class Rendered(Message):
    """Cloud -> edge: the target ids :class:`Render` request ``n`` asked for
    (buffer: int32 ids).

    ``keep``: for a request by reference, the ids are the first ``keep`` ids of its
    base's answer followed by these (the new turn's, and the few a template's seam
    changes), so the downlink too carries the new turn only."""

    TYPE: ClassVar[str] = "rendered"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("n", "n", Kind.INT),
        Field("keep", "bk", Kind.INT, nullable=True, default=0, omit=omit_falsy),
    )
    BUFFERS: ClassVar[tuple[Buf, ...]] = (Buf("ids", BufKind.IDS, "rendered ids",
                                              max_n=MAX_RESUME),)
    n: int
    ids: np.ndarray
    keep: int = 0


# -- a drafted block's wire form (a draft message's, or the one riding on an open) --


def draft_to_wire(d: Draft, h: Header) -> Buffers:
    """Write block ``d`` into header ``h`` (``"mk"``, ``"nv"`` when present); return
    its buffers: ``ids`` (int32 x n), ``q`` (float32 x n), then ``mask`` (uint8 x n)
    when ``"mk"``, then ``"nv"`` encoded vectors."""
    bufs = [ids_to_bytes(d.ids), f32_to_bytes(d.q_values)]
    if d.verify_mask is not None:
        h["mk"] = True
        bufs.append(np.asarray(d.verify_mask, dtype=np.uint8).tobytes())
    if d.q_vectors is not None:
        h["nv"] = len(d.q_vectors)
        bufs.extend(d.q_vectors)
    if isinstance(d, DraftTree):
        # a tree: "tp" rows follow, with codec "tc"; "tx" false for i.i.d. siblings;
        # buffers: parents (int16 x n, -1 for the context), the rows' nodes (int16 x
        # "tp"), then each row as the codec wrote it
        nodes = sorted(d.rows)
        h["tp"] = len(nodes)
        h["tc"] = d.row_codec
        if not d.distinct:
            h["tx"] = False
        bufs.append(np.asarray(d.parents, dtype="<i2").tobytes())
        bufs.append(np.asarray(nodes, dtype="<i2").tobytes())
        bufs.extend(d.rows[v] for v in nodes)
    return bufs


def draft_buffer_count(h: Mapping[str, Any], t: str) -> int:
    """How many buffers the block that ``h`` announces takes."""
    mk = "mk" in h and read_bool(h, "mk", t)
    nv = 0 if h.get("nv") is None else read_int(h, "nv", t, 0, MAX_BUFFERS)
    tp = 0 if "tp" not in h else 2 + read_int(h, "tp", t, 0, MAX_NODES + 1)
    if not tp and ("tc" in h or "tx" in h):
        raise bad(f"{t}: tc and tx describe a tree, and this block is none")
    return 2 + int(mk) + nv + tp


def _small_block(raw_ids: bytes, raw_vals: bytes
                 ) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """A few ids and their probabilities (1 to :data:`SMALL` of each: a draft's ``q(x)``,
    a verdict's candidates) read as Python numbers in one unpack each, when the checks
    the field tables make pass (whole int32 / float32 buffers of one length, no
    negative id, every value finite in [0, 1]); ``None`` otherwise, and the tables
    then say what is wrong. A numpy array per check costs microseconds whatever its
    size, and this runs for nearly every message."""
    n = len(raw_ids)
    k = n >> 2
    if n & 3 or not 0 < k <= SMALL or len(raw_vals) != n:
        return None
    ids = struct.unpack(f"<{k}i", raw_ids)
    vals = struct.unpack(f"<{k}f", raw_vals)
    # a NaN or an infinity makes the sum non-finite; with all finite, min / max are exact
    if min(ids) < 0 or not (math.isfinite(sum(vals)) and min(vals) >= 0.0
                            and max(vals) <= 1.0 + 1e-6):
        return None
    return ids, vals


def _small_draft(raw_ids: bytes, raw_q: bytes) -> Draft | None:
    """The common block (no mask or vectors) by :func:`_small_block`, when every check
    :func:`draft_from_wire` makes passes (``q(x) > 0`` too); ``None`` otherwise."""
    if not raw_ids and not raw_q:  # ar's rounds: no draft
        return Draft(ids=np.empty(0, dtype=np.int64), q_values=np.empty(0, dtype=np.float32))
    got = _small_block(raw_ids, raw_q)
    if got is None or not min(got[1]) > 0.0:
        return None
    return Draft(ids=np.array(got[0], dtype=np.int64),
                 q_values=np.array(got[1], dtype=np.float32))


def draft_from_wire(h: Mapping[str, Any], buffers: Sequence[bytes], t: str) -> Draft:
    """The block in ``buffers`` (as many as :func:`draft_buffer_count` says), every
    value checked: ids in range, ``q(x)`` a probability above 0 for each drafted id."""
    mk = "mk" in h and bool(h["mk"])
    ids = bytes_to_ids(buffers[0], t, "draft ids", max_n=MAX_DRAFT)
    d = ids.shape[0]
    q = bytes_to_f32(buffers[1], t, "q values", d)
    check_probs(q, t, "q values")
    # (checked finite above; a draft's few values are cheaper to compare in Python)
    if d and not (min(q.tolist()) if d <= SMALL else float(q.min())) > 0.0:
        raise ProtocolError(f"{t}: a drafted token has q(x) = 0", code=ErrorCode.BAD_VECTOR)
    mask = None
    if mk:
        raw = buffers[2]
        if len(raw) != ids.shape[0]:
            raise bad(f"{t}: mask has {len(raw)} bytes for {ids.shape[0]} drafts")
        mask = np.frombuffer(raw, dtype=np.uint8).astype(bool)
    at = 2 + int(mk)
    nv = 0 if h.get("nv") is None else int(h["nv"])
    vectors = tuple(bytes(b) for b in buffers[at:at + nv]) if h.get("nv") is not None else None
    if "tp" not in h:
        return Draft(ids=ids, q_values=q, q_vectors=vectors, verify_mask=mask)
    return _tree_from_wire(h, buffers[at + nv:], t, ids, q, vectors, mask)


def _tree_from_wire(h: Mapping[str, Any], buffers: Sequence[bytes], t: str, ids: np.ndarray,
                    q: np.ndarray, vectors: tuple[bytes, ...] | None,
                    mask: np.ndarray | None) -> DraftTree:
    """A tree block's own buffers (see :func:`draft_to_wire`), their sizes and indices
    checked; whether the parents make a tree, and the rows the nodes need, is the
    cloud's check (``xcosd.methods.tree.check_tree``, ``server_rows``)."""
    n = ids.shape[0]
    if vectors is not None or mask is not None:
        raise bad(f"{t}: a tree carries its rows, not draft vectors or a mask")
    if n > MAX_NODES:
        raise bad(f"{t}: a tree of {n} nodes, more than {MAX_NODES}")
    codec = read_str(h, "tc", t)
    distinct = read_bool(h, "tx", t) if "tx" in h else True
    raw_parents, raw_nodes = bytes(buffers[0]), bytes(buffers[1])
    if len(raw_parents) != 2 * n:
        raise bad(f"{t}: {len(raw_parents)} bytes of parents for {n} nodes")
    k = len(buffers) - 2
    if len(raw_nodes) != 2 * k:
        raise bad(f"{t}: {len(raw_nodes)} bytes of row nodes for {k} rows")
    parents = np.frombuffer(raw_parents, dtype="<i2").astype(np.int64)
    nodes = np.frombuffer(raw_nodes, dtype="<i2").tolist()
    if n and (int(parents.min()) < -1 or int(parents.max()) >= n):
        raise bad(f"{t}: a parent outside the tree")
    if len(set(nodes)) != k or any(not -1 <= v < n for v in nodes):
        raise bad(f"{t}: row nodes must be distinct nodes of the tree")
    rows = {int(v): bytes(b) for v, b in zip(nodes, buffers[2:], strict=True)}
    return DraftTree(ids=ids, q_values=q, parents=parents, rows=rows, row_codec=codec,
                     distinct=distinct)


# ---------------------------------------------------------------- session level


@dataclass(frozen=True)
class Open(SessionMessage):
    """Edge -> cloud: start session ``s``.

    The prompt travels as **text**: the cloud tokenises it with the target's
    tokenizer (its context is canonical, in target ids) and the device with its
    own. ``resume`` holds target ids already generated, when a session is resumed
    after a cloud restart: the cloud's context becomes prompt + resume, so no token
    is lost or repeated, and ``r`` is the round it continues from (round numbers
    and ``seq`` never go back, so an answer from before the restart is recognisably
    stale). ``seed`` seeds the cloud's half of the session's randomness (``None``:
    fresh entropy); a resumed session gets a fresh seed, never the first one again,
    or the cloud's random stream would replay.

    ``prompt_ids``: the prompt as **target ids** instead of text (then ``prompt`` is
    empty), for callers that hold a tokenised context: the cloud's context is exactly
    these ids (no tokenisation, no special tokens added), as if the target had been
    given them. On the wire: header ``"pi": true`` and a second buffer after
    ``resume``; absent, the message is the text form unchanged.

    ``draft``: round 0's drafted block, riding on a new session's first open, so a
    generation's first draft leaves without waiting a round trip for ``opened``.
    The cloud then answers with round 0's verdict alone (``ack`` = this ``seq``),
    and either accepts the open and the block together or refuses both (a ``busy``
    refusal leaves nothing behind: the same message is sent again). Only a new
    session's open carries one (``r`` 0, nothing resumed). On the wire: header
    ``"dr": true``, the block's own keys (``"mk"``, ``"nv"``), and the block's
    buffers last (:func:`draft_to_wire`).

    ``base`` / ``keep``: a prompt given as ids by reference: the first ``keep`` ids
    of a context this connection holds (an earlier render's answer or open's
    prompt, named by its digest), then ``prompt_ids``. Only the new turn travels; a
    ``base`` the cloud no longer holds is refused ``no_context`` and the edge opens
    again with the whole prompt.
    """

    TYPE: ClassVar[str] = "open"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        S,
        Field("seq", "seq", Kind.INT),
        Field("map_fp", "fp", Kind.STR),
        Field("method", "m", Kind.STR),
        Field("codec", "c", Kind.STR),
        Field("options", "o", Kind.OPTIONS, size=MAX_OPTIONS),
        Field("temperature", "T", Kind.FLOAT, lo=0.0, hi=1e6, to_wire=float),
        Field("top_k", "k", Kind.INT, hi=1 << 31),
        Field("top_p", "p", Kind.FLOAT, lo=0.0, hi=1.0, to_wire=float),
        Field("seed", "seed", Kind.INT, hi=(1 << 64) - 1, nullable=True),
        Field("prompt", "prompt", Kind.TEXT, size=MAX_TEXT),
        Field("max_new_tokens", "max", Kind.INT, hi=1 << 31),
        Field("r", "r", Kind.INT, nullable=True, default=0, omit=omit_falsy),
        Field("base", "b", Kind.STR, nullable=True, omit=omit_none),
        Field("keep", "bk", Kind.INT, nullable=True, default=0, omit=omit_falsy),
    )
    BUFFERS: ClassVar[tuple[Buf, ...]] = (
        Buf("resume", BufKind.IDS, "resume ids", max_n=MAX_RESUME),)
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
    #: the round the session continues from (0 for a new one)
    r: int = 0
    #: round 0's block, sent with the open (see the class docstring)
    draft: Draft | None = None
    #: by reference: the digest of an id context this connection holds
    #: (:func:`xcosd.protocol.contexts.ids_key`); the prompt is its first ``keep`` ids
    #: followed by ``prompt_ids``
    base: str | None = None
    keep: int = 0

    def _extra_to_wire(self, h: Header) -> Buffers:
        bufs: Buffers = []
        if self.prompt_ids is not None:
            h["pi"] = True
            bufs.append(ids_to_bytes(self.prompt_ids))
        if self.draft is not None:
            h["dr"] = True
            bufs.extend(draft_to_wire(self.draft, h))
        return bufs

    @classmethod
    def _buffer_count(cls, h: Mapping[str, Any], t: str) -> int:
        n = 1 + ("pi" in h and read_bool(h, "pi", t))
        if "dr" in h and read_bool(h, "dr", t):
            n += draft_buffer_count(h, t)
        elif "mk" in h or "nv" in h:
            raise bad(f"{t}: mk and nv describe a draft, and none rides on this open")
        return n

    @classmethod
    def _extra_from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes], t: str,
                         kw: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        at = 1
        if kw["base"] is not None and not h.get("pi", False):
            raise bad(f"{t}: a base names a prompt given as ids")
        if kw["keep"] and kw["base"] is None:
            raise bad(f"{t}: keep without a base")
        if h.get("pi", False):
            if kw["prompt"]:
                raise bad(f"{t}: a prompt given as ids carries no text")
            out["prompt_ids"] = bytes_to_ids(buffers[1], t, "prompt ids")
            at = 2
        if h.get("dr", False):
            out["draft"] = draft_from_wire(h, buffers[at:], t)
        return out


@dataclass(frozen=True)
class Opened(SessionMessage):
    """Cloud -> edge: session ``s`` is open; ``prompt_tokens`` target tokens of context.
    ``ack``: the ``seq`` of the ``open`` it answers. Not sent for an open that carries
    round 0's block: that round's verdict answers it."""

    TYPE: ClassVar[str] = "opened"
    FIELDS: ClassVar[tuple[Field, ...]] = (S, Field("prompt_tokens", "n", Kind.INT), ACK)
    prompt_tokens: int
    ack: int = 0


@dataclass(frozen=True)
class Redo(RoundRedo):
    """A round whose verdict the edge saw before the cloud lost it (a restart): the
    wire form of :class:`~xcosd.methods.round.RoundRedo`, which the cloud verifies.

    Sent with that round's draft again, first thing after the resumed ``open``: the
    cloud scores the block, takes ``accepted`` as the verdict (it is already part of
    the output's history: redrawing it would bias the output towards rounds that
    end in fewer messages), rebuilds the rejection's state with the follow-ups the
    edge already received (``candidate_rounds``, ``fallback``) and answers the
    follow-up the edge was waiting for (``kind``) with fresh randomness. Every
    follow-up is a fresh draw from a law fixed by the target row, the rejected draft
    and those counts, so the round completes exactly as it would have.
    """

    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("accepted", "n", Kind.INT, hi=MAX_DRAFT),
        Field("kind", "k", Kind.STR, choices=RequestKind),
        Field("candidate_rounds", "cr", Kind.INT, hi=1 << 20),
        Field("fallback", "fb", Kind.BOOL, default=False),
    )


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
    FIELDS: ClassVar[tuple[Field, ...]] = (
        S,
        Field("seq", "seq", Kind.INT),
        Field("r", "r", Kind.INT),
        Field("token", "tok", Kind.INT, hi=TOKEN_MAX, nullable=True),
        Field("redo", "redo", Kind.NESTED, nested=Redo, nullable=True, omit=omit_none),
    )
    seq: int
    r: int
    token: int | None
    draft: Draft
    redo: Redo | None = None

    def to_wire(self) -> tuple[Header, Buffers]:
        """A plain block (no ``redo``, mask or vectors: every round of most methods)
        written inline, the tables' exact bytes (tested); anything else through them."""
        d = self.draft
        if (self.redo is not None or d.verify_mask is not None or d.q_vectors is not None
                or type(d) is not Draft):
            return super().to_wire()
        return ({"t": "draft", "s": self.s, "seq": self.seq, "r": self.r, "tok": self.token},
                [ids_to_bytes(d.ids), f32_to_bytes(d.q_values)])

    def _extra_to_wire(self, h: Header) -> Buffers:
        return draft_to_wire(self.draft, h)

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> Message:
        """The common draft (``s``, ``seq``, ``r``, ``tok`` and a plain block) read
        inline, every value checked as the general path checks it; anything else
        (a ``redo``, a mask, vectors, a value out of range) takes that path, which
        also words the errors."""
        if len(h) == 5 and len(buffers) == 2:
            s, seq, r, tok = h.get("s"), h.get("seq"), h.get("r"), h.get("tok", False)
            if (type(s) is int and type(seq) is int and type(r) is int
                    and 0 <= s <= INT_MAX and 0 <= seq <= INT_MAX and 0 <= r <= INT_MAX
                    and (tok is None or (type(tok) is int and 0 <= tok <= TOKEN_MAX))):
                draft = _small_draft(buffers[0], buffers[1])
                if draft is not None:
                    return cls(s, seq, r, tok, draft)
        return super().from_wire(h, buffers)

    @classmethod
    def _buffer_count(cls, h: Mapping[str, Any], t: str) -> int:
        return draft_buffer_count(h, t)

    @classmethod
    def _extra_from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes], t: str,
                         kw: dict[str, Any]) -> dict[str, Any]:
        return {"draft": draft_from_wire(h, buffers, t)}


# -- the method's payload (shared by VerdictMsg and ReplyMsg) ------------------


class ReplyKind(StrEnum):
    """The ``"k"`` of a verdict or follow-up: which method payload it carries."""

    TOKEN = "tok"
    FULL = "full"
    HYBRID = "hr"
    CANDIDATES = "cand"


#: per payload kind: its reply class, header fields and buffers
REPLY_SPECS: dict[ReplyKind, tuple[type[Any], tuple[Field, ...], tuple[Buf, ...]]] = {
    ReplyKind.TOKEN: (TokenReply, (Field("token", "tok", Kind.INT, hi=TOKEN_MAX,
                                         to_wire=int),), ()),
    ReplyKind.FULL: (FullVectorReply, (), (Buf("data", BufKind.RAW),)),
    ReplyKind.HYBRID: (HybridReply, (
        Field("theta_o", "th", Kind.FLOAT, lo=0.0, hi=1.0 + 1e-6, to_wire=float),
        Field("other_token", "o", Kind.INT, hi=TOKEN_MAX, nullable=True, to_wire=int),
    ), (Buf("data", BufKind.RAW),)),
    ReplyKind.CANDIDATES: (CandidatesReply, (), (
        Buf("ids", BufKind.IDS, "candidates", max_n=MAX_CANDIDATES),
        Buf("values", BufKind.PROBS, "candidate values", same_len_as="ids"),
    )),
}
_REPLY_KIND: dict[type[Any], ReplyKind] = {cls: k for k, (cls, _, _) in REPLY_SPECS.items()}


def reply_to_wire(reply: Reply, h: Header) -> Buffers:
    """Write a method reply into header ``h``; return its buffers. Target ids go
    bare: the device spells them from the target table it holds."""
    kind = _REPLY_KIND.get(type(reply))
    if kind is None:
        raise TypeError(f"not a method reply: {type(reply).__name__}")
    _, fields, bufs = REPLY_SPECS[kind]
    h["k"] = kind.value
    h.update(encode_fields(reply, fields))
    return encode_buffers(reply, bufs)


def reply_from_wire(h: Mapping[str, Any], buffers: Sequence[bytes], t: str) -> Reply:
    kind = read_str(h, "k", t)
    if kind not in ReplyKind.__members__.values():
        raise bad(f"{t}: unknown reply kind {kind!r}")
    cls, fields, bufs = REPLY_SPECS[ReplyKind(kind)]
    check_count(buffers, len(bufs), t)
    return cls(**decode_fields(h, fields, t), **decode_buffers(buffers, bufs, t))


def _opt_int(h: Mapping[str, Any], key: str) -> int | None:
    """A nullable count as the tables read it (absent or nil: 0); ``None`` when it
    is anything the fast path should not judge."""
    v = h.get(key)
    if v is None:
        return 0
    return v if type(v) is int and 0 <= v <= INT_MAX else None


def _small_verdict(h: Mapping[str, Any], buffers: Sequence[bytes]) -> VerdictMsg | None:
    """:meth:`VerdictMsg.from_wire`'s common case, or ``None`` (the tables decide)."""
    kind = h.get("k")
    s, r, n = h.get("s"), h.get("r"), h.get("n")
    if not (type(s) is int and type(r) is int and type(n) is int and 0 <= s <= INT_MAX
            and 0 <= r <= INT_MAX and 0 <= n <= MAX_DRAFT):
        return None
    us, ack = _opt_int(h, "us"), _opt_int(h, "a")
    if us is None or ack is None:
        return None
    keys = 5 + ("us" in h) + ("a" in h)  # t, s, r, n, k and the optional two
    if kind == "tok":
        tok = h.get("tok")
        if (len(h) != keys + 1 or buffers or type(tok) is not int
                or not 0 <= tok <= TOKEN_MAX):
            return None
        return VerdictMsg(s, r, n, TokenReply(tok), us, ack)
    if kind != "cand" or len(h) != keys or len(buffers) != 2:
        return None
    got = _small_block(buffers[0], buffers[1])
    if got is None:
        return None
    reply = CandidatesReply(ids=np.array(got[0], dtype=np.int64),
                            values=np.array(got[1], dtype=np.float32))
    return VerdictMsg(s, r, n, reply, us, ack)


@dataclass(frozen=True, eq=False)
class VerdictMsg(SessionMessage):
    """Cloud -> edge: round ``r`` accepted ``accepted`` drafts; ``reply`` is the bonus
    token (all accepted) or the method's rejection payload."""

    TYPE: ClassVar[str] = "verdict"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        S,
        Field("r", "r", Kind.INT),
        Field("accepted", "n", Kind.INT, hi=MAX_DRAFT),
        Field("compute_us", "us", Kind.INT, nullable=True, default=0, omit=omit_falsy,
              to_wire=int),
        ACK,
    )
    r: int
    accepted: int
    reply: Reply
    #: the cloud's measured compute for this round (its batch), microseconds; 0 = unknown
    compute_us: int = 0
    ack: int = 0

    def to_wire(self) -> tuple[Header, Buffers]:
        """A bonus token or SR-DV's candidates (most verdicts) written inline, the
        bytes the field tables give (tested); anything else through the tables."""
        reply = self.reply
        if type(reply) is not TokenReply and type(reply) is not CandidatesReply:
            return super().to_wire()
        h: Header = {"t": "verdict", "s": self.s, "r": self.r, "n": self.accepted}
        if self.compute_us:
            h["us"] = int(self.compute_us)
        if self.ack:
            h["a"] = self.ack
        if isinstance(reply, TokenReply):
            h["k"] = "tok"
            h["tok"] = int(reply.token)
            return h, []
        assert isinstance(reply, CandidatesReply)
        h["k"] = "cand"
        return h, [ids_to_bytes(reply.ids), f32_to_bytes(reply.values)]

    def _extra_to_wire(self, h: Header) -> Buffers:
        return reply_to_wire(self.reply, h)

    @classmethod
    def from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes]) -> Message:
        """A bonus token or a few candidates (most verdicts) read inline, every value
        checked as the tables check it; anything else (and every error) through the
        tables."""
        fast = _small_verdict(h, buffers)
        return fast if fast is not None else super().from_wire(h, buffers)

    @classmethod
    def _buffer_count(cls, h: Mapping[str, Any], t: str) -> None:
        return None  # the reply's kind decides

    @classmethod
    def _extra_from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes], t: str,
                         kw: dict[str, Any]) -> dict[str, Any]:
        return {"reply": reply_from_wire(h, buffers, t)}


@dataclass(frozen=True)
class RequestMsg(SessionMessage):
    """Edge -> cloud: a follow-up after a rejection (``more``, ``fallback``, ``other``)."""

    TYPE: ClassVar[str] = "request"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        S,
        Field("seq", "seq", Kind.INT),
        Field("r", "r", Kind.INT),
        Field("kind", "k", Kind.STR, choices=RequestKind),
    )
    seq: int
    r: int
    kind: RequestKind


@dataclass(frozen=True, eq=False)
class ReplyMsg(SessionMessage):
    """Cloud -> edge: the answer to a :class:`RequestMsg` (same payload kinds as a verdict)."""

    TYPE: ClassVar[str] = "reply"
    FIELDS: ClassVar[tuple[Field, ...]] = (S, Field("r", "r", Kind.INT), ACK)
    r: int
    reply: Reply
    ack: int = 0

    def _extra_to_wire(self, h: Header) -> Buffers:
        return reply_to_wire(self.reply, h)

    @classmethod
    def _buffer_count(cls, h: Mapping[str, Any], t: str) -> None:
        return None  # the reply's kind decides

    @classmethod
    def _extra_from_wire(cls, h: Mapping[str, Any], buffers: Sequence[bytes], t: str,
                         kw: dict[str, Any]) -> dict[str, Any]:
        return {"reply": reply_from_wire(h, buffers, t)}


@dataclass(frozen=True)
class Close(SessionMessage):
    """Edge -> cloud: session ``s`` is over; the cloud frees its state."""

    TYPE: ClassVar[str] = "close"
    FIELDS: ClassVar[tuple[Field, ...]] = (S, Field("seq", "seq", Kind.INT))
    seq: int


MESSAGE_TYPES: dict[str, type[Message]] = {
    m.TYPE: m
    for m in (Hello, Welcome, VocabRequest, VocabTable, VocabMapUpload, VocabMapAccepted, Ping,
              Pong, Error, Render, Rendered, Open, Opened, DraftMsg, VerdictMsg, RequestMsg,
              ReplyMsg, Close)
}


def from_wire(header: Any, buffers: Sequence[bytes]) -> Message:
    """The message a decoded header and its buffers describe, fully checked."""
    if not isinstance(header, dict):
        raise bad("header is not a map", code=ErrorCode.BAD_FRAME)
    t = header.get("t")
    if not isinstance(t, str):
        raise bad("header has no message type 't'", code=ErrorCode.BAD_FRAME)
    cls = MESSAGE_TYPES.get(t)
    if cls is None:
        raise ProtocolError(f"unknown message type {t[:MAX_NAME]!r}",
                            code=ErrorCode.UNKNOWN_TYPE)
    if len(buffers) > MAX_BUFFERS:
        raise bad(f"{t}: too many buffers ({len(buffers)})")
    try:
        return cls.from_wire(header, buffers)
    except ProtocolError:
        raise
    except (TypeError, ValueError, KeyError, OverflowError) as e:
        raise bad(f"{t}: malformed ({e})") from e


def session_of(header: Any) -> int | None:
    """The session id a (possibly malformed) header names, if it names one cleanly,
    so an error about it can be addressed to that session."""
    if isinstance(header, dict):
        s = header.get("s")
        if type(s) is int and s >= 0:
            return s
    return None


__all__ = [
    "CHAT_ROLES",
    "MAX_BUFFERS",
    "MAX_CANDIDATES",
    "MAX_CHAT",
    "MAX_DRAFT",
    "MAX_HEADER_BYTES",
    "MAX_IDS",
    "MAX_MESSAGE",
    "MAX_NAME",
    "MAX_OPTIONS",
    "MAX_STOP",
    "MAX_TEXT",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "REPLY_SPECS",
    "Close",
    "DraftMsg",
    "Error",
    "Hello",
    "Message",
    "Open",
    "Opened",
    "Ping",
    "Pong",
    "Render",
    "Rendered",
    "ReplyKind",
    "ReplyMsg",
    "RequestMsg",
    "ServerLimits",
    "SessionMessage",
    "VerdictMsg",
    "VocabMapAccepted",
    "VocabMapUpload",
    "VocabRequest",
    "VocabTable",
    "Welcome",
    "bytes_to_f32",
    "bytes_to_ids",
    "check_probs",
    "draft_buffer_count",
    "draft_from_wire",
    "draft_to_wire",
    "from_wire",
    "ids_to_bytes",
    "reply_from_wire",
    "reply_to_wire",
    "session_of",
]
