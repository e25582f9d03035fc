"""The cloud's side of the protocol as a sans-I/O state machine.

:class:`CloudConnection` is fed the messages one peer sent (already decoded by
:func:`~xcosd.protocol.messages.from_wire`) and answers with an :class:`Output`:
the messages to send back to that peer and the events the node must act on.
It never touches a socket, a clock or the model. The one thing it cannot do
itself, scoring drafted tokens with the target model, it asks for with a
:class:`ScoreNeeded` event; the node's scheduler batches those, runs the model,
verifies the round it carries as plain data
(:func:`~xcosd.methods.round.verify_round`, a pure function of the round's snapshot
and its rows, safe on any thread) and hands the outcome back through
:meth:`CloudConnection.scored`, on the event loop, where it is applied.

A round on the cloud, as in ``xcosd/simulate.py``: warp the ``d + 1`` target
rows with the session's sampling parameters, commit them (``method.commit_row``),
verify the draft (``method.verify``); on full acceptance answer with the bonus
token, else keep a :class:`~xcosd.methods.RejectState` and answer with the
method's rejection payload, then serve follow-up requests until the device's next
draft reports the token it resolved.

Per session state (:class:`CloudPhase`, changed only through
:data:`CLOUD_TRANSITIONS`)::

    idle ──draft──► scoring ──accepted──► idle        (all accepted: bonus sent)
      ▲                          └─rejected─► resolving   (rejection payload sent)
      └─────────────draft (with the resolved token)────┘   ◄─request/reply─┘
    any ──close──► closed

A new session's ``open`` may carry round 0's block (:attr:`Open.draft`): the session
then starts in ``idle`` and takes that block as a ``draft`` at once, and round 0's
verdict is the open's only answer (no ``opened``). The block is checked before the
session is kept, so a refused block refuses the open and leaves nothing behind.

Hostile input never raises out of :meth:`CloudConnection.receive`: every refusal
is an :class:`~xcosd.protocol.messages.Error` to the peer plus a
:class:`Rejected` event, and the session concerned keeps its state (a refused
draft can be sent again).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..draws import RoundDraws
from ..errors import (
    ErrorCode,
    ProtocolError,
    XcosdError,
    context_length_message,
)
from ..methods import get_method
from ..methods.base import (
    Draft,
    KeptReject,
    Method,
    RejectState,
    Request,
    Space,
    TokenReply,
)
from ..methods.round import Round, RoundOutcome
from ..methods.tree import (
    DraftTree,
    check_tree,
    check_tree_method,
    server_rows,
)
from ..sampling import SamplingParams
from ..vocab import Vocabulary
from .contexts import (
    BUDGET_CHARS,
    BUDGET_IDS,
    Budget,
    ContextStore,
    RenderStore,
    common_prefix,
)
from .errors import error_code
from .messages import (
    MAX_CANDIDATE_ROUNDS,
    MAX_CANDIDATES,
    MAX_CHAT,
    MAX_RESUME,
    MAX_TEXT,
    PROTOCOL_VERSION,
    Close,
    DraftMsg,
    Error,
    Hello,
    Message,
    Open,
    Opened,
    Ping,
    Pong,
    Redo,
    Render,
    Rendered,
    ReplyMsg,
    RequestMsg,
    ServerLimits,
    VerdictMsg,
    VocabMapAccepted,
    VocabMapUpload,
    VocabRequest,
    VocabTable,
    Welcome,
)
from .output import Output
from .vocab_transfer import space_from_upload, vocab_to_table

# ------------------------------------------------------------------------ phases


class CloudPhase(enum.Enum):
    """Where one cloud session is in its round."""

    IDLE = "idle"            # waiting for the next draft
    SCORING = "scoring"      # the draft is with the scheduler
    RESOLVING = "resolving"  # a rejection's payload went out; follow-ups may come
    CLOSED = "closed"

    #: members compare by identity, so they may hash by it: a C slot, where
    #: ``Enum.__hash__`` is a Python call (twice a round, on every transition)
    __hash__ = object.__hash__


class CloseReason(enum.StrEnum):
    """Why a cloud session ended."""

    CLOSED = "closed"              # the edge closed it
    TIMEOUT = "timeout"            # its peer went silent past the timeout
    DISCONNECTED = "disconnected"  # its peer's connection went away
    ERROR = "error"                # a round failed; the edge got a typed error
    SHUTDOWN = "shutdown"          # the cloud is stopping


class CloudStep(enum.Enum):
    """What moves a cloud session from one phase to the next."""

    DRAFT = "draft"
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    CLOSE = "close"

    __hash__ = object.__hash__  # as CloudPhase's


#: Every legal move of a cloud session; anything else is a ``state`` error.
CLOUD_TRANSITIONS: dict[tuple[CloudPhase, CloudStep], CloudPhase] = {
    (CloudPhase.IDLE, CloudStep.DRAFT): CloudPhase.SCORING,
    (CloudPhase.RESOLVING, CloudStep.DRAFT): CloudPhase.SCORING,
    (CloudPhase.SCORING, CloudStep.ACCEPTED): CloudPhase.IDLE,
    (CloudPhase.SCORING, CloudStep.REJECTED): CloudPhase.RESOLVING,
    **{(p, CloudStep.CLOSE): CloudPhase.CLOSED
       for p in (CloudPhase.IDLE, CloudPhase.SCORING, CloudPhase.RESOLVING)},
}


# ------------------------------------------------------------------------ events


class ModelSlot:
    """Where the node keeps a session's model state (its handle on the target's
    context). Apart from the protocol session on purpose: the node's worker thread
    starts, extends and frees the model state while the event loop runs the
    protocol, and neither touches the other's."""

    __slots__ = ("handle", "tenant")

    def __init__(self, tenant: str) -> None:
        #: the node's model session (opaque here)
        self.handle: Any = None
        #: whose it is (a model that keeps ended sessions' caches shares its room
        #: fairly between tenants: xcosd/models/prefix_cache.py)
        self.tenant = tenant


