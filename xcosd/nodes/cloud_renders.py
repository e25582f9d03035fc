"""A :class:`~xcosd.nodes.CloudNode`'s renders: prompts made into target ids (a
text tokenised, a chat through the target's template) in a thread of their own.

A render touches no session, so its peer's other messages (its sessions' drafts)
go on meanwhile, and renders never hold up a batch or a follow-up in the worker
thread. The thread takes the waiting peers' renders round robin, one each in turn,
so a peer with many (or long) renders waiting delays another's by at most one of
its own; at most :data:`MAX_RENDERS_PER_PEER` of a peer's wait (``busy`` past it).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import XcosdError
from ..models.base import LanguageModel
from ..protocol.cloud import Output, RenderNeeded
from .cloud_peer import Peer

#: the node's logger: everything a CloudNode logs goes under one name
log = logging.getLogger("xcosd.nodes.cloud")

#: render requests of one peer in the render thread or waiting for it; past it: busy
MAX_RENDERS_PER_PEER = 64


class Renders:
    """The render thread (made on first use), the renders waiting for it by peer
    (served round robin), and the task serving them while any wait (``pump``).

    Counters it updates: ``renders``, ``internal_errors``. ``answer(p, out)``: send
    what a render produced for ``p``, looked up in ``peers`` when it is done."""

    def __init__(self, target: LanguageModel, counters: dict[str, Any], peers: dict[bytes, Peer], *,
                 answer: Callable[[Peer, Output[Any]], None]) -> None:
        self.target = target
        self.counters = counters
        self.peers = peers
        self._answer = answer
        self._threads: ThreadPoolExecutor | None = None
        self._waiting: dict[bytes, deque[RenderNeeded]] = {}
        self.pump: asyncio.Task[None] | None = None

    def start(self, p: Peer, ev: RenderNeeded) -> None:
        """Queue ``ev`` for the render thread (``busy`` past
        :data:`MAX_RENDERS_PER_PEER` of ``p``'s waiting)."""
        if p.renders >= MAX_RENDERS_PER_PEER:
            self._answer(p, p.conn.rendered(ev, error=XcosdError(
                f"{p.renders} renders of this connection are waiting; retry later",
                code="busy")))
            return
        p.renders += 1
        self._waiting.setdefault(p.id, deque()).append(ev)
        if self.pump is None:
            self.pump = asyncio.get_running_loop().create_task(
                self._loop(), name="xcosd-cloud-render")

    def forget(self, peer: bytes) -> None:
        """``peer`` is dropped: its renders still waiting are never made."""
        self._waiting.pop(peer, None)

    def close(self) -> None:
        """Let the thread go: an idle one ends at once, one inside a tokenizer when
        it returns."""
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    async def _loop(self) -> None:
        """Serve the waiting renders, a peer at a time round robin, until none wait."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(1, thread_name_prefix="xcosd-render")
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                peer, queue = next(iter(self._waiting.items()))
                ev = queue.popleft()
                del self._waiting[peer]
                if queue:  # its next render goes behind every other peer's
                    self._waiting[peer] = queue
                try:
                    ids = await loop.run_in_executor(self._threads, self._ids, ev)
                    out = ev.conn.rendered(ev, ids)
                except XcosdError as e:
                    out = ev.conn.rendered(ev, error=e)
                except Exception as e:
                    self.counters["internal_errors"] += 1
                    log.exception("rendering a prompt for %s failed", bytes(peer).hex())
                    out = ev.conn.rendered(ev, error=XcosdError(
                        f"rendering failed: {type(e).__name__}", code="internal"))
                self.counters["renders"] += 1
                p = self.peers.get(peer)
                if p is not None and p.conn is ev.conn:
                    p.renders -= 1
                    if not p.dropped:
                        self._answer(p, out)
        finally:
            self.pump = None

    def _ids(self, ev: RenderNeeded) -> list[int]:
        """The target's ids for ``ev`` (render thread)."""
        if ev.chat is None:
            assert ev.text is not None
            return [int(i) for i in self.target.tokenize(ev.text)]
        chat_prompt = getattr(self.target, "chat_prompt", None)
        if chat_prompt is None:
            raise XcosdError(f"the target {self.target.name!r} has no chat template",
                             code="unsupported")
        try:
            ids = chat_prompt([{"role": r, "content": c} for r, c in ev.chat])
        except XcosdError:
            raise
        except Exception as e:  # the template raised (a role order it refuses ...)
            raise XcosdError(f"the target's chat template refused the chat: {e}",
                             code="unsupported") from e
        return [int(i) for i in ids]


__all__ = ["MAX_RENDERS_PER_PEER", "Renders"]
