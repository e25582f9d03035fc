"""The device's side of the protocol as a sans-I/O state machine.

:class:`EdgeHandshake` runs a connection's handshake (hello, the target
vocabulary if the device lacks it, the V_C map upload if the cloud lacks it).
:class:`EdgeSession` runs one generation: it produces the ``open``, each round's
``draft`` and the follow-up ``request`` messages, and turns the cloud's verdicts
and replies into emitted tokens and text. It never touches a socket, a clock or a
model: the drafting it needs it asks for with a :class:`DraftNeeded` event (as the
cloud asks for scoring with ``ScoreNeeded``); the node runs the draft model where it
may run (``xcosd/nodes/drafter.py``, in a worker thread) and hands the drafts back
through :meth:`EdgeSession.drafted`.

A round on the device, as in ``xcosd/simulate.py``: draft ``d`` tokens from the
TLI distribution (the draft's warped row restricted to V_C,
:func:`~xcosd.methods.tli.restrict_to_common`, computed from the warpers' kept set
by :func:`~xcosd.methods.tli.restrict_kept_support`), sampling each from
``method.draft_row(q)``; uplink ``method.draft_message``; on a rejection keep
``DeviceState(q_common=draft_row(q_j))`` and call ``method.resolve`` on each reply
until it yields a token. The token travels to the cloud with the next draft.

Session phases (:class:`EdgePhase`, changed only through
:data:`EDGE_TRANSITIONS`)::

    new ─open─► opening ─opened─► ready ─draft─► waiting ─verdict─► ready | done
                                    └─draft needed─► drafting ─drafted─┘
                                                     waiting └─► resolving ─reply─► ready | done
    new ─draft needed─► drafting ─drafted (the open with round 0's block)─► waiting
    (open again from any live phase: resume after a cloud restart)
    opening ─opened (a rejection was being resolved)─► resolving
    any ─close─► closed

A new session's first round does not wait for ``opened``: :meth:`EdgeSession.next_round`
on phase ``new`` drafts round 0 and sends it inside the ``open``
(:attr:`~xcosd.protocol.messages.Open.draft`), and the cloud answers with round 0's
verdict. A generation's first token comes one round trip sooner. A resume opens
the plain way (:meth:`EdgeSession.open`), since what it continues decides its
first message.

Faults. Every cloud answer names the ``seq`` it answers (``ack``): one that answers
an older message (late, duplicated, or from before a restart) is dropped; a
``replay`` error means the cloud already had a message and is dropped too. After a
lost answer the node sends the last message again with the same ``seq``
(:meth:`EdgeSession.resend_last`) and the cloud repeats its answer. A resume
(:meth:`EdgeSession.open` again) abandons a round whose verdict the device has not
seen (nothing of it is known, so drawing it anew is exact), completes one whose
verdict it has seen (:class:`~xcosd.protocol.messages.Redo`) and gives the cloud a
fresh seed: never the first one again, or its random stream would replay.
"""

from __future__ import annotations

import codecs
import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import ProtocolError, VocabError, XcosdError
from ..methods.base import (
    CandidatesReply,
    DeviceState,
    Draft,
    HybridReply,
    Method,
    Reply,
    Request,
    Space,
    TokenReply,
)
from ..methods.tree import DeviceTree, TreeShape, rejection_state
from ..policies.draft_length import DEFAULT_COST, DraftLength
from ..policies.tree_policy import RankRates, walk_ranks
from ..vocab import VocabMap, Vocabulary
from .errors import exception_for
from .messages import (
    PROTOCOL_VERSION,
    Close,
    DraftMsg,
    Error,
    Hello,
    Message,
    Open,
    Opened,
    Redo,
    ReplyMsg,
    RequestMsg,
    VerdictMsg,
    VocabMapAccepted,
    VocabMapUpload,
    VocabTable,
    Welcome,
)
from .output import Output
from .session_settings import SessionSettings
from .vocab_transfer import table_to_vocab, upload_for

# ---------------------------------------------------------------------- handshake


@dataclass
class HandshakeDone:
    """The connection is ready: sessions may open with this map."""

    vmap: VocabMap
    welcome: Welcome


class HandshakeOutput(Output[HandshakeDone]):
    """What :meth:`EdgeHandshake.receive` returns (a subclass: see
    :class:`~xcosd.protocol.cloud.CloudOutput`)."""


