"""A cloud node's settings: its peers, its limits, its batching.

A :class:`~xcosd.nodes.CloudNode` is its target, its endpoint and three frozen
values with today's defaults, each setting documented once:
:class:`CloudPeerSettings` (how edges reach it and how long it keeps a silent one),
:class:`CloudLimits` (what it accepts: sessions, queues, blocks, trees, message
sizes, context, methods; the part edges learn is the welcome's
:class:`~xcosd.protocol.ServerLimits`) and :class:`BatchPolicy` (how it schedules
and batches the target's calls). It takes them whole or as keywords of the same
names (``xcosd/nodes/node_kwargs.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..policies.tree_policy import DEFAULT_MAX_TREE
from ..transport import LinkSpec


@dataclass(frozen=True)
class CloudPeerSettings:
    """How edges reach a cloud node, and how long it keeps them.

    * ``transport``: ``zmq`` (default), ``tcp``, ``memory`` or ``replica`` (behind a
      broker); ``transport_options``: that transport's own options. ``link``:
      emulate a link on every peer. ``curve``: a :class:`~xcosd.transport.CurveServer`
      (on the ``replica`` transport a :class:`~xcosd.transport.CurveClient`: a
      replica is the client of its broker's back end).
    * ``heartbeat_s``: how often edges are asked to ping (sent in the welcome).
      ``silence_timeout_s``: a peer silent that long loses its sessions (sent in the
      welcome too). ``session_idle_s``: a session without a draft or follow-up that
      long is closed even if its peer pings, when sessions are short; else after
      ``IDLE_SLACK`` times as long (``None``: ``silence_timeout_s``).
    * ``drain_timeout_s``: how long :meth:`~xcosd.nodes.CloudNode.drain` lets
      running generations finish before it hands the rest off
      (``xcosd/nodes/drain.py``).
    * ``metrics_port``: serve Prometheus text there (``None``: no endpoint), on
      ``metrics_host``.
    """

    transport: str = "zmq"
    transport_options: Mapping[str, Any] | None = None
    link: LinkSpec | None = None
    curve: Any = None
    heartbeat_s: float = 1.0
    silence_timeout_s: float = 15.0
    session_idle_s: float | None = None
    drain_timeout_s: float = 30.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")

    @property
    def idle_s(self) -> float:
        """``session_idle_s``, its default resolved."""
        return self.silence_timeout_s if self.session_idle_s is None else self.session_idle_s

    def replace(self, **changes: Any) -> CloudPeerSettings:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class CloudLimits:
    """What a cloud node accepts.

    * ``max_sessions``: sessions open at once; ``max_sessions_per_peer``: of those,
      one peer's (``None``: half of ``max_sessions``, so no peer takes every one).
    * ``max_queue``: scoring requests waiting for the worker. ``max_peer_queue``:
      messages of one peer waiting to be served, and replies waiting to be sent to it.
    * ``max_draft``: the longest block verified; ``max_tree``: the most nodes of a
      draft tree (0: chains only, and edges asking for trees draft chains).
      ``max_message_bytes``: the largest message taken.
    * ``context``: the most positions one session holds, its prompt and all it
      generates (``None``: what the target holds, its ``context_tokens``; 0 when it
      knows no bound); an open past it is refused ``context_length`` before any
      compute.
    * ``methods``: the methods served (``None``: all); ``method_options``:
      per-method defaults (``{"xcosd-e": {"K": 8}}``) that an edge's own options
      override.
    """

    max_sessions: int = 1024
    max_sessions_per_peer: int | None = None
    max_queue: int = 4096
    max_peer_queue: int = 1024
    max_draft: int = 32
    max_tree: int = DEFAULT_MAX_TREE
    max_message_bytes: int = 16 << 20
    context: int | None = None
    methods: tuple[str, ...] | None = None
    method_options: Mapping[str, Mapping[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.max_peer_queue < 1:
            raise ValueError(f"max_peer_queue must be >= 1, got {self.max_peer_queue}")
        if self.context is not None and self.context < 1:
            raise ValueError(f"context must be >= 1 position, got {self.context}")

    def replace(self, **changes: Any) -> CloudLimits:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class BatchPolicy:
    """How a cloud node schedules and batches the target's calls.

    * ``max_batch``: sessions one call scores; ``max_wait_s``: how long a partial
      batch waits for more; ``max_batch_tokens``: rows one batch scores (what bounds
      the batch a small round waits behind).
    * ``merge_batches``: a partial batch waits for the sessions just answered when
      that beats a second call (``xcosd/nodes/merging.py``).
    * ``stream_verdicts``: the loop verifies a scored batch session by session and
      sends each verdict at once while the worker thread runs the next call;
      ``False``: the thread verifies the whole batch after its call, the loop sends
      afterwards.
    * ``keep_queue_waits``: keep every request's queue wait in ``batch_stats`` (a
      benchmark's cloud; memory that grows with every round served).
    * ``verify_on_device``: verify each batch next to the target's logits, in torch
      on its device (``xcosd/accel/``); ``None`` decides by the target (a model on
      an accelerator does, the CPU keeps the numpy path:
      :func:`~xcosd.nodes.scoring.verifies_on_device`).
    """

    max_batch: int = 32
    max_wait_s: float = 0.002
    max_batch_tokens: int | None = 256
    merge_batches: bool = True
    stream_verdicts: bool = True
    keep_queue_waits: bool = False
    verify_on_device: bool | None = None

    def replace(self, **changes: Any) -> BatchPolicy:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)
