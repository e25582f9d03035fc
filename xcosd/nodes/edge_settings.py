"""An edge node's own settings: how it holds its cloud, and how it runs generations.

What one *generation* does is :class:`~xcosd.config.GenerationConfig` (method,
sampling, length ...). What the *node* does whatever it generates is here, in two
frozen values with today's defaults, each setting documented once:
:class:`EdgeConnectionSettings` (reaching the cloud, noticing its loss, asking
again) and :class:`EdgeRunSettings` (where the draft runs, how long a first open
waits for its neighbours, the link modeled time assumes). An
:class:`~xcosd.nodes.EdgeNode` takes them whole or as keywords of the same names
(``xcosd/nodes/node_kwargs.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..transport import LinkSpec
from .arrivals import HOLD_S


@dataclass(frozen=True)
class EdgeConnectionSettings:
    """How an edge node reaches its cloud and keeps it.

    * ``transport``: ``zmq`` (default), ``tcp`` or ``memory``; ``transport_options``:
      that transport's own options. ``link``: emulate a link (a
      :class:`~xcosd.transport.LinkSpec`). ``curve``: a
      :class:`~xcosd.transport.CurveClient`.
    * ``heartbeat_s``: how often the node pings a quiet link (``None``: what the
      cloud's welcome asks for). ``silence_timeout_s``: how long the cloud may be
      silent (no message, no pong) before the connection counts as lost and the node
      connects again; not a generation's deadline, which is
      ``GenerationConfig.timeout_s``.
    * ``connect_timeout_s``: how long the node looks for its cloud, at start and
      after a loss, before it gives up (``None``: for as long as it takes).
      ``cloud_wait_s``: the longest a generation or render request waits for a cloud
      that is not connected, new or in flight, before it fails with a
      ``TransportError`` (code ``unreachable``; ``None``: until the node gives up).
    * ``resend_after_s``: an answer that does not come within it is asked for again
      (same sequence number). ``answer_timeout_s``: no answer within it despite the
      resends ends the generation with :class:`TimeoutError` (``None``: four times
      ``silence_timeout_s``).
    * ``busy_retry_s``: the first pause before a ``busy`` refusal is tried again;
      ``busy_timeout_s``: how long refusals are retried before the request fails.
    * ``name``: the node's name in its ``hello``. ``max_message_bytes``: the largest
      message taken from the cloud.
    """

    transport: str = "zmq"
    transport_options: Mapping[str, Any] | None = None
    link: LinkSpec | None = None
    curve: Any = None
    heartbeat_s: float | None = None
    silence_timeout_s: float = 15.0
    connect_timeout_s: float | None = 30.0
    cloud_wait_s: float | None = None
    resend_after_s: float = 2.0
    answer_timeout_s: float | None = None
    busy_retry_s: float = 0.05
    busy_timeout_s: float = 30.0
    name: str = "xcosd-edge"
    max_message_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.cloud_wait_s is not None and self.cloud_wait_s < 0:
            raise ValueError(f"cloud_wait_s must be >= 0 or None, got {self.cloud_wait_s}")

    @property
    def answer_deadline_s(self) -> float:
        """``answer_timeout_s``, its default resolved."""
        return (self.answer_timeout_s if self.answer_timeout_s is not None
                else 4 * self.silence_timeout_s)

    def replace(self, **changes: Any) -> EdgeConnectionSettings:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class EdgeRunSettings:
    """How an edge node runs its generations, whatever their settings.

    * ``draft_thread``: draft in a worker thread so the event loop stays free
      (``None``, the default: yes, except for a context model over at most
      ``LOOP_DRAFT_MAX_IDS`` ids, whose steps are cheaper than the hand-off:
      :func:`~xcosd.nodes.edge.drafts_on_loop`).
    * ``open_hold_s``: how long a generation's first open may wait for the requests
      a server marked as arrived with it (:class:`~xcosd.nodes.arrivals.Arrivals`),
      so that requests sent together share the cloud's first call (0: never wait).
    * ``model_link``: the link used for modeled time (``None``: the connection's
      ``link``).
    """

    draft_thread: bool | None = None
    open_hold_s: float = HOLD_S
    model_link: LinkSpec | None = None

    def replace(self, **changes: Any) -> EdgeRunSettings:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)