@dataclass(eq=False)
class ScoreNeeded:
    """Score ``new_ids`` with the target model in ``model``'s context, then verify
    ``round``.

    Before scoring, the model context must be: started with ``start_ids`` (first
    round only), cut back to ``keep`` tokens, extended by ``append`` (tokens
    committed since the last round that the model has not seen). What the compute
    reads is here as plain data (``round``, a snapshot) and ``model``; ``session`` is
    only the address its outcome goes back to, on the event loop
    (:meth:`CloudConnection.scored`), and the compute never reads it.
    """

    session: CloudSession
    round: Round
    model: ModelSlot
    start_ids: list[int] | None
    keep: int
    append: list[int]
    new_ids: list[int]
    #: set by the node: when the request entered the queue (for queue-wait metrics)
    enqueued_at: float = 0.0
    #: a draft tree's parents (``new_ids`` are its nodes): score it with
    #: :func:`~xcosd.models.tree_scoring.score_tree`, whose rows are after the
    #: context and after each node's path, and which leaves the context as it was
    parents: list[int] | None = None


@dataclass(eq=False)
class SessionOpened:
    session: CloudSession


@dataclass(eq=False)
class SessionClosed:
    """The session is over; the node drops its queued work and frees its model state."""

    session: CloudSession
    reason: CloseReason


@dataclass(eq=False)
class Rejected:
    """A message was refused with an error (or dropped); counted and logged."""

    code: str
    message: str
    s: int | None = None


@dataclass(eq=False)
class RoundVerified:
    """A round's verdict went out: ``accepted`` of ``drafted``."""

    session: CloudSession
    drafted: int
    accepted: int
    #: a tree round's shape (``TreeShape.label``); ``None`` for a chain
    shape: str | None = None


@dataclass(eq=False)
class RenderNeeded:
    """Make request ``n``'s prompt into target ids with the target: ``text`` with its
    tokenizer, or ``chat`` (role, content pairs) with its chat template, the
    generation prompt added. The node does it (tokenizers are the model layer's, and
    slow enough to keep off the event loop) and answers with
    :meth:`CloudConnection.rendered`."""

    conn: CloudConnection
    n: int
    text: str | None
    chat: tuple[tuple[str, str], ...] | None
    #: a request by reference: the ids its base rendered to (the answer is relative)
    base_ids: np.ndarray | None = None


Event = ScoreNeeded | SessionOpened | SessionClosed | Rejected | RoundVerified | RenderNeeded
class CloudOutput(Output[Event]):
    """What :meth:`CloudConnection.receive` returns. A subclass, not the alias
    ``Output[Event]``: calling a generic alias goes through ``typing`` (it sets
    ``__orig_class__`` on every instance), a cost each message paid."""


# ------------------------------------------------------------------- shared config


#: V_C maps one connection may hold pinned (an upload past it unpins its oldest)
MAX_MAPS_PER_PEER = 2


