"""uvicorn's HTTP/1.1 protocol (h11) with :class:`~xcosd.http.limits.ConnectionLimits`
enforced on every connection.

uvicorn bounds the number of connections only as a whole (and answers 503 once a
request's head has arrived, so a stalled connection still holds its place), has no
deadline on a request's head or body, and lets a response wait forever for a client
that stopped reading it. One client could therefore hold every place with
connections that never finish a head, and one that stops reading a stream would
keep its generation's slot for good. :class:`BoundedH11` adds:

* **A cap per client address and in all**, checked as a connection is made: one
  over it gets an error object at once (429 ``too_many_connections`` for its
  address, 503 ``server_full`` for the whole) and is closed, so it holds no place
  and other addresses are still served. The refusal is written before anything is
  read, and the connection is kept for at most :data:`REFUSE_LINGER_S` to take the
  client's request off the socket (closing with it unread would reset the
  connection and lose the answer); at most ``max_connections`` refused ones linger.
* **A deadline on the whole head**, from the connection's opening or the previous
  response's end, and **on the whole body**, from its head; past either: a 408
  error object if no response has started, and the connection closed. A deadline is
  for the whole thing, not per read: a client that trickles a byte at a time is
  dropped all the same.
* **A bound on a slow reader**: a response buffers at most ``write_buffer_bytes``
  for its client (then it waits for the client, as uvicorn's flow control does);
  once it has waited ``write_timeout_s`` with that buffer full the connection is
  dropped, which ends the response (and cancels a streamed generation: see
  ``xcosd/api/app.py``).
* **An answer sent before its request was read whole** (a 413 for a body over the
  limit, a refusal) reaches its client: closing a socket with input unread makes
  the kernel reset the connection, and a reset discards the answer the client has
  not read yet. So a connection closed while its request's body is still coming
  is half-closed instead (the answer, then end of stream) and its input read and
  dropped until the client closes too, for at most :data:`LINGER_S`.
* **A head that is not HTTP** gets a 400 error object in the same shape.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_object, raw_error_response
from .limits import AddressSlots, ConnectionLimits

#: seconds a refused connection is kept to read what its client sent
REFUSE_LINGER_S = 1.0
#: seconds a connection closed with its request's body still coming is kept,
#: half-closed, to read (and drop) it
LINGER_S = 2.0

_REFUSAL = {429: ("too many connections from this address; retry later",
                  "too_many_connections"),
            503: ("the server is at its connection limit; retry later", "server_full")}


class _LingeringClose:
    """The transport uvicorn's code is given: the same, but its ``close`` lingers
    while the request's body is still coming (:meth:`BoundedH11._close`)."""

    def __init__(self, transport: asyncio.Transport, protocol: BoundedH11) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> object:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol._close()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._transport.is_closing()


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol under ``limits``, its connections counted in
    ``slots`` (both set per server on a subclass: :class:`~xcosd.http.HttpServer`)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    slots: ClassVar[AddressSlots]

    _slot: str | None = None
    _refused = False
    #: the phase the deadline is armed for: ("head", the cycle before it) or
    #: ("body", its cycle); None: no deadline (a request whole, its answer running)
    _phase: tuple[str, object] | None = None
    _deadline: asyncio.TimerHandle | None = None
    _write_deadline: asyncio.TimerHandle | None = None
    _raw: asyncio.Transport
    _lingering = False

    # -- admission ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        self.transport = _LingeringClose(transport, self)  # type: ignore[assignment]
        host = self.client[0] if self.client else None
        status = self.slots.refusal(host)
        if status is not None:
            self._refuse(status)
            return
        self._slot = self.slots.take(host)
        transport.set_write_buffer_limits(high=self.limits.write_buffer_bytes)
        self._sync_deadline()

    def _refuse(self, status: int) -> None:
        self._refused = True
        self.slots.refused += 1
        message, code = _REFUSAL[status]
        self.transport.write(raw_error_response(status, message, code, {"retry-after": "1"}))
        if self.slots.lingering >= self.limits.max_connections:
            self.transport.close()
            return
        self.slots.lingering += 1
        self._deadline = self.loop.call_later(REFUSE_LINGER_S, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        for h in (self._deadline, self._write_deadline):
            if h is not None:
                h.cancel()
        if self._refused and self._deadline is not None:
            self.slots.lingering -= 1
        if self._slot is not None:
            self.slots.give(self._slot)
            self._slot = None
        super().connection_lost(exc)

    def _close(self) -> None:
        """Close, or half-close and linger if the request's body is still coming."""
        raw = self._raw
        if self._lingering or raw.is_closing():
            return
        if self.cycle is None or not self.cycle.more_body or not raw.can_write_eof():
            raw.close()
            return
        self._lingering = True
        for h in (self._deadline, self._write_deadline):
            if h is not None:
                h.cancel()
        self._write_deadline = None
        self._phase = None
        # after what is buffered: the answer, then end of stream; the client's own end
        # of stream closes the transport (uvicorn's eof_received returns None)
        raw.write_eof()
        self._deadline = self.loop.call_later(LINGER_S, raw.close)

    # -- the head's and the body's deadlines ---------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # the rest of a body no one will read
            return
        if self._refused:  # its request read, the refusal already written
            self.transport.close()
            return
        super().data_received(data)
        self._sync_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._sync_deadline()

    def _sync_deadline(self) -> None:
        """Arm the deadline of the phase the connection is in, if it changed."""
        state = self.conn.their_state
        phase: tuple[str, object] | None = None
        if state is h11.SEND_BODY and self.cycle is not None:
            phase = ("body", self.cycle)
        elif state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
            phase = ("head", self.cycle)
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is None:
            return
        head = phase[0] == "head"
        timeout = self.limits.head_timeout_s if head else self.limits.body_timeout_s
        expired: Callable[[], None] = self._head_expired if head else self._body_expired
        self._deadline = self.loop.call_later(timeout, expired)

    def _head_expired(self) -> None:
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why it is dropped
            self.transport.write(raw_error_response(
                408, f"the request head did not arrive whole within "
                     f"{self.limits.head_timeout_s:g} s", "head_timeout"))
        self.transport.close()

    def _body_expired(self) -> None:
        cycle = self.cycle
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if not cycle.response_started:
            self.transport.write(raw_error_response(
                408, f"the request body did not arrive whole within "
                     f"{self.limits.body_timeout_s:g} s", "body_timeout"))
        # the application reads a disconnect and nothing it sends goes out
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()

    # -- a slow reader ---------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.limits.write_timeout_s,
                                                        self._write_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_expired(self) -> None:
        self._write_deadline = None
        if self.flow.write_paused:  # its buffer full all this time: drop the client
            self.transport.abort()

    # -- a head that is not HTTP -------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_object(400, msg, None, "invalid_http")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event) or b"")
        except h11.LocalProtocolError:  # a response had started: nothing more to say
            pass
        self.transport.close()