class EdgeHandshake:
    """Connection setup on the device: ``hello`` -> ``welcome`` [-> ``vocab``]
    [-> ``vmap`` -> ``vmap_ok``] -> ready.

    ``build_map(target_vocab)`` makes the :class:`~xcosd.vocab.VocabMap` from the
    target vocabulary (given, or received from the cloud); the cloud must accept its
    fingerprint before any session opens.
    """

    def __init__(self, build_map: Callable[[Vocabulary], VocabMap],
                 target_vocab: Vocabulary | None = None, node: str = "xcosd-edge",
                 vmap: VocabMap | None = None) -> None:
        self.build_map = build_map
        self.target_vocab = target_vocab
        self.vmap = vmap
        self.node = node
        self.welcome: Welcome | None = None
        self.ready = False
        self._wait: str = "welcome"
        #: what was sent last (sent again when its answer is late: see :meth:`resend`)
        self._last: list[Message] = []

    def hello(self) -> Hello:
        self.ready, self._wait = False, "welcome"
        tfp = self.target_vocab.fingerprint if self.target_vocab is not None else None
        mfp = self.vmap.fingerprint if self.vmap is not None else None
        msg = Hello(PROTOCOL_VERSION, self.node, tfp, mfp, self.target_vocab is None)
        self._last = [msg]
        return msg

    def resend(self) -> list[Message]:
        """The last step's messages again, when their answer is late (a lost message):
        every handshake step is idempotent at the cloud, and a duplicated answer is
        dropped here."""
        return [] if self.ready else list(self._last)

    def receive(self, msg: Message) -> HandshakeOutput:
        """Feed a cloud message; returns what to send next, with a
        :class:`HandshakeDone` event once sessions may open. Raises the typed error on
        a refusal or a vocabulary mismatch. A repeated answer (the same cloud's
        ``welcome``, ``vocab`` or ``vmap_ok`` again: a duplicated or resent message)
        is dropped."""
        if isinstance(msg, Error):
            raise exception_for(msg.code, msg.message)
        if self._repeated(msg):
            return HandshakeOutput()
        if isinstance(msg, Welcome) and self._wait == "welcome":
            if msg.version != PROTOCOL_VERSION:
                raise ProtocolError(f"the cloud speaks protocol {msg.version}, this edge "
                                    f"{PROTOCOL_VERSION}", code="version")
            self.welcome = msg
            if self.target_vocab is not None:
                if self.target_vocab.fingerprint != msg.target_fp:
                    raise VocabError(
                        f"the cloud's target vocabulary {msg.target_name!r} (fingerprint "
                        f"{msg.target_fp}) is not the one this edge was given "
                        f"({self.target_vocab.fingerprint})", code="vocab")
                return self._after_vocab(msg.map_known)
            self._wait = "vocab"
            return HandshakeOutput()
        if isinstance(msg, VocabTable) and self._wait == "vocab":
            assert self.welcome is not None
            vocab = table_to_vocab(msg)
            if vocab.fingerprint != self.welcome.target_fp:
                raise VocabError("the cloud's vocabulary table does not match its welcome",
                                 code="vocab")
            self.target_vocab = vocab
            return self._after_vocab(False)
        if isinstance(msg, VocabMapAccepted) and self._wait == "vmap_ok":
            assert self.vmap is not None
            if msg.fingerprint != self.vmap.fingerprint:
                raise VocabError("the cloud accepted another V_C map", code="vocab")
            return self._done()
        if isinstance(msg, (Welcome, VocabTable, VocabMapAccepted)):
            # a handshake answer out of its step: one whose predecessor was lost (the
            # step is sent again and answered in full) or a late copy. Dropped.
            return HandshakeOutput()
        raise ProtocolError(f"unexpected {msg.TYPE!r} during the handshake", code="state")

    def _repeated(self, msg: Message) -> bool:
        w = self.welcome
        if isinstance(msg, Welcome):
            return self._wait != "welcome" and w is not None and msg.server_id == w.server_id
        if isinstance(msg, VocabTable):
            return (self._wait != "vocab" and self.target_vocab is not None
                    and msg.fingerprint == self.target_vocab.fingerprint)
        if isinstance(msg, VocabMapAccepted):
            return (self._wait != "vmap_ok" and self.vmap is not None
                    and msg.fingerprint == self.vmap.fingerprint)
        return False

    def _after_vocab(self, map_known: bool) -> HandshakeOutput:
        assert self.target_vocab is not None
        if self.vmap is None or self.vmap.target.fingerprint != self.target_vocab.fingerprint:
            self.vmap = self.build_map(self.target_vocab)
            map_known = False
        if map_known:
            return self._done()
        self._wait = "vmap_ok"
        up: VocabMapUpload = upload_for(self.vmap)
        self._last = [up]
        return HandshakeOutput([up])

    def _done(self) -> HandshakeOutput:
        assert self.vmap is not None and self.welcome is not None
        self.ready, self._wait = True, ""
        return HandshakeOutput([], [HandshakeDone(self.vmap, self.welcome)])


# ------------------------------------------------------------------------ events


@dataclass
class TokensEmitted:
    """Target tokens committed to the output (``text``: newly complete UTF-8 text)."""

    token_ids: list[int]
    text: str