class CloudConfig:
    """What every connection of one cloud shares: the target vocabulary and
    tokenizer, the limits, the known V_C maps, the live session count.

    Maps are shared by fingerprint (many edges with one draft model upload once) and
    *pinned* by the connections using them: only an unpinned map is ever evicted, so
    no peer can push another's map out by uploading its own; with ``max_maps`` maps
    known and all of them pinned, an upload is refused as ``busy``. One peer pins at
    most :data:`MAX_MAPS_PER_PEER`. ``max_sessions_per_peer`` (default: half of
    ``limits.max_sessions``) keeps one peer from taking every session.
    """

    def __init__(self, target_vocab: Vocabulary, tokenize: Callable[[str], list[int]],
                 limits: ServerLimits, server_id: str, *, max_maps: int = 32,
                 methods: tuple[str, ...] | None = None,
                 default_options: dict[str, dict[str, Any]] | None = None,
                 max_sessions_per_peer: int | None = None) -> None:
        self.vocab = target_vocab
        self.tokenize = tokenize
        self.limits = limits
        #: what every connection's render and context stores hold together
        #: (:mod:`xcosd.protocol.contexts`)
        self.held_ids = Budget(BUDGET_IDS)
        self.held_chars = Budget(BUDGET_CHARS)
        self.server_id = server_id
        self.maps: OrderedDict[str, Space] = OrderedDict()
        #: fingerprint -> how many connections pin it
        self.pins: dict[str, int] = {}
        self.max_maps = max_maps
        self.max_sessions_per_peer = (max_sessions_per_peer if max_sessions_per_peer is not None
                                      else max(1, limits.max_sessions // 2))
        self.methods = methods
        self.default_options = default_options or {}
        self.sessions = 0
        self.stop_ids = tuple(sorted({target_vocab.roles[r] for r in ("eos", "eot")
                                      if r in target_vocab.roles}))
        self._table: VocabTable | None = None

    @property
    def table(self) -> VocabTable:
        if self._table is None:
            self._table = vocab_to_table(self.vocab)
        return self._table

    def space(self, fp: str) -> Space | None:
        sp = self.maps.get(fp)
        if sp is not None:
            self.maps.move_to_end(fp)
        return sp

    def remember(self, fp: str, space: Space) -> None:
        """Know ``space`` as ``fp``; past ``max_maps``, forget the least recently used
        unpinned map (``busy`` when every map is pinned)."""
        if fp not in self.maps and len(self.maps) >= self.max_maps:
            free = next((k for k in self.maps if not self.pins.get(k)), None)
            if free is None:
                raise ProtocolError(f"the cloud holds {self.max_maps} V_C maps, all in use; "
                                    "retry later", code="busy")
            del self.maps[free]
        self.maps[fp] = space
        self.maps.move_to_end(fp)

    def pin(self, fp: str) -> None:
        self.pins[fp] = self.pins.get(fp, 0) + 1

    def unpin(self, fp: str) -> None:
        n = self.pins.get(fp, 0) - 1
        if n > 0:
            self.pins[fp] = n
        else:
            self.pins.pop(fp, None)


# ----------------------------------------------------------------------- session


def _open_key(msg: Open) -> tuple[Any, ...]:
    """What tells a duplicated ``open`` from another one with the same ``seq``."""
    return (msg.seq, msg.map_fp, msg.method, msg.codec, msg.seed, msg.max_new_tokens,
            msg.r, int(msg.resume.shape[0]), msg.prompt,
            -1 if msg.draft is None else msg.draft.length, msg.base, msg.keep)


class CloudSession:
    """One generation on the cloud: method, space, sampling, randomness and the
    bookkeeping that keeps the target model's context in step with the device."""

    def __init__(self, conn: CloudConnection, msg: Open, method: Method, space: Space,
                 prompt_ids: list[int]) -> None:
        self.conn = conn
        self.s = msg.s
        self.method = method
        self.space = space
        self.params = SamplingParams(msg.temperature, msg.top_k, msg.top_p)
        #: the key of the session's counter-based draws (:mod:`xcosd.draws`): the
        #: seed, or fresh entropy without one
        self.seed = (int(msg.seed) if msg.seed is not None
                     else int(np.random.SeedSequence().generate_state(1, np.uint64)[0]))
        self.max_new_tokens = msg.max_new_tokens
        # the model starts from the prompt alone and is then given the resumed ids, so
        # a resumed context is built exactly as the original was (a model that puts a
        # start token before an empty prompt still does)
        self.start_ids: list[int] | None = list(prompt_ids)
        self.prompt_tokens = len(prompt_ids)
        self.phase = CloudPhase.IDLE
        self.last_seq = msg.seq
        self.next_round = msg.r
        self.round = msg.r - 1
        #: tokens of context the model holds that are committed (prompt + generated)
        self.committed = len(self.start_ids)
        #: committed tokens the model has not seen yet (resumed ids, the bonus of a
        #: full acceptance)
        self.pending: list[int] = [int(i) for i in msg.resume.tolist()]
        #: target tokens generated in this session (the resumed ones included)
        self.generated = len(self.pending)
        #: the last answer sent (verdict, reply or opened): sent again, not
        #: recomputed, when the edge repeats the message it answers (a lost answer)
        self.last_answer: Message | None = None
        #: type and round of the last accepted message (a repeat must match them)
        self.last_key: tuple[str, int] = (msg.TYPE, msg.r)
        self.open_key = _open_key(msg)
        self.redo: Redo | None = None
        #: the seq of the draft being verified (its verdict answers it)
        self.draft_seq = 0
        self.draft: Draft | None = None
        self.reject: RejectState | KeptReject | None = None
        self.final_token: int | None = None
        #: the node's model state for this session (its worker thread's, not the loop's)
        self.model = ModelSlot(bytes(conn.peer).hex())
        self.rounds = 0
        self.drafted = 0
        self.accepted = 0
        self.requests = 0

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.conn.peer, self.s)

    @property
    def closed(self) -> bool:
        return self.phase is CloudPhase.CLOSED

    def advance(self, event: CloudStep) -> None:
        """Move to the phase :data:`CLOUD_TRANSITIONS` names for ``event``, or raise
        ``state`` (the session keeps its phase)."""
        nxt = CLOUD_TRANSITIONS.get((self.phase, event))
        if nxt is None:
            raise ProtocolError(f"session {self.s}: {event.value} is not allowed in phase "
                                f"{self.phase.value}", code="state")
        self.phase = nxt


# -------------------------------------------------------------------- connection


class CloudConnection:
    """The protocol with one peer: handshake, its sessions, heartbeats."""

    def __init__(self, config: CloudConfig, peer: bytes) -> None:
        self.config = config
        self.peer = peer
        self.sessions: dict[int, CloudSession] = {}
        self.greeted = False
        #: the V_C maps this peer pinned, oldest first (see CloudConfig)
        self.pinned: list[str] = []
        #: what this peer's next turns may name instead of sending
        #: (:mod:`xcosd.protocol.contexts`)
        self.renders = RenderStore(budget=config.held_chars)
        self.contexts = ContextStore(budget=config.held_ids)

    def _pin(self, fp: str) -> None:
        if fp in self.pinned:
            return
        if len(self.pinned) >= MAX_MAPS_PER_PEER:
            self.config.unpin(self.pinned.pop(0))
        self.pinned.append(fp)
        self.config.pin(fp)

    # -- entry points ---------------------------------------------------------

    def receive(self, msg: Message) -> CloudOutput:
        """Handle one message from the peer. Never raises on bad input."""
        s = getattr(msg, "s", None)
        try:
            return self._dispatch(msg)
        except XcosdError as e:
            return self.refuse(e.code, e.message, s, getattr(msg, "r", None))
        except (TypeError, ValueError) as e:
            return self.refuse(error_code(e), str(e), s, getattr(msg, "r", None))

    def refuse(self, code: str, message: str, s: int | None = None,
               r: int | None = None) -> CloudOutput:
        """An error to the peer and a :class:`Rejected` event."""
        return CloudOutput([Error(code, message, s, r)], [Rejected(code, message, s)])

    def scored(self, session: CloudSession, outcome: RoundOutcome) -> CloudOutput:
        """The scheduler's answer to a :class:`ScoreNeeded` for ``session``."""
        if session.closed or self.sessions.get(session.s) is not session:
            return CloudOutput()  # closed meanwhile: drop the result
        if outcome.error is not None:
            e = outcome.error
            out = self.refuse(e.code, f"round {session.round}: {e.message}", session.s,
                              session.round)
            out.extend(self.end(session, CloseReason.ERROR))
            return out
        n = outcome.accepted
        draft = session.draft
        assert draft is not None
        d = draft.length
        nodes = draft.path(n)
        n_acc = len(nodes)
        # a chain's accepted drafts stay in the model's context; a tree's never entered
        # it (score_tree leaves the context as it was): its path is committed the way a
        # bonus is, appended before the next round's scoring
        if draft.stays_in_context:
            kept, walked = n_acc, []
        else:
            kept, walked = 0, [int(draft.ids[v]) for v in nodes]
        session.committed += kept
        session.reject = outcome.reject
        if outcome.redo:  # the verdict was given before the restart; answer the follow-up
            session.redo = None
            session.generated += n_acc
            session.requests += 1
            session.final_token = (int(outcome.reply.token)
                                   if isinstance(outcome.reply, TokenReply) else None)
            session.pending = walked
            session.advance(CloudStep.REJECTED)
            reply = ReplyMsg(session.s, session.round, outcome.reply, ack=session.draft_seq)
            session.last_answer = reply
            return CloudOutput([reply])
        session.rounds += 1
        session.drafted += d
        session.accepted += n_acc
        session.generated += n_acc + (1 if outcome.reject is None else 0)
        if outcome.reject is None:
            assert isinstance(outcome.reply, TokenReply)
            session.pending = [*walked, int(outcome.reply.token)]
            session.final_token = None
            session.advance(CloudStep.ACCEPTED)
        else:
            session.pending = walked
            session.final_token = (int(outcome.reply.token)
                                   if isinstance(outcome.reply, TokenReply) else None)
            session.advance(CloudStep.REJECTED)
        msg = VerdictMsg(session.s, session.round, n, outcome.reply,
                         int(outcome.compute_s * 1e6), ack=session.draft_seq)
        session.last_answer = msg
        return CloudOutput([msg], [RoundVerified(session, d, n_acc, draft.tree_label)])

    def rendered(self, need: RenderNeeded, ids: list[int] | None = None,
                 error: XcosdError | None = None) -> CloudOutput:
        """The node's answer to a :class:`RenderNeeded`: the ids, or why not (an
        error that names the request, so the edge knows which one failed).

        More ids than a ``rendered`` message may carry (:data:`MAX_RESUME`; a chat of
        legal size can render to more, its template adding tokens to each message)
        are refused ``too_large`` here: sent anyway, the edge would drop the answer
        as malformed and ask again until its deadline.

        The request and its ids are kept (``renders``, ``contexts``): the next turn
        names them. A request by reference gets the ids after those it shares with
        its base's answer (``keep``)."""
        n = need.n
        if error is None and ids is not None and len(ids) > MAX_RESUME:
            error = XcosdError(f"the prompt renders to {len(ids)} target tokens, more than "
                               f"the {MAX_RESUME} an answer carries", code="too_large")
        if error is not None:
            code = str(error.code)
            return CloudOutput([Error(code, error.message, n=n)],
                               [Rejected(code, error.message)])
        assert ids is not None
        a = np.asarray(ids, dtype=np.int64)
        self.renders.put(need.text, need.chat, a)
        self.contexts.put(a)
        keep = 0 if need.base_ids is None else common_prefix(need.base_ids, a)
        return CloudOutput([Rendered(n, a[keep:], keep=keep)])

    def end(self, session: CloudSession, reason: CloseReason) -> CloudOutput:
        """Close ``session`` (edge closed it, timed out, failed)."""
        if session.closed:
            return CloudOutput()
        session.advance(CloudStep.CLOSE)
        session.draft = session.reject = None
        session.last_answer = None
        if self.sessions.get(session.s) is session:
            del self.sessions[session.s]
            self.config.sessions -= 1
        return CloudOutput([], [SessionClosed(session, reason)])

    def drop(self, reason: CloseReason = CloseReason.TIMEOUT) -> CloudOutput:
        """The peer is gone: end every session, unpin its maps."""
        out = CloudOutput()
        for sess in list(self.sessions.values()):
            out.extend(self.end(sess, reason))
        for fp in self.pinned:
            self.config.unpin(fp)
        self.pinned = []
        self.renders.clear()  # what it held for its next turns goes back to the budget
        self.contexts.clear()
        return out

    # -- dispatch ---------------------------------------------------------------

    def _dispatch(self, msg: Message) -> CloudOutput:
        if type(msg) is DraftMsg and self.greeted:  # nearly every message: no type chain
            return self._session_message(msg)
        if isinstance(msg, Pong):
            return CloudOutput()
        if isinstance(msg, Hello):
            return self._hello(msg)
        if isinstance(msg, Error):
            return CloudOutput([], [Rejected("peer_error", f"{msg.code}: {msg.message}", msg.s)])
        if not self.greeted:
            # also for pings: an edge whose cloud restarted learns it from this error
            raise ProtocolError(f"{msg.TYPE} before hello", code="handshake")
        if isinstance(msg, Ping):
            return CloudOutput([Pong(msg.n)])
        if isinstance(msg, VocabRequest):
            return CloudOutput([self.config.table])
        if isinstance(msg, Render):
            return self._render(msg)
        if isinstance(msg, VocabMapUpload):
            space = self.config.space(msg.fingerprint)
            if space is None:
                space = space_from_upload(msg, self.config.vocab)
                if msg.fingerprint not in self.pinned and len(self.pinned) >= MAX_MAPS_PER_PEER:
                    # its own oldest map makes room first, so a peer can always replace
                    # its maps (and only its own)
                    self.config.unpin(self.pinned.pop(0))
                self.config.remember(msg.fingerprint, space)
            self._pin(msg.fingerprint)
            return CloudOutput([VocabMapAccepted(msg.fingerprint)])
        if isinstance(msg, Open):
            return self._open(msg)
        if isinstance(msg, (DraftMsg, RequestMsg, Close)):
            return self._session_message(msg)
        raise ProtocolError(f"the cloud does not accept {msg.TYPE!r}", code="unknown_type")

    def _session_message(self, msg: DraftMsg | RequestMsg | Close) -> CloudOutput:
        """A draft, a follow-up or a close of one of this peer's sessions."""
        sess = self.sessions.get(msg.s)
        if sess is None:
            raise ProtocolError(f"session {msg.s} does not exist", code="no_session")
        if (msg.seq == sess.last_seq and not isinstance(msg, Close)
                and sess.last_key == (msg.TYPE, msg.r)):
            return self._repeat(sess, msg.seq)
        if msg.seq <= sess.last_seq:
            raise ProtocolError(f"session {msg.s}: sequence number {msg.seq} already "
                                f"seen (last {sess.last_seq})", code="replay")
        if isinstance(msg, Close):
            sess.last_seq = msg.seq
            return self.end(sess, CloseReason.CLOSED)
        out = self._draft(sess, msg) if isinstance(msg, DraftMsg) else self._request(sess, msg)
        sess.last_seq = msg.seq  # only an accepted message consumes its number
        sess.last_key = (msg.TYPE, msg.r)
        return out

    def _repeat(self, sess: CloudSession, seq: int) -> CloudOutput:
        """The edge sent its last message again (it lost the answer, or the message
        was duplicated on the way): send the same answer again. Never recomputed: a
        second verification would draw new random numbers for a round whose first
        draw may already be out. While the answer is being computed there is
        nothing to send; it goes out when ready."""
        ans = sess.last_answer
        if ans is not None and getattr(ans, "ack", None) == seq:
            return CloudOutput([ans], [Rejected("replay", "repeated: answered again", sess.s)])
        return CloudOutput([], [Rejected("replay", "repeated: its answer is on its way", sess.s)])

    def _hello(self, msg: Hello) -> CloudOutput:
        if msg.version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {msg.version} is not supported; this cloud "
                                f"speaks {PROTOCOL_VERSION}", code="version")
        cfg = self.config
        self.greeted = True
        known = msg.map_fp is not None and cfg.space(msg.map_fp) is not None
        if known:
            assert msg.map_fp is not None
            self._pin(msg.map_fp)
        welcome = Welcome(PROTOCOL_VERSION, cfg.server_id, cfg.vocab.name, cfg.vocab.fingerprint,
                          cfg.vocab.size, cfg.stop_ids, cfg.limits, known)
        out = CloudOutput([welcome])
        if msg.want_vocab:
            out.send.append(cfg.table)
        return out

    def _render(self, msg: Render) -> CloudOutput:
        """A render request, whole or by reference to an earlier one; a refusal names
        the request (``n``), so the edge knows which one to send again."""
        if msg.base is None:
            return CloudOutput([], [RenderNeeded(self, msg.n, msg.text, msg.chat)])
        need = RenderNeeded(self, msg.n, None, None)
        base = self.renders.get(msg.base)
        if base is None:
            return self.rendered(need, error=ProtocolError(
                f"no render {msg.base!r} held here (any more): send the request whole",
                code=ErrorCode.NO_CONTEXT))
        try:
            text, chat = RenderStore.expand(base, msg.keep, msg.text, msg.chat)
        except ValueError as e:
            return self.rendered(need, error=ProtocolError(f"render: {e}", code="bad_field"))
        if chat is not None and len(chat) > MAX_CHAT:
            return self.rendered(need, error=ProtocolError(
                f"render: a chat of more than {MAX_CHAT} messages", code="too_large"))
        size = (sum(len(c.encode()) for _, c in chat) if chat is not None
                else len((text or "").encode()))
        if size > MAX_TEXT:
            return self.rendered(need, error=ProtocolError(
                f"render: more than {MAX_TEXT} bytes of UTF-8", code="too_large"))
        return CloudOutput([], [RenderNeeded(self, msg.n, text, chat, base.ids)])

    def _prompt_ids(self, msg: Open, space: Space) -> list[int]:
        """The context an open starts from: its ids (whole, or after ``keep`` ids of a
        context held here), or its text tokenised by the target."""
        if msg.prompt_ids is None:
            try:
                return [int(i) for i in self.config.tokenize(msg.prompt)]
            except XcosdError as e:
                raise ProtocolError(f"cannot tokenise the prompt: {e.message}",
                                    code="bad_field") from e
        if msg.prompt_ids.shape[0] and int(msg.prompt_ids.max()) >= space.target_size:
            raise ProtocolError("prompt ids outside the target vocabulary", code="bad_token")
        if msg.base is None:
            return [int(i) for i in msg.prompt_ids.tolist()]
        held = self.contexts.get(msg.base)
        if held is None:
            raise ProtocolError(f"no context {msg.base!r} held here (any more): open with "
                                "the whole prompt", code=ErrorCode.NO_CONTEXT)
        if not 0 < msg.keep <= held.shape[0]:
            raise ProtocolError(f"keep {msg.keep} outside the base's 1..{held.shape[0]} ids",
                                code="bad_field")
        if msg.keep + msg.prompt_ids.shape[0] > MAX_RESUME:
            raise ProtocolError(f"a prompt of more than {MAX_RESUME} ids", code="too_large")
        return [int(i) for i in held[:msg.keep].tolist()] + [
            int(i) for i in msg.prompt_ids.tolist()]

    def _open(self, msg: Open) -> CloudOutput:
        cfg = self.config
        old = self.sessions.get(msg.s)
        if old is not None:
            if msg.seq == old.last_seq and old.open_key == _open_key(msg):
                return self._repeat(old, msg.seq)  # a duplicated open: its answer again
            if msg.seq < old.last_seq:  # a late copy of an earlier open
                raise ProtocolError(f"session {msg.s}: open with sequence number {msg.seq} "
                                    f"already seen (last {old.last_seq})", code="replay")
            if msg.seq == old.last_seq:
                raise ProtocolError(f"session {msg.s} is already open", code="session_exists")
        if msg.draft is not None and (old is not None or msg.r or msg.resume.shape[0]):
            raise ProtocolError(f"session {msg.s}: a draft rides only on a new session's "
                                "first open", code="bad_field")
        if msg.resume.shape[0] > msg.max_new_tokens:
            raise ProtocolError(f"resume of {msg.resume.shape[0]} tokens exceeds "
                                f"max_new_tokens={msg.max_new_tokens}", code="bad_field")
        space = cfg.space(msg.map_fp)
        if space is None:
            raise ProtocolError(f"unknown V_C map {msg.map_fp!r}: upload it (vmap) first; the "
                                "two sides' vocabularies must match", code="vocab")
        if cfg.methods is not None and msg.method not in cfg.methods:
            raise ProtocolError(f"method {msg.method!r} is not served here", code="method")
        try:
            opts = {**cfg.default_options.get(msg.method, {}), **msg.options}
            method = get_method(msg.method, codec=msg.codec, **opts)
            params = SamplingParams(msg.temperature, msg.top_k, msg.top_p)
        except XcosdError as e:
            raise ProtocolError(f"cannot serve method {msg.method!r} with codec "
                                f"{msg.codec!r}: {e.message}", code="method") from e
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"cannot serve method {msg.method!r} with codec "
                                f"{msg.codec!r}: {e}", code="method") from e
        del params
        m_rounds = getattr(method, "M", None)
        if isinstance(m_rounds, int) and m_rounds > MAX_CANDIDATE_ROUNDS:
            raise ProtocolError(f"method {msg.method!r}: M={m_rounds} exceeds the limit of "
                                f"{MAX_CANDIDATE_ROUNDS} candidate rounds", code="method")
        k = getattr(method, "K", None)
        if isinstance(k, int) and k > MAX_CANDIDATES:
            # K candidates go out in one reply: more than the wire carries would be
            # refused by the edge (and a hostile K could make the cloud allocate
            # gigabytes when it samples them)
            raise ProtocolError(f"method {msg.method!r}: K={k} exceeds the limit of "
                                f"{MAX_CANDIDATES} candidates per reply", code="method")
        if msg.resume.shape[0] and int(msg.resume.max()) >= space.target_size:
            raise ProtocolError("resume ids outside the target vocabulary", code="bad_token")
        if cfg.sessions >= cfg.limits.max_sessions:
            raise ProtocolError(f"the cloud is at its limit of {cfg.limits.max_sessions} "
                                "sessions; retry later", code="busy")
        if old is None and len(self.sessions) >= cfg.max_sessions_per_peer:
            raise ProtocolError(f"this peer is at its limit of {cfg.max_sessions_per_peer} "
                                "sessions; retry later", code="busy")
        prompt_ids = self._prompt_ids(msg, space)
        context = cfg.limits.context
        if context and len(prompt_ids) + msg.max_new_tokens > context:
            raise ProtocolError(context_length_message(context, len(prompt_ids),
                                                       msg.max_new_tokens),
                                code=ErrorCode.CONTEXT_LENGTH)
        out = CloudOutput()
        if old is not None:  # the edge re-opened it (it resumed): the old one ends
            out.extend(self.end(old, CloseReason.CLOSED))
        sess = CloudSession(self, msg, method, space, prompt_ids)
        # round 0's block riding on the open is checked before the session is kept:
        # a refused block refuses the open too, and leaves nothing behind
        first = (self._draft(sess, DraftMsg(msg.s, msg.seq, 0, None, msg.draft))
                 if msg.draft is not None else None)
        self.sessions[msg.s] = sess
        cfg.sessions += 1
        if msg.prompt_ids is not None and not msg.r:
            self.contexts.put(prompt_ids)  # the next turn of a token-id prompt names it
        out.events.append(SessionOpened(sess))
        if first is not None:  # its verdict answers the open
            out.extend(first)
            return out
        opened = Opened(msg.s, sess.prompt_tokens, ack=msg.seq)
        sess.last_answer = opened
        out.send.append(opened)
        return out

    def _draft(self, sess: CloudSession, msg: DraftMsg) -> CloudOutput:
        if sess.phase is CloudPhase.SCORING:
            raise ProtocolError(f"session {sess.s}: round {sess.round} is still being "
                                "verified", code="state")
        if msg.r != sess.next_round:
            code = "replay" if msg.r < sess.next_round else "state"
            raise ProtocolError(f"session {sess.s}: draft for round {msg.r}, expected "
                                f"{sess.next_round}", code=code)
        sp, m, draft = sess.space, sess.method, msg.draft
        d = draft.length
        ids = draft.ids.tolist()
        # a round commits at most its depth + 1 tokens: a chain's length, a tree's depth
        depth = self._check_block(m, draft, ids, sp)
        # max_new_tokens binds the cloud too: a round may not start past it, nor draft
        # more than it leaves room for (the edge drafts at most remaining - 1)
        left = sess.max_new_tokens - sess.generated - (sess.phase is CloudPhase.RESOLVING)
        if left <= 0 or depth > left - 1:
            raise ProtocolError(f"session {sess.s}: a round of {depth} drafts exceeds what is "
                                f"left of max_new_tokens={sess.max_new_tokens} "
                                f"({max(left, 0)} tokens)", code="bad_field")
        redo = msg.redo
        if redo is not None:
            if sess.rounds or sess.requests or sess.phase is not CloudPhase.IDLE:
                raise ProtocolError(f"session {sess.s}: a redone round must be the first "
                                    "after the open", code="state")
            if not draft.rejects(redo.accepted):
                raise ProtocolError(f"session {sess.s}: redone round accepts {redo.accepted} "
                                    f"of {d} drafts: it was a rejection", code="bad_field")
        append = list(sess.pending)
        if sess.phase is CloudPhase.RESOLVING:
            tok = msg.token
            if tok is None:
                raise ProtocolError(f"session {sess.s}: the draft after a rejection must carry "
                                    "the resolved token", code="bad_field")
            self._check_resolved(sess, tok)
            append.append(tok)
        elif msg.token is not None:
            raise ProtocolError(f"session {sess.s}: no rejection to resolve in round "
                                f"{sess.round}", code="bad_token")
        req = ScoreNeeded(sess, Round(m, sp, sess.params, draft, sess.seed, msg.r, redo),
                          sess.model, sess.start_ids, sess.committed, append, ids,
                          # a block that leaves the context as it was is scored as a tree
                          parents=None if draft.stays_in_context else list(draft.shape.parents))
        sess.start_ids = None
        sess.committed += len(append)
        if sess.phase is CloudPhase.RESOLVING:
            sess.generated += 1  # the resolved token
        sess.pending = []
        sess.draft = draft
        sess.reject = None
        sess.redo = redo
        sess.draft_seq = msg.seq
        sess.round = msg.r
        sess.next_round = msg.r + 1
        sess.advance(CloudStep.DRAFT)
        return CloudOutput([], [req])

    def _check_block(self, m: Method, block: Draft, ids: list[int], sp: Space) -> int:
        """A round's block as this cloud verifies it; its depth. Refused before
        anything is scored, so the session keeps its phase and the edge may send
        another block. A block whose drafts stay in the context is a chain: at most
        ``max_draft`` drafts, none for a method that takes none, every id in V_C, and
        the draft vectors its method takes (:meth:`_check_vectors`). One that does not
        is a tree (:meth:`_check_tree`, which refuses all of that too). ``ids``: the
        block's ids as a list."""
        if not block.stays_in_context:
            assert isinstance(block, DraftTree)  # the one block kind that leaves it
            return self._check_tree(m, block, sp)
        d = block.length
        if d > self.config.limits.max_draft:
            raise ProtocolError(f"draft of {d} tokens exceeds the limit of "
                                f"{self.config.limits.max_draft}", code="bad_field")
        if d and not m.drafts:
            raise ProtocolError(f"method {m.name} takes no drafts", code="bad_field")
        if d and (min(ids) < 0 or max(ids) >= sp.target_size
                  or not all(map(sp.common_bytes.__getitem__, ids))):
            raise ProtocolError("a drafted id is not in V_C", code="bad_token")
        self._check_vectors(m, block)
        return d  # a chain's depth

    def _check_tree(self, m: Method, tree: DraftTree, sp: Space) -> int:
        """A tree block as this cloud verifies it (its size within ``max_tree``, a
        method and codec trees keep exact, a tree whose rows decode and whose ``q(x)``
        are its rows' values); its depth. Refused before anything is scored, so the
        session keeps its phase and the edge may send another block."""
        cap = self.config.limits.max_tree
        if tree.size > cap:
            raise ProtocolError(f"a draft tree of {tree.size} nodes exceeds this cloud's limit "
                                f"of {cap}" + (" (it verifies chains only)" if not cap else ""),
                                code="bad_field")
        try:
            check_tree_method(m)
        except ValueError as e:
            raise ProtocolError(f"no draft trees here: {e}", code="method") from e
        check_tree(tree, sp)
        try:
            server_rows(m, tree, sp)
        except (ValueError, XcosdError) as e:
            if isinstance(e, ProtocolError):
                raise
            raise ProtocolError(f"a tree's rows do not decode: {e}", code="bad_vector") from e
        return tree.shape.depth

    @staticmethod
    def _check_vectors(m: Method, draft: Draft) -> None:
        d = draft.length
        if m.codec_applies_to != "q" or d == 0:
            if draft.q_vectors or draft.verify_mask is not None:
                raise ProtocolError(f"method {m.name} takes no draft vectors", code="bad_field")
            return
        mask = draft.verify_mask
        want = d if mask is None else int(np.count_nonzero(mask))
        if m.name == "uhlm" and mask is None:
            raise ProtocolError("uhlm needs a verify mask", code="bad_field")
        if draft.q_vectors is None or len(draft.q_vectors) != want:
            raise ProtocolError(f"{m.name}: expected {want} draft vectors", code="bad_field")

    def _check_resolved(self, sess: CloudSession, tok: int) -> None:
        rej = sess.reject
        if not 0 <= tok < sess.space.target_size:
            raise ProtocolError(f"token {tok} is outside the target vocabulary", code="bad_token")
        if sess.final_token is not None:
            if tok != sess.final_token:
                raise ProtocolError(f"resolved token {tok} is not the one the cloud sent "
                                    f"({sess.final_token})", code="bad_token")
        elif rej is None or not float(rej.p_star[tok]) > 0:
            raise ProtocolError(f"resolved token {tok} has no probability", code="bad_token")

    def _request(self, sess: CloudSession, msg: RequestMsg) -> CloudOutput:
        if sess.phase is not CloudPhase.RESOLVING or msg.r != sess.round or sess.reject is None:
            code = "replay" if msg.r < sess.round else "state"
            raise ProtocolError(f"session {sess.s}: no rejection to follow up in round "
                                f"{msg.r}", code=code)
        rej = sess.reject
        if isinstance(rej, RejectState):  # drawn from the round's counters
            reply = sess.method.on_request(rej, Request(msg.kind), sess.space,
                                           RoundDraws(sess.seed, sess.round))
        else:  # kept where the target's rows are (its device), answered there
            reply = rej.answer(sess.method, Request(msg.kind), sess.space)
        sess.requests += 1
        sess.final_token = int(reply.token) if isinstance(reply, TokenReply) else None
        ans = ReplyMsg(sess.s, msg.r, reply, ack=msg.seq)
        sess.last_answer = ans
        return CloudOutput([ans])

