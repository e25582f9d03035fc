"""An edge and a cloud wired together in one thread, with no sockets: the pump.

In the spirit of h11's ``ConnectionPair``: the real state machines
(:class:`~xcosd.protocol.EdgeHandshake`, :class:`~xcosd.protocol.EdgeSession`,
:class:`~xcosd.protocol.CloudConnection`) talk to each other, every message takes
its wire form (``pack`` on the sender, ``unpack`` on the receiver, codecs
included), the cloud's rows are scored by the scheduler's own
:func:`~xcosd.nodes.scoring.score_batch` and the drafts come from the node's own
:class:`~xcosd.nodes.drafter.Drafter`. What is left out is only the waiting, so a
generation costs its compute alone: the high-N law tests, the methods benchmark and
anything that wants a reproducible run use it.

Each message is metered as it would cross a ZeroMQ link (frames plus ZMTP's
framing, the count :class:`~xcosd.nodes.EdgeNode` makes) into a
:class:`~xcosd.nodes.stats.GenerationStats`, with the compute of each side timed;
the link's delay can be modeled afterwards from :attr:`Generation.trace`
(:func:`~xcosd.transport.sequence_latency`), so one run answers for every link.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..methods import Space, get_method
from ..models.base import LanguageModel
from ..policies.tree_policy import DEFAULT_MAX_TREE
from ..protocol import (
    CloudConfig,
    CloudConnection,
    DraftNeeded,
    EdgeHandshake,
    EdgeSession,
    Message,
    RoundSettled,
    ScoreNeeded,
    ServerLimits,
    SessionClosed,
    TokensEmitted,
    pack,
    unpack,
)
from ..protocol.session_settings import SESSION_SETTING_NAMES, SessionSettings
from ..sampling import SamplingParams
from ..transport import LinkSpec, sequence_latency
from ..transport.zeromq import zmtp_overhead
from ..vocab import VocabMap
from ..wire.frames import FrameList, message_bytes
from .drafter import Drafter
from .scoring import score_batch, score_on_device
from .stats import GenerationStats


def free_model_state(target: LanguageModel, session: Any) -> None:
    """A closed session's model state freed, as a cloud node's scheduler frees it
    (``LanguageModel.end``: a model that keeps prefixes retires it for reuse)."""
    handle, session.model.handle = session.model.handle, None
    if handle is not None:
        target.end(handle)


def wire_bytes(frames: FrameList) -> int:
    """A message's bytes on a ZeroMQ link: frames plus ZMTP's framing."""
    return message_bytes(frames) + zmtp_overhead(frames, False)


@dataclass
class Generation:
    """One finished generation through the pump."""

    session: EdgeSession
    stats: GenerationStats
    #: every message in order: (direction, wire bytes), for the link model
    trace: list[tuple[str, int]] = field(default_factory=list)
    #: the token each rejection was resolved to, in order
    resolved: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return list(self.session.token_ids)

    @property
    def text(self) -> str:
        return self.session.text

    @property
    def finish_reason(self) -> str | None:
        return self.session.finish_reason

    def modeled_s(self, link: LinkSpec) -> float:
        """Measured compute plus the link model over this generation's messages."""
        st = self.stats
        return st.draft_compute_s + st.cloud_compute_s + sequence_latency(
            self.trace, link)  # type: ignore[arg-type]