@dataclass
class RoundSettled:
    drafted: int
    accepted: int
    extra_trips: int
    trials: int
    fallbacks: int
    #: a tree round's shape (``TreeShape.label``); ``None`` for a chain
    shape: str | None = None
    #: the round ended in a rejection (the method resolved a token), not a bonus
    rejected: bool = False


class FinishReason(enum.StrEnum):
    """Why a generation ended (compares equal to its string, as transformers' are)."""

    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"      # a stop token (or, at the node, a stop string)


@dataclass
class Finished:
    reason: FinishReason


@dataclass
class SessionReady:
    prompt_tokens: int


@dataclass
class Retry:
    """The cloud was busy: send the same round again after a pause."""

    error: XcosdError


@dataclass(eq=False)
class DraftNeeded:
    """Draft up to ``length`` tokens for ``session`` with the draft model, then hand
    the result to :meth:`EdgeSession.drafted`.

    The draft model's context must first lose its last ``drop`` tokens and gain
    ``append`` (draft ids): what the rounds since the last draft settled (rejected
    drafts out, the resolved token's draft spelling in). Drafts are sampled from
    ``session.method.draft_row(q)`` with ``session.rng``, q being the TLI vector
    (the draft's warped row restricted to V_C) over ``session.space``.
    """

    session: EdgeSession
    length: int
    drop: int
    append: list[int]
    #: stop after a drafted token whose probability was below this
    #: (:class:`~xcosd.policies.draft_length.DraftLength`; 0: draft ``length``)
    stop_below: float = 0.0
    #: draft a tree of this shape instead of a chain (``xcosd.methods.tree.draft_tree``,
    #: its rows through ``row_codec``, siblings without replacement when ``distinct``),
    #: leaving the draft model's context as it was; hand it to
    #: :meth:`EdgeSession.drafted_tree`
    shape: TreeShape | None = None
    row_codec: str | None = None
    distinct: bool = True


EdgeEvent = TokensEmitted | RoundSettled | Finished | SessionReady | Retry | DraftNeeded


class EdgeOutput(Output[EdgeEvent]):
    """What :meth:`EdgeSession.receive` returns (a subclass: see
    :class:`~xcosd.protocol.cloud.CloudOutput`)."""


# ------------------------------------------------------------------------ phases


class EdgePhase(enum.Enum):
    """Where one generation is on the device."""

    NEW = "new"
    OPENING = "opening"      # ``open`` sent, waiting for ``opened``
    READY = "ready"          # may start the next round
    DRAFTING = "drafting"    # the drafter is asked for this round's drafts
    WAITING = "waiting"      # the round's draft is out, waiting for the verdict
    RESOLVING = "resolving"  # a rejection is being resolved (follow-ups)
    DONE = "done"            # finished (length or stop); only ``close`` is left
    CLOSED = "closed"


class EdgeStep(enum.Enum):
    """What moves a generation from one phase to the next."""

    OPEN = "open"
    OPENED = "opened"
    RESUMED = "resumed"      # opened again while a rejection was being resolved
    DRAFT_NEEDED = "draft_needed"
    DRAFT = "draft"
    REJECTED = "rejected"
    SETTLED = "settled"      # a round ended with tokens and the generation goes on
    FINISHED = "finished"    # the generation reached its length or a stop token
    CLOSE = "close"


_LIVE = (EdgePhase.NEW, EdgePhase.OPENING, EdgePhase.READY, EdgePhase.WAITING,
         EdgePhase.RESOLVING)

#: Every legal move of a generation; anything else is a ``state`` error.
EDGE_TRANSITIONS: dict[tuple[EdgePhase, EdgeStep], EdgePhase] = {
    **{(p, EdgeStep.OPEN): EdgePhase.OPENING for p in _LIVE},
    (EdgePhase.OPENING, EdgeStep.OPENED): EdgePhase.READY,
    (EdgePhase.OPENING, EdgeStep.RESUMED): EdgePhase.RESOLVING,
    (EdgePhase.OPENING, EdgeStep.FINISHED): EdgePhase.DONE,
    (EdgePhase.READY, EdgeStep.DRAFT_NEEDED): EdgePhase.DRAFTING,
    (EdgePhase.READY, EdgeStep.DRAFT): EdgePhase.WAITING,
    # a new session's first round: its block rides on the open (Open.draft)
    (EdgePhase.NEW, EdgeStep.DRAFT_NEEDED): EdgePhase.DRAFTING,
    (EdgePhase.NEW, EdgeStep.DRAFT): EdgePhase.WAITING,
    (EdgePhase.DRAFTING, EdgeStep.DRAFT): EdgePhase.WAITING,
    (EdgePhase.WAITING, EdgeStep.REJECTED): EdgePhase.RESOLVING,
    (EdgePhase.WAITING, EdgeStep.SETTLED): EdgePhase.READY,
    (EdgePhase.WAITING, EdgeStep.FINISHED): EdgePhase.DONE,
    (EdgePhase.RESOLVING, EdgeStep.SETTLED): EdgePhase.READY,
    (EdgePhase.RESOLVING, EdgeStep.FINISHED): EdgePhase.DONE,
    **{(p, EdgeStep.CLOSE): EdgePhase.CLOSED
       for p in (*_LIVE, EdgePhase.DRAFTING, EdgePhase.DONE)},
}


