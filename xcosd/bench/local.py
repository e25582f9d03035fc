"""The edge and cloud state machines wired together in one thread, no sockets.

Every message still takes its wire form (``pack`` on the sender, ``unpack`` on
the receiver) and is counted in wire bytes as the ZeroMQ transport carries it
(frames plus ZMTP framing, the same count :class:`~xcosd.nodes.EdgeNode` makes), and
the cloud scores each round through the scheduler's own
:func:`~xcosd.nodes.scheduler.score_batch`. What is left out is only the waiting:
the link's delay is *modeled* afterwards from the recorded message sequence
(:func:`~xcosd.transport.sequence_latency`), and compute is measured per side
with ``perf_counter``. That makes a run reproducible on a noisy machine and lets
one run answer for every link rate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..methods import Space, get_method
from ..models.base import LanguageModel
from ..nodes.scheduler import score_batch
from ..protocol import (
    CloudConfig,
    CloudConnection,
    Drafter,
    EdgeHandshake,
    EdgeSession,
    Message,
    RoundSettled,
    ScoreNeeded,
    ServerLimits,
    pack,
    unpack,
)
from ..sampling import SamplingParams
from ..transport import LinkSpec, sequence_latency
from ..transport.zeromq import zmtp_overhead
from ..vocab import VocabMap
from ..wire.frames import message_bytes

Frames = list[Any]


@dataclass
class LocalStats:
    """One generation (or a sum of them) as the local link saw it."""

    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    target_calls: int = 0
    extra_round_trips: int = 0
    trials: int = 0
    fallbacks: int = 0
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    #: downlink bytes of the rounds that had a rejection (verdict + follow-ups)
    rejection_downlink_bytes: int = 0
    rejection_uplink_bytes: int = 0
    messages: int = 0
    edge_s: float = 0.0
    cloud_s: float = 0.0
    #: every message in order: (direction, wire bytes)
    trace: list[tuple[str, int]] = field(default_factory=list)

    def add(self, other: LocalStats) -> None:
        for k in ("tokens", "rounds", "drafted", "accepted", "rejections", "target_calls",
                  "extra_round_trips", "trials", "fallbacks", "uplink_bytes", "downlink_bytes",
                  "rejection_downlink_bytes", "rejection_uplink_bytes", "messages"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.edge_s += other.edge_s
        self.cloud_s += other.cloud_s

    def modeled_s(self, link: LinkSpec) -> float:
        """Measured compute plus the link model over this generation's messages."""
        return self.edge_s + self.cloud_s + sequence_latency(self.trace, link)  # type: ignore[arg-type]


def wire_bytes(frames: Frames) -> int:
    """A message's bytes on a ZeroMQ link: frames plus ZMTP's framing."""
    return message_bytes(frames) + zmtp_overhead(frames, False)


class LocalLink:
    """One edge and one cloud connection, in process (see the module docstring)."""

    def __init__(self, draft: LanguageModel, target: LanguageModel, *,
                 vmap: VocabMap | None = None, max_draft: int = 32) -> None:
        self.draft, self.target = draft, target
        limits = ServerLimits(256 << 20, 64, max_draft, 5.0, 30.0)
        self.config = CloudConfig(target.vocab, target.tokenize, limits, "local")
        self.cloud = CloudConnection(self.config, b"local")
        self.vmap = vmap or VocabMap(draft.vocab, target.vocab)
        self.handshake = EdgeHandshake(lambda tv: self.vmap, target.vocab)
        self._stats = LocalStats()
        pending = self._to_cloud(self.handshake.hello())
        while pending:
            for m in self.handshake.receive(pending.pop(0)).send:
                pending += self._to_cloud(m)
        if not self.handshake.ready:
            raise RuntimeError("the local handshake did not complete")
        self.space = Space.from_vocab_map(self.vmap)
        self._next = 0

    def _to_cloud(self, msg: Message) -> list[Message]:
        """Send ``msg`` up; return the cloud's answers as the edge decodes them."""
        st = self._stats
        t0 = time.perf_counter()
        frames = pack(msg)
        n = wire_bytes(frames)
        t1 = time.perf_counter()
        st.edge_s += t1 - t0
        st.uplink_bytes += n
        st.messages += 1
        st.trace.append(("up", n))
        out = self.cloud.receive(unpack(frames))
        send = list(out.send)
        for ev in out.events:
            if isinstance(ev, ScoreNeeded):
                st.target_calls += 1
                [outcome] = score_batch(self.target, [ev])
                send += self.cloud.scored(ev.session, outcome).send
        replies = [pack(m) for m in send]
        t2 = time.perf_counter()
        st.cloud_s += t2 - t1
        decoded = []
        for f in replies:
            n = wire_bytes(f)
            st.downlink_bytes += n
            st.messages += 1
            st.trace.append(("down", n))
            decoded.append(unpack(f))
        st.edge_s += time.perf_counter() - t2
        return decoded

    def generate(self, prompt: str, max_new_tokens: int, *, method: str, codec: str = "f32",
                 params: SamplingParams | None = None, draft_len: int = 4, seed: int = 0,
                 **options: Any) -> tuple[LocalStats, list[int]]:
        """One whole generation; returns its stats and the target ids it produced."""
        params = params or SamplingParams()
        welcome = self.handshake.welcome
        assert welcome is not None
        st = self._stats = LocalStats()
        t0 = time.perf_counter()
        m = get_method(method, codec=codec, **options)
        self._next += 1
        es = EdgeSession(self._next, method=m, vmap=self.vmap, space=self.space,
                         drafter=Drafter(self.draft, self.vmap, params, prompt), prompt=prompt,
                         max_new_tokens=max_new_tokens, params=params,
                         stop_ids=welcome.stop_ids, draft_len=draft_len,
                         max_draft=welcome.limits.max_draft, seed=seed)
        st.edge_s += time.perf_counter() - t0
        for reply in self._to_cloud(es.open()):
            self._edge(es, reply)
        while not es.done:
            t0 = time.perf_counter()
            msg = es.next_draft()
            st.edge_s += time.perf_counter() - t0
            up0, down0 = st.uplink_bytes, st.downlink_bytes
            self._rejected = False
            pending = self._to_cloud(msg)
            while pending:
                for m2 in self._edge(es, pending.pop(0)):
                    pending += self._to_cloud(m2)
            if self._rejected:
                st.rejection_uplink_bytes += st.uplink_bytes - up0
                st.rejection_downlink_bytes += st.downlink_bytes - down0
        self._to_cloud(es.close())
        t0 = time.perf_counter()
        es.drafter.end()
        st.edge_s += time.perf_counter() - t0
        st.tokens = len(es.token_ids)
        return st, list(es.token_ids)

    _rejected = False

    def _edge(self, es: EdgeSession, msg: Message) -> list[Message]:
        st = self._stats
        t0 = time.perf_counter()
        out = es.receive(msg)
        st.edge_s += time.perf_counter() - t0
        for ev in out.events:
            if isinstance(ev, RoundSettled):
                st.rounds += 1
                st.drafted += ev.drafted
                st.accepted += ev.accepted
                st.extra_round_trips += ev.extra_trips
                st.trials += ev.trials
                st.fallbacks += ev.fallbacks
                self._rejected = ev.accepted < ev.drafted
                st.rejections += int(self._rejected)
        return list(out.send)