class Pump:
    """One edge and one cloud connection in process (see the module docstring).

    ``events`` collects every cloud event (tests read and clear it); ``sent`` the
    type of every message the edge sent.
    """

    def __init__(self, target: LanguageModel, draft: LanguageModel, *,
                 vmap: VocabMap | None = None, max_sessions: int = 64, max_draft: int = 32,
                 max_message: int = 16 << 20, on_device: bool = False,
                 max_tree: int = DEFAULT_MAX_TREE) -> None:
        self.target, self.draft = target, draft
        #: verify next to the target's rows, in torch (:func:`score_on_device`): the
        #: target offers ``score_tensors``
        self.on_device = on_device
        self.limits = ServerLimits(max_message, max_sessions, max_draft, 5.0, 30.0, max_tree)
        self.config = CloudConfig(target.vocab, target.tokenize, self.limits, "local")
        self.cloud = CloudConnection(self.config, b"local")
        self.vmap = vmap or VocabMap(draft.vocab, target.vocab)
        self.handshake = EdgeHandshake(lambda tv: self.vmap, target.vocab)
        self.space = Space.from_vocab_map(self.vmap)
        self.events: list[object] = []
        self.sent: list[str] = []
        self.drafters: dict[int, Drafter] = {}
        self._stats = GenerationStats()
        self._trace: list[tuple[str, int]] = []
        self._resolved: list[int] = []
        self._next = 0
        pending = self.to_cloud(self.handshake.hello())
        while pending:
            for m in self.handshake.receive(pending.pop(0)).send:
                pending += self.to_cloud(m)
        if not self.handshake.ready:
            raise RuntimeError("the in-process handshake did not complete")

    @staticmethod
    def wire(msg: Message) -> Message:
        """``msg`` as the receiver decodes it from its frames."""
        return unpack(pack(msg))

    # -- the cloud side ----------------------------------------------------------

    def to_cloud(self, msg: Message) -> list[Message]:
        """Send ``msg`` up; the cloud answers (scoring what it asks to be scored) and
        its replies come back as the edge decodes them."""
        st, trace = self._stats, self._trace
        t0 = time.perf_counter()
        frames = pack(msg)
        n = wire_bytes(frames)
        t1 = time.perf_counter()
        st.draft_compute_s += t1 - t0
        st.count("up", msg.TYPE, n)
        trace.append(("up", n))
        self.sent.append(msg.TYPE)
        out = self.cloud.receive(unpack(frames))
        self.events += out.events
        send = list(out.send)
        for ev in out.events:
            if isinstance(ev, SessionClosed):
                free_model_state(self.target, ev.session)
            elif isinstance(ev, ScoreNeeded):
                st.target_calls += 1
                [outcome] = (score_on_device(self.target, [ev]) if self.on_device
                             else score_batch(self.target, [ev]))
                scored = self.cloud.scored(ev.session, outcome)
                self.events += scored.events
                send += scored.send
        replies = [pack(m) for m in send]
        t2 = time.perf_counter()
        st.cloud_compute_s += t2 - t1
        decoded = []
        for m, f in zip(send, replies, strict=True):
            n = wire_bytes(f)
            st.count("down", m.TYPE, n)
            trace.append(("down", n))
            decoded.append(unpack(f))
        st.draft_compute_s += time.perf_counter() - t2
        return decoded

    # -- the edge side -----------------------------------------------------------

    def session(self, method: str = "xcosd-e", *, codec: str = "f32", prompt: str = "ab",
                prompt_ids: Sequence[int] | None = None,
                prompt_base: tuple[str, int] | None = None, **kw: Any) -> EdgeSession:
        """A new generation's state machine (not opened yet) and its drafter.

        ``kw``: :class:`~xcosd.protocol.SessionSettings`' fields by name (``params``,
        ``max_new_tokens``, ``seed``, ``draft_len``, ``tree`` ...), under the
        welcome's limits, then the method's own options (``K``, ``hr_presample``
        ...). The pump's defaults differ from a session's in two: 8 tokens and seed
        0, so a test's generation is short and reproducible unless it says
        otherwise; the pump measures no times, so ``draft_cost="auto"`` keeps the
        default cost. ``prompt_ids``: the prompt as target ids (``prompt`` is then
        what the draft conditions on); ``prompt_base``: their first ids by reference
        (``EdgeSession``'s, :mod:`xcosd.protocol.contexts`)."""
        welcome = self.handshake.welcome
        assert welcome is not None
        given = {k: kw.pop(k) for k in list(kw) if k in SESSION_SETTING_NAMES}
        if given.get("params", SamplingParams()) is None:  # as before: the default warpers
            del given["params"]
        settings = SessionSettings.under(welcome, get_method(method, codec=codec, **kw),
                                         **{"max_new_tokens": 8, "seed": 0, **given})
        self._next += 1
        # the cloud's context is the ids when given; the draft's, ``prompt``
        es = EdgeSession(self._next, settings, vmap=self.vmap, space=self.space,
                         prompt="" if prompt_ids is not None else prompt,
                         prompt_ids=(None if prompt_ids is None
                                     else np.asarray(prompt_ids, dtype=np.int64)),
                         prompt_base=prompt_base)
        self.drafters[es.s] = Drafter(self.draft, self.vmap, settings.params, prompt)
        return es

    def next_draft(self, es: EdgeSession) -> Message:
        """Start ``es``'s next round, drafting if it asks to; its ``draft`` message."""
        t0 = time.perf_counter()
        out = es.next_round()
        for ev in out.events:
            if isinstance(ev, DraftNeeded):
                out = es.take(self.drafters[es.s].run(ev))
        self._stats.draft_compute_s += time.perf_counter() - t0
        [msg] = out.send
        return msg

    def receive(self, es: EdgeSession, msg: Message) -> list[Message]:
        """Feed a cloud message to ``es``; what it sends back."""
        t0 = time.perf_counter()
        out = es.receive(msg)
        self._stats.draft_compute_s += time.perf_counter() - t0
        emitted: list[int] = []
        for ev in out.events:
            if isinstance(ev, TokensEmitted):
                emitted = ev.token_ids
            elif isinstance(ev, RoundSettled):
                self._stats.settle(ev)
                if ev.rejected and len(emitted) > ev.accepted:
                    self._resolved.append(emitted[ev.accepted])
        return list(out.send)

    def drive(self, es: EdgeSession) -> Generation:
        """Run ``es`` from its open (round 0's draft rides on it) to its end; close it."""
        st = self._stats = GenerationStats(method=es.method.name, codec=es.method.codec.name)
        trace = self._trace = []
        resolved = self._resolved = []
        while not es.done:  # the first round opens the session (EdgeSession.next_round)
            up, down, rejections = st.uplink_bytes, st.downlink_bytes, st.rejections
            pending = self.to_cloud(self.next_draft(es))
            while pending:
                for m in self.receive(es, pending.pop(0)):
                    pending += self.to_cloud(m)
            if st.rejections > rejections:
                st.rejection_uplink_bytes += st.uplink_bytes - up
                st.rejection_downlink_bytes += st.downlink_bytes - down
        waited = len(trace)
        self.to_cloud(es.close())
        # the close is counted in the bytes but not in the modeled time: the output
        # is complete before it leaves, as EdgeNode.generate's trace has it
        del trace[waited:]
        self.drafters.pop(es.s).end()
        st.tokens = len(es.token_ids)
        st.finish_reason = es.finish_reason or ""
        return Generation(es, st, trace, resolved)

    def generate(self, method: str = "xcosd-e", **kw: Any) -> Generation:
        """One whole generation (:meth:`session`'s arguments)."""
        return self.drive(self.session(method, **kw))
