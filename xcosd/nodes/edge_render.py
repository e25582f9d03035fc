"""The edge node's render client: text and chats as the target's token ids.

The device does not have the target's tokenizer or chat template; the cloud does.
:class:`RenderClient` asks it (a ``render`` message, answered ``rendered``) over the
node's connection, so that ``generate(ids)`` equals ``generate(text)`` and a chat is
rendered by the target's own template. A render names an earlier one of the same
connection where it shares its start, so a chat's next turn costs the link only its
new messages. Each request is numbered, sent again while its answer is late or the
connection is replaced, and bounded in how many are at the cloud at once
(``MAX_RENDERS_IN_FLIGHT``, ``xcosd/nodes/edge_connection.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import ProtocolError, TransportError
from ..protocol import pack
from ..protocol.contexts import Chat
from ..protocol.errors import exception_for
from ..protocol.messages import CHAT_ROLES, Error, Message, Render, Rendered
from ..wire.frames import message_bytes
from .edge_connection import EdgeConnection


class RenderClient(EdgeConnection):
    """An edge connection that renders text and chats on its cloud (``tokenize``,
    ``chat_prompt``); its requests share the connection's routes and bounds."""

    async def tokenize(self, text: str, *, timeout_s: float | None = None) -> list[int]:
        """``text`` as the target's token ids, tokenised by the cloud's target: the
        context an ``open`` with this text starts from, so ``generate(ids)`` equals
        ``generate(text)`` and the caller knows the prompt's length in the target's
        tokens first. ``timeout_s``: the deadline (default ``answer_timeout_s``)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return await self._render(None, text, timeout_s)

    async def chat_prompt(self, messages: Sequence[Mapping[str, str]], *,
                          timeout_s: float | None = None) -> list[int]:
        """A chat as the target's token ids, rendered on the cloud by the **target's**
        chat template with the generation prompt added: ``generate(ids)`` is then the
        target's own answer to the conversation (and ends at its end-of-turn token,
        which the cloud lists among its stop ids). ``messages``: ``{"role", "content"}``
        maps, roles ``system``, ``user``, ``assistant``. A target without a template
        raises :class:`~xcosd.errors.ProtocolError` with code ``unsupported``."""
        chat: list[tuple[str, str]] = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if role not in CHAT_ROLES or not isinstance(content, str):
                raise ValueError(f"messages[{i}]: a role of {', '.join(CHAT_ROLES)} and a "
                                 f"string content, got {role!r}")
            chat.append((str(role), content))
        if not chat:
            raise ValueError("a chat has at least one message")
        return await self._render(tuple(chat), None, timeout_s)

    async def _render(self, chat: Chat | None, text: str | None,
                      timeout_s: float | None) -> list[int]:
        """A render, by reference to an earlier one of this connection where one
        shares its start (the request's rest goes, and the answer's): a chat's next
        turn costs the link its new messages. A reference the cloud no longer holds
        (``no_context``) is asked again whole."""
        epoch = self._epoch
        ref = self._held_renders.longest(text, chat)
        base = None if ref is None else self._held_renders.get(ref[0])
        if ref is not None and base is not None:
            key, keep = ref
            rest_chat = None if chat is None else chat[keep:]
            rest_text = None if text is None else text[keep:]
            try:
                answer = await self._render_request(
                    Render(0, text=rest_text, chat=rest_chat, base=key, keep=keep), timeout_s)
                ids = np.concatenate([base.ids[:answer.keep].astype(np.int64),
                                      answer.ids.astype(np.int64)])
            except ProtocolError as e:
                if e.code != "no_context":
                    raise
                self._held_renders.drop(key)
                ref = None
        if ref is None or base is None:
            answer = await self._render_request(Render(0, text=text, chat=chat), timeout_s)
            ids = answer.ids.astype(np.int64)
        if self._epoch == epoch:  # the cloud that answered holds it now
            self._held_renders.put(text, chat, ids)
            self._held_contexts.put(ids)
        return [int(i) for i in ids.tolist()]

    async def _render_request(self, request: Render, timeout_s: float | None) -> Rendered:
        """Send ``request`` (numbered here) and wait for its answer; asked again
        every ``resend_after_s`` (after a reconnect too) until the deadline. At most
        :data:`MAX_RENDERS_IN_FLIGHT` of a node's requests are at the cloud at once
        (the rest wait here, within their deadline); a ``busy`` answer is asked again
        after a pause, for at most ``busy_timeout_s``, as a generation's is. Without
        a ``timeout_s`` of the caller's, a cloud not connected yet is waited for
        first, as a generation waits for it (``cloud_wait_s``): the default deadline
        is for the answer of a cloud that is there."""
        if self._closed:
            raise TransportError("the edge node is closed", code="closed")
        if timeout_s is None and not self._connected:
            await self._recover(self._epoch)
        n = next(self._render_ids)
        msg = dataclasses.replace(request, n=n)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s if timeout_s is not None
                                       else self.answer_timeout_s), self._render_slots:
                delay, busy_since = self.busy_retry_s, 0.0
                while True:
                    fut: asyncio.Future[Message] = loop.create_future()
                    self._renders[n] = fut
                    answer = await self._render_once(msg, fut)
                    if not (isinstance(answer, Error) and answer.code == "busy"):
                        break
                    busy_since = busy_since or time.monotonic()
                    delay = await self._busy_pause(None, delay, busy_since)
        finally:
            self._renders.pop(n, None)
        if isinstance(answer, Error):
            raise exception_for(answer.code, answer.message)
        assert isinstance(answer, Rendered)
        return answer

    async def _render_once(self, msg: Render, fut: asyncio.Future[Message]) -> Message:
        """Send ``msg`` until ``fut`` (its answer) is set: again every
        ``resend_after_s``, and after a reconnect (the caller holds the deadline)."""
        while True:
            if not self._connected:
                await self._recover(self._epoch)
            conn, epoch = self._conn, self._epoch
            frames = pack(msg)
            welcome = self._handshake.welcome
            if welcome is not None and message_bytes(frames) > welcome.limits.max_message:
                raise ProtocolError("the prompt exceeds the cloud's message limit of "
                                    f"{welcome.limits.max_message} bytes", code="too_large")
            if conn is not None:
                try:
                    await conn.send(frames)
                    self._last_tx = time.monotonic()
                except TransportError as e:
                    self._lose(epoch, str(e))
                    continue
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(fut), self.resend_after_s)