# ------------------------------------------------------------------------ session


class EdgeSession:
    """One generation on the device."""

    def __init__(self, s: int, settings: SessionSettings, *, vmap: VocabMap, space: Space,
                 prompt: str, prompt_ids: np.ndarray | None = None,
                 prompt_base: tuple[str, int] | None = None) -> None:
        """Session ``s`` with ``settings`` (one value, made once: :class:`SessionSettings`)
        over the connection's ``vmap`` and ``space``, for ``prompt`` (text; ``""``
        with ``prompt_ids``)."""
        self.s = s
        #: what this generation was asked to do; the attributes below are its parts,
        #: read by the rounds
        self.settings = settings
        self.method: Method = settings.method
        self.vmap = vmap
        self.space = space
        self.prompt = prompt
        #: the prompt as target ids instead of text (``Open.prompt_ids``)
        self.prompt_ids = prompt_ids
        #: ``(digest, keep)``: the prompt's first ``keep`` ids are a context the
        #: connection holds (:mod:`xcosd.protocol.contexts`); the first open names it
        #: and sends the rest; ``None`` after a refusal (``no_context``), or unused
        self.prompt_base = prompt_base if prompt_ids is not None else None
        #: opens sent again whole because the cloud no longer held their base
        self.whole_reopens = 0
        #: round 0 drafts nothing: the node computes the draft's prompt while the
        #: open's round trip (and the cloud's prefill) is in flight, and the first
        #: token comes from the cloud anyway. Fixed before anything is drawn, from
        #: the prompt alone, so the law is kept as by any draft length
        self.draft_later = False
        self.max_new_tokens = settings.max_new_tokens
        self.params = settings.params
        self.stop_ids = settings.stop_ids
        self.draft_len = settings.draft_len
        self.max_draft = settings.max_draft
        #: the draft-length policy (``draft_len`` is its first round's ceiling)
        auto = settings.draft_cost == "auto"
        self.drafting = DraftLength(settings.draft_len, settings.max_draft_len,
                                    settings.draft_confidence, settings.adaptive_draft,
                                    DEFAULT_COST if auto else float(settings.draft_cost), auto)
        self.options = dict(self.method.options())
        #: draft trees: a fixed shape, ``"auto"`` (:class:`RankRates` picks each round's
        #: shape, chains and ``ar`` included) or ``None`` (chains, by ``drafting``).
        #: ``max_tree``: the most nodes the cloud verifies (its welcome's; 0: chains
        #: only, and a tree asked for is drafted as chains: negotiated down)
        self.tree = settings.tree
        self.max_tree = settings.max_tree
        self.tree_row_codec = settings.tree_row_codec
        self.tree_distinct = settings.tree_distinct
        self.tree_rates = RankRates()
        ss = np.random.SeedSequence(settings.seed)
        dev, srv = ss.spawn(2)
        self.rng = np.random.default_rng(dev)
        self.server_seed = int(srv.generate_state(1, np.uint64)[0])
        #: each resume spawns the cloud a fresh, independent seed from here
        self._server_seeds = srv
        self.opens = 0
        self.phase = EdgePhase.NEW
        self.seq = 0
        self.round = 0
        #: the seq of the message whose answer the session waits for
        self._awaiting = 0
        #: the last message sent that expects an answer (sent again after a loss)
        self._last_sent: Message | None = None
        #: a rejection whose verdict was seen and whose follow-up is outstanding
        self._request_kind: Request | None = None
        self._fallback_seen = False
        self._redo = False
        #: answers dropped as stale (late, duplicated, from before a restart)
        self.stale = 0
        self.token_ids: list[int] = []
        self.text_bytes = bytearray()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending_token: int | None = None
        #: this round's block: a chain's ``Draft`` or a ``DraftTree``
        self._draft: Draft | None = None
        #: per node of the block with children (``-1``: the context), the row (V_C
        #: order) its last child was drawn from: a rejection there resolves with it
        self._rows: dict[int, np.ndarray] = {}
        #: this round's shape under the tree policy (a chain's too), for its estimates
        self._shape: TreeShape | None = None
        self._dev: DeviceState | None = None
        #: draft-context edits not yet handed to the drafter (see DraftNeeded)
        self._drop = 0
        self._append: list[int] = []
        #: drafts this round appended to the draft model's context
        self._drafted = 0
        self._trips = 0
        self._accepted = 0
        self.finish_reason: FinishReason | None = None

    # -- what to send ------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.phase in (EdgePhase.DONE, EdgePhase.CLOSED)

    def _advance(self, step: EdgeStep) -> None:
        nxt = EDGE_TRANSITIONS.get((self.phase, step))
        if nxt is None:
            raise ProtocolError(f"session {self.s}: {step.value} is not allowed in phase "
                                f"{self.phase.value}", code="state")
        self.phase = nxt

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.token_ids)

    def open(self) -> Open:
        """The ``open`` message. Again after a cloud restart, it carries the tokens
        generated so far as ``resume`` and a fresh seed; a round whose verdict was
        not seen is abandoned, one whose verdict was seen is completed after the
        ``opened`` (see the module docstring)."""
        if self.phase is EdgePhase.WAITING or (self.phase is EdgePhase.RESOLVING
                                               and self._request_kind is None):
            self._edit(self._drafted, [])  # the round in flight is abandoned
            self._draft = self._dev = None
        self._redo = self._redo or (self.phase is EdgePhase.RESOLVING
                                    and self._request_kind is not None)
        self._advance(EdgeStep.OPEN)
        msg = self._open_msg(None)
        self._expect(msg)
        return msg

    def _open_msg(self, draft: Draft | None) -> Open:
        """The next ``open`` (its own ``seq``), with round 0's ``draft`` riding on it
        when given; every open after the first gets a fresh seed."""
        seed = self.server_seed
        if self.opens:
            seed = int(self._server_seeds.spawn(1)[0].generate_state(1, np.uint64)[0])
        self.opens += 1
        self._pending_token = None  # it is in the resumed ids
        self.seq += 1
        msg = Open(s=self.s, seq=self.seq, map_fp=self.vmap.fingerprint, method=self.method.name,
                   codec=self.method.codec.name, options=self.options,
                   temperature=self.params.temperature, top_k=self.params.top_k,
                   top_p=self.params.top_p, seed=seed, prompt=self.prompt,
                   max_new_tokens=self.max_new_tokens,
                   resume=np.array(self.token_ids, dtype=np.int64),
                   prompt_ids=self.prompt_ids, r=self.round, draft=draft)
        if self.prompt_base is not None and self.opens == 1:  # by reference: the first only
            assert self.prompt_ids is not None
            key, keep = self.prompt_base
            msg = dataclasses.replace(msg, prompt_ids=self.prompt_ids[keep:], base=key,
                                      keep=keep)
        return msg

    def _reopen_whole(self) -> EdgeOutput:
        """The first open named a context the cloud does not hold (any more): the
        same open with the whole prompt, under a new ``seq`` (a late copy of the
        refused one is then a replay, not a second open)."""
        last = self._last_sent
        assert isinstance(last, Open) and self.prompt_ids is not None
        self.prompt_base = None
        self.whole_reopens += 1
        self.seq += 1
        msg = dataclasses.replace(last, seq=self.seq, prompt_ids=self.prompt_ids, base=None,
                                  keep=0)
        self._expect(msg)
        return EdgeOutput([msg])

    def _expect(self, msg: Message) -> None:
        self._awaiting = self.seq
        self._last_sent = msg

    def resend_last(self) -> Message | None:
        """The last message that waits for an answer, unchanged (same ``seq``): the
        cloud answers it again if it already did. ``None`` when nothing waits."""
        if self.phase in (EdgePhase.OPENING, EdgePhase.WAITING, EdgePhase.RESOLVING):
            return self._last_sent
        return None

    def close(self) -> Close:
        self._advance(EdgeStep.CLOSE)
        self.seq += 1
        return Close(self.s, self.seq)

    def round_length(self) -> int:
        """How many tokens to draft this round (0: the cloud samples the next token)."""
        if not self.method.drafts or self._drafts_later():
            return 0
        most = self.drafting.ceiling if self._shape is None else self._shape.size
        return max(0, min(most, self.remaining - 1, self.max_draft))

    def round_shape(self) -> TreeShape | None:
        """The draft tree this round drafts (a chain included, under the tree policy),
        fitted to what is left to generate and to the cloud's ``max_tree``; ``None``
        where rounds draft chains by the length policy (no trees asked for, or a cloud
        that verifies none: negotiated down). Fixed from past verdicts alone, before
        anything of the round is drawn, so any choice keeps the law."""
        if self.tree is None or not self.method.drafts or self.max_tree < 2 or self._drafts_later():
            return None
        if isinstance(self.tree, TreeShape):
            shape = self.tree
        else:
            shape = self.tree_rates.pick(self.drafting.cost)
            if shape.size == 0:  # drafting does not pay: the chain policy's, probes and all
                return None
        return shape.pruned(max(self.remaining - 1, 0), self.max_tree)

    def _drafts_later(self) -> bool:
        """Round 0 of a session whose draft prompt is computed meanwhile."""
        return self.draft_later and not self.opens

    @property
    def tree_round(self) -> bool:
        """Whether the round in flight's block left the draft model's context where it
        was (a tree's: the drafter does not speculate past it)."""
        return self._draft is not None and not self._draft.stays_in_context

    def next_round(self) -> EdgeOutput:
        """Start the next round: a :class:`DraftNeeded` event when the round drafts,
        else (``ar``, the last token) the ``draft`` message at once.

        On a new session (phase ``new``) this opens it too: round 0's block rides on
        the ``open`` (``Open.draft``) and its verdict answers both, so the first
        draft does not wait a round trip for ``opened``. A session with nothing to
        generate (``max_new_tokens`` 0) gets the plain :meth:`open`."""
        if self.phase is EdgePhase.NEW and self.remaining <= 0:
            return EdgeOutput([self.open()])
        if self.phase is not EdgePhase.READY and self.phase is not EdgePhase.NEW:
            raise ProtocolError(f"session {self.s}: cannot start a round in phase "
                                f"{self.phase.value}", code="state")
        self._shape = shape = self.round_shape()
        if shape is not None and not shape.is_chain:
            self._advance(EdgeStep.DRAFT_NEEDED)
            need = DraftNeeded(self, shape.size, self._drop, self._append, 0.0, shape,
                               self.tree_row_codec, self.tree_distinct)
            self._drop, self._append = 0, []
            return EdgeOutput([], [need])
        d = self.round_length()
        if d == 0:
            return self._send_draft(np.zeros(0, dtype=np.int64), [], [])
        self._advance(EdgeStep.DRAFT_NEEDED)
        need = DraftNeeded(self, d, self._drop, self._append,
                           self.drafting.stop_below if shape is None else 0.0)
        self._drop, self._append = 0, []
        return EdgeOutput([], [need])

    def take(self, got: tuple[np.ndarray, list[np.ndarray], list[np.ndarray]] | DeviceTree
             ) -> EdgeOutput:
        """The drafter's answer to :class:`DraftNeeded`, whichever it drafted: a chain's
        ``(ids, TLI rows, rows sampled from)`` (:meth:`drafted`) or a tree
        (:meth:`drafted_tree`)."""
        if isinstance(got, DeviceTree):
            return self.drafted_tree(got)
        return self.drafted(*got)

    def drafted_tree(self, drafted: DeviceTree) -> EdgeOutput:
        """The drafter's answer to a :class:`DraftNeeded` with a ``shape``: the tree
        it drew (the draft model's context left as it was). Returns the message."""
        if self.phase is not EdgePhase.DRAFTING or self._shape is None:
            raise ProtocolError(f"session {self.s}: a tree arrived in phase "
                                f"{self.phase.value}", code="state")
        if drafted.draft.shape.parents != self._shape.parents:
            raise ValueError("the drafted tree is not the shape asked for")
        return self._send_block(drafted.draft, drafted.rows)

    def drafted(self, ids: np.ndarray, q_raw: list[np.ndarray],
                q_rows: list[np.ndarray]) -> EdgeOutput:
        """The drafter's answer to :class:`DraftNeeded`: target ids drafted (at most
        the length asked, fewer when the draft puts no mass on V_C), the TLI rows
        and the rows they were sampled from. Returns the ``draft`` message."""
        if self.phase is not EdgePhase.DRAFTING:
            raise ProtocolError(f"session {self.s}: drafts arrived in phase "
                                f"{self.phase.value}", code="state")
        ids = np.asarray(ids, dtype=np.int64)
        if not (ids.shape[0] == len(q_raw) == len(q_rows) <= self.round_length()):
            raise ValueError("drafted ids and rows do not match the draft asked for")
        return self._send_draft(ids, q_raw, q_rows)

    def _send_draft(self, ids: np.ndarray, q_raw: list[np.ndarray],
                    q_rows: list[np.ndarray]) -> EdgeOutput:
        draft = (self.method.draft_message(ids, q_raw, self.space) if ids.shape[0]
                 else Draft(ids=ids, q_values=np.zeros(0, dtype=np.float32)))
        # a chain's node i - 1 has one child, draft i, drawn from the row q_rows[i]
        rows = {i - 1: row for i, row in enumerate(q_rows)}
        return self._send_block(draft, rows)

    def _send_block(self, draft: Draft, rows: dict[int, np.ndarray]) -> EdgeOutput:
        """Send the round's block (on the open for round 0) and keep what its verdict
        is read with: the block, and the rows its rejections resolve with."""
        self._draft, self._rows = draft, rows
        # a chain's drafts went into the draft model's context as they were drawn
        self._drafted = draft.length if draft.stays_in_context else 0
        self._trips = 0
        msg: Message
        if not self.opens:  # round 0 of a new session: it rides on the open
            msg = self._open_msg(draft)
        else:
            self.seq += 1
            msg = DraftMsg(self.s, self.seq, self.round, self._pending_token, draft)
        self._expect(msg)
        self._request_kind = None
        self._fallback_seen = False
        self._advance(EdgeStep.DRAFT)
        return EdgeOutput([msg])

    def take_edits(self) -> tuple[int, list[int]]:
        """The draft-context edits not yet handed to the drafter, handed over now
        (``(drop, append)``, as :class:`DraftNeeded` carries them): a node applies them
        while a verdict is in flight when this round drafted nothing, so the next
        round that drafts does not pay for them first. Between rounds only."""
        edits, self._drop, self._append = (self._drop, self._append), 0, []
        return edits

    def _edit(self, drop: int, append: list[int]) -> None:
        """Queue a draft-context edit (drop the last ``drop`` ids, then add ``append``)
        onto those not yet handed to the drafter."""
        if drop <= len(self._append):
            self._append = [*self._append[: len(self._append) - drop], *append]
        else:
            self._drop += drop - len(self._append)
            self._append = list(append)

    def resend(self) -> Message:
        """The message the cloud refused as ``busy``, again and unchanged: a refused
        message does not consume its ``seq``, and if a copy of it did get through
        (a duplicate), the cloud answers the repeat from its record instead of
        serving it twice."""
        m = self._last_sent
        assert m is not None and self.phase in (EdgePhase.OPENING, EdgePhase.WAITING,
                                                EdgePhase.RESOLVING)
        return m

    # -- what arrives ------------------------------------------------------

    def receive(self, msg: Message) -> EdgeOutput:
        """Feed one cloud message for this session. A stale answer (see the module
        docstring) is dropped: counted in :attr:`stale`, nothing else changes."""
        if isinstance(msg, Error):
            exc = exception_for(msg.code, msg.message)
            if msg.code == "replay":  # the cloud already has that message: nothing lost
                self.stale += 1
                return EdgeOutput()
            if msg.code == "busy" and self.phase in (EdgePhase.WAITING, EdgePhase.OPENING,
                                                     EdgePhase.RESOLVING):
                return EdgeOutput([], [Retry(exc)])
            if msg.code == "no_context":
                if (self.prompt_base is not None and isinstance(self._last_sent, Open)
                        and self.phase in (EdgePhase.OPENING, EdgePhase.WAITING)):
                    return self._reopen_whole()
                self.stale += 1  # a copy of a refusal already acted on
                return EdgeOutput()
            raise exc
        ack = getattr(msg, "ack", None)
        if (ack is not None and ack < self._awaiting) or (
                ack == self._awaiting and self.phase not in (
                    EdgePhase.OPENING, EdgePhase.WAITING, EdgePhase.RESOLVING)):
            self.stale += 1  # answers a message this session is past, or answered twice
            return EdgeOutput()
        if ack != self._awaiting:
            raise ProtocolError(f"session {self.s}: a {msg.TYPE!r} answers seq {ack}, but "
                                f"seq {self._awaiting} is the last sent", code="state")
        if isinstance(msg, Opened) and self.phase is EdgePhase.OPENING:
            return self._opened(msg)
        if isinstance(msg, VerdictMsg) and self.phase is EdgePhase.WAITING and msg.r == self.round:
            return self._verdict(msg)
        if isinstance(msg, ReplyMsg) and self.phase is EdgePhase.RESOLVING and msg.r == self.round:
            self._trips += 1
            return self._resolve(msg.reply)
        raise ProtocolError(f"session {self.s}: unexpected {msg.TYPE!r} in phase "
                            f"{self.phase.value}",
                            code="state")

    def _opened(self, msg: Opened) -> EdgeOutput:
        out = EdgeOutput([], [SessionReady(msg.prompt_tokens)])
        if self._redo:  # complete the round whose verdict was seen
            self._redo = False
            kind, dev, draft = self._request_kind, self._dev, self._draft
            assert kind is not None and dev is not None and draft is not None
            self._advance(EdgeStep.RESUMED)
            self.seq += 1
            redone = DraftMsg(self.s, self.seq, self.round, None, draft,
                              Redo(self._accepted, kind.kind, dev.candidate_rounds,
                                   self._fallback_seen))
            self._expect(redone)
            out.send.append(redone)
            return out
        self._advance(EdgeStep.OPENED if self.remaining > 0 else EdgeStep.FINISHED)
        if self.phase is EdgePhase.DONE:
            self.finish_reason = FinishReason.LENGTH
            out.events.append(Finished(FinishReason.LENGTH))
        return out

    def _verdict(self, msg: VerdictMsg) -> EdgeOutput:
        """The round's verdict: ``n`` names the node the walk stopped at (its index
        + 1, 0 for the context; on a chain, the number of drafts accepted), whose path
        is the accepted one (``Draft.path``); a node without children ends with a
        bonus token, one with children with the method's payload for the rejection of
        every one of them. Chains and trees alike: the block answers."""
        draft = self._draft
        assert draft is not None
        n = msg.accepted
        if not 0 <= n <= draft.length:
            raise ProtocolError(f"verdict names node {n - 1} of a {draft.length}-node block",
                                code="bad_field")
        self._accepted = n
        if not draft.rejects(n):
            if not isinstance(msg.reply, TokenReply):
                raise ProtocolError("a full acceptance must carry a bonus token",
                                    code="bad_field")
            return self._settle(int(msg.reply.token))
        self._dev = rejection_state(draft, self._rows, n - 1)
        self._advance(EdgeStep.REJECTED)
        return self._resolve(msg.reply)

    def _resolve(self, reply: Reply) -> EdgeOutput:
        assert self._dev is not None
        self._check_reply(reply)
        if isinstance(reply, HybridReply):
            self._fallback_seen = True
        try:
            out = self.method.resolve(reply, self._dev, self.space, self.rng)
        except XcosdError:
            raise
        except (ValueError, IndexError) as e:
            raise ProtocolError(f"cannot use the cloud's reply: {e}", code="bad_field") from e
        if isinstance(out, Request):
            self.seq += 1
            self._request_kind = out
            req = RequestMsg(self.s, self.seq, self.round, out.kind)
            self._expect(req)
            return EdgeOutput([req])
        return self._settle(int(out))

    def _check_reply(self, reply: Reply) -> None:
        size = self.space.target_size
        ids: list[int] = []
        if isinstance(reply, TokenReply):
            ids = [reply.token]
        elif isinstance(reply, CandidatesReply):
            ids = reply.ids.tolist()
        elif isinstance(reply, HybridReply) and reply.other_token is not None:
            ids = [reply.other_token]
        if any(not 0 <= i < size for i in ids):
            raise ProtocolError("the cloud named a token outside the target vocabulary",
                                code="bad_token")

    def _settle(self, token: int) -> EdgeOutput:
        draft = self._draft
        assert draft is not None
        dev = self._dev
        nodes = draft.path(self._accepted)
        path = [int(draft.ids[v]) for v in nodes]
        n = len(path)
        if draft.stays_in_context:
            # the draft model keeps the accepted drafts and the token's draft spelling;
            # the length policy learns from the chains it sizes
            self._edit(self._drafted - n, self._draft_ids(token))
            self.drafting.settled(draft.length, n)
        else:
            # nothing of a tree is in the draft model's context: the path joins it
            self._edit(0, [d for t in [*path, token] for d in self._draft_ids(t)])
        if self.tree is not None:  # trees asked for: every round informs the estimates
            self.tree_rates.observe(walk_ranks(draft.shape, nodes))
        rejected = draft.rejects(self._accepted)
        new = [*path, token]
        settled = RoundSettled(draft.length, n, self._trips,
                               dev.trials if dev else 0, dev.fallbacks if dev else 0,
                               draft.tree_label, rejected)
        self._pending_token = token if rejected else None
        self._dev = None
        self._request_kind, self._last_sent = None, None
        self.round += 1
        emitted: list[int] = []
        pieces: list[bytes] = []
        reason: FinishReason | None = None
        for t in new:
            if self.remaining <= 0:
                reason = FinishReason.LENGTH
                break
            emitted.append(t)
            self.token_ids.append(t)
            pieces.append(self.vmap.target.piece(t))
            if t in self.stop_ids:
                reason = FinishReason.STOP
                break
        if reason is None and self.remaining <= 0:
            reason = FinishReason.LENGTH
        piece_bytes = b"".join(pieces)
        self.text_bytes += piece_bytes
        text = self._utf8.decode(piece_bytes, final=reason is not None)
        events: list[EdgeEvent] = [TokensEmitted(emitted, text), settled]
        if reason is not None:
            self._advance(EdgeStep.FINISHED)
            self.finish_reason = reason
            events.append(Finished(reason))
        else:
            self._advance(EdgeStep.SETTLED)
        return EdgeOutput([], events)

    def _draft_ids(self, token: int) -> list[int]:
        """The draft spelling of a target token (:meth:`VocabMap.draft_spelling`)."""
        return self.vmap.draft_spelling(token)

    @property
    def text(self) -> str:
        return self.text_bytes.decode("utf-8", errors="replace")
