"""Prometheus text exposition of :meth:`CloudNode.stats`, and ``/health``, on a small
asyncio HTTP server.

Names follow vLLM's speculative-decoding metrics where one exists
(``vllm:spec_decode_num_accepted_tokens_total`` becomes
``xcosd_spec_decode_num_accepted_tokens_total``, and so on), so dashboards built
for one read the other.

No dependency: the text format (version 0.0.4) is written here, by the book, because
a scrape is read by programs that trust it:

* **Label values come only from fixed sets.** A message type labels the byte
  counters only if it is one of the protocol's (:data:`MESSAGE_TYPE_LABELS`), an
  error code labels the refusal counter only if it is a known code
  (:data:`ERROR_CODE_LABELS`); anything else is summed under ``"other"``. The
  type a byte meter sees is the header's ``"t"``, which the *peer* chose, so
  without this a peer could invent label values without end (a time series each,
  in the scraper) and, with a quote and a newline in one, write whole lines of
  its own into the scrape. The bound is by construction, not by filtering
  characters.
* **Values print exactly.** Integers print as integers (a ``%g`` of 2263730 is
  ``2.26373e+06``, which a counter cannot afford: it is off by tens once the count
  grows), floats with ``repr`` (the shortest text that reads back as the same
  double), and the non-finite ones as ``NaN``, ``+Inf``, ``-Inf``.
* **Everything is escaped anyway**: label values (backslash, double quote,
  newline) and HELP text (backslash, newline), so a future label taken from
  somewhere else cannot break the format either.

The HTTP server answers ``GET /metrics`` and ``GET /health`` (``HEAD`` too), 404 for
any other path and 405 for any other method, one request per connection. It is
bounded against a slow or hostile client: each connection runs in its own task, the
whole request head must arrive within ``read_timeout_s`` and fit in
``max_request_bytes`` (else 431), the answer must be taken within
``write_timeout_s``, and at most ``max_connections`` are served at once (more are
closed at once, unanswered). A client that stalls is dropped; it never holds the server or the
node, which share the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import ErrorCode
from ..protocol.errors import CODES
from ..protocol.messages import MESSAGE_TYPES

log = logging.getLogger(__name__)

#: bounds of the batch-size histogram
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

#: the label value every type or code outside the fixed sets is counted under
OTHER = "other"

#: the ``type`` label's values besides :data:`OTHER`: the protocol's message types
#: (a meter's ``"?"`` for an unreadable header, and any type a peer made up, are
#: :data:`OTHER`)
MESSAGE_TYPE_LABELS: frozenset[str] = frozenset(MESSAGE_TYPES)

#: the ``code`` label's values besides :data:`OTHER`: every :class:`ErrorCode`, and
#: ``peer_error``, which the cloud's protocol records for an ``error`` message the
#: edge sent (:class:`xcosd.protocol.cloud.Rejected`)
ERROR_CODE_LABELS: frozenset[str] = frozenset(c.value for c in ErrorCode) | {"peer_error"}

#: the byte counters' ``direction`` label values (:class:`xcosd.transport.Meter`)
DIRECTIONS = ("up", "down")

Labels = Mapping[str, str]
#: one sample: name suffix (``""``, ``"_bucket"``, ...), labels, value
Sample = tuple[str, Labels, object]


# --------------------------------------------------------------- text format 0.0.4


def escape_label_value(value: str) -> str:
    r"""A label value as the text format spells it: ``\`` -> ``\\``, ``"`` -> ``\"``,
    newline -> ``\n``. Everything else is UTF-8 as is."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    r"""HELP text as the text format spells it: ``\`` -> ``\\``, newline -> ``\n``
    (a raw newline would end the comment and start a line of the writer's choosing)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: object) -> str:
    """A sample value, exactly: integers (and bools, and numpy integers) in full,
    floats by ``repr`` (round-trips the double), non-finite ones as the format spells
    them. Anything that is not a number (a bug upstream) prints ``NaN`` rather than
    break the scrape or the server."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        f = float(value)
        if math.isnan(f):
            return "NaN"
        if math.isinf(f):
            return "+Inf" if f > 0 else "-Inf"
        return repr(f)
    return "NaN"


def _sample_line(name: str, labels: Labels, value: object) -> str:
    if labels:
        inner = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())
        return f"{name}{{{inner}}} {format_value(value)}"
    return f"{name} {format_value(value)}"


class _Exposition:
    """Lines of one scrape, a family (HELP, TYPE, samples) at a time."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str, samples: Iterable[Sample]) -> None:
        self.lines.append(f"# HELP {name} {escape_help(help_)}")
        self.lines.append(f"# TYPE {name} {kind}")
        self.lines.extend(_sample_line(name + suffix, labels, v) for suffix, labels, v in samples)

    def single(self, name: str, kind: str, help_: str, value: object) -> None:
        self.family(name, kind, help_, [("", {}, value)])

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# ------------------------------------------------------------------ label values


#: each label value to itself: a lookup returns our own string, never the caller's
#: object (a ``str`` subclass, an enum member), so what prints is from the fixed set
_TYPE_CANON = {t: t for t in MESSAGE_TYPE_LABELS}
_CODE_CANON = {c: c for c in ERROR_CODE_LABELS}


def message_type_label(t: object) -> str:
    """``t`` if it is one of the protocol's message types, else :data:`OTHER`."""
    return _TYPE_CANON.get(t, OTHER) if isinstance(t, str) else OTHER


def error_code_label(code: object) -> str:
    """``code`` if it is a known error code, else :data:`OTHER`."""
    return _CODE_CANON.get(code, OTHER) if isinstance(code, str) else OTHER


def _number(v: object) -> int | float:
    """``v`` if it is a number, else 0 (a counter that a stats dict lacks or spoils
    adds nothing rather than failing the scrape)."""
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    return 0


def _error_samples(errs: Mapping[Any, Any]) -> list[Sample]:
    # the wire codes always, at 0 until seen, so rate() has a series from the start
    counts: dict[str, int | float] = {c.value: 0 for c in CODES}
    for code, n in errs.items():
        label = error_code_label(code)
        counts[label] = counts.get(label, 0) + _number(n)
    return [("", {"code": c}, counts[c]) for c in sorted(counts)]


def _byte_samples(by: Mapping[str, Any]) -> list[Sample]:
    out: list[Sample] = []
    for direction in DIRECTIONS:
        sums: dict[str, int | float] = {}
        side = by.get(direction, {})
        for t, tally in (side.items() if isinstance(side, Mapping) else ()):
            label = message_type_label(t)
            wire = tally.get("wire", 0) if isinstance(tally, Mapping) else 0
            sums[label] = sums.get(label, 0) + _number(wire)
        out.extend(("", {"direction": direction, "type": t}, sums[t]) for t in sorted(sums))
    return out


def _histogram_samples(hist_in: Mapping[Any, Any]) -> list[Sample]:
    hist: dict[int, int | float] = {}
    for k, v in hist_in.items():
        with contextlib.suppress(TypeError, ValueError):
            hist[int(k)] = hist.get(int(k), 0) + _number(v)
    samples: list[Sample] = []
    for b in BATCH_BUCKETS:
        samples.append(("_bucket", {"le": str(b)}, sum(v for k, v in hist.items() if k <= b)))
    total = sum(hist.values())
    samples.append(("_bucket", {"le": "+Inf"}, total))
    samples.append(("_sum", {}, sum(k * v for k, v in hist.items())))
    samples.append(("_count", {}, total))
    return samples


def prometheus_text(stats: Mapping[str, Any]) -> str:
    """The text exposition (version 0.0.4) of a :meth:`CloudNode.stats` dict.

    Metric names, label names and the label values' sets are fixed here: nothing in
    ``stats`` can add a metric, a label or a line (see the module's docstring)."""
    ex = _Exposition()
    g = stats.get
    ex.single("xcosd_spec_decode_num_draft_tokens_total", "counter",
              "Draft tokens received for verification.", g("draft_tokens", 0))
    ex.single("xcosd_spec_decode_num_accepted_tokens_total", "counter",
              "Draft tokens accepted by the target.", g("accepted_tokens", 0))
    ex.single("xcosd_spec_decode_num_emitted_tokens_total", "counter",
              "Tokens emitted (accepted drafts plus one per round).", g("emitted_tokens", 0))
    ex.single("xcosd_spec_decode_num_rounds_total", "counter",
              "Verification rounds (one target call each).", g("rounds", 0))
    ex.single("xcosd_spec_decode_draft_acceptance_rate", "gauge",
              "Accepted / drafted tokens since start.", g("acceptance_rate", 0.0))
    ex.single("xcosd_spec_decode_mean_acceptance_length", "gauge",
              "1 + accepted / rounds since start.", g("mean_acceptance_length", 0.0))
    ex.single("xcosd_uptime_seconds", "gauge", "Seconds since the node started serving.",
              g("uptime_s", 0.0))
    ex.single("xcosd_num_sessions_running", "gauge", "Open sessions.", g("sessions_active", 0))
    ex.single("xcosd_num_peers", "gauge", "Connected edges.", g("peers", 0))
    ex.single("xcosd_num_requests_waiting", "gauge", "Rounds queued for scoring.",
              g("queued", 0))
    ex.single("xcosd_sessions_opened_total", "counter", "Sessions opened.",
              g("sessions_opened", 0))
    ex.single("xcosd_sessions_closed_total", "counter",
              "Sessions closed, for any reason (timed-out and failed ones included).",
              g("sessions_closed", 0))
    ex.single("xcosd_sessions_timed_out_total", "counter",
              "Sessions freed after a peer vanished.", g("sessions_timed_out", 0))
    ex.single("xcosd_sessions_failed_total", "counter", "Sessions closed by an error.",
              g("sessions_failed", 0))
    ex.single("xcosd_messages_received_total", "counter", "Messages received.",
              g("messages", 0))
    ex.single("xcosd_messages_dropped_total", "counter",
              "Replies dropped because the peer was gone or did not read.", g("dropped", 0))
    ex.single("xcosd_internal_errors_total", "counter",
              "Messages whose handling hit a bug (logged; the node keeps serving).",
              g("internal_errors", 0))
    errs = g("errors_by_code", {})
    ex.family("xcosd_protocol_errors_total", "counter",
              "Messages refused, by error code (unknown codes as \"other\").",
              _error_samples(errs if isinstance(errs, Mapping) else {}))
    sched = g("scheduler", {})
    if not isinstance(sched, Mapping):
        sched = {}
    hist = sched.get("batch_size_histogram", {})
    ex.family("xcosd_batch_size", "histogram", "Sessions scored per target call.",
              _histogram_samples(hist if isinstance(hist, Mapping) else {}))
    ex.single("xcosd_batch_compute_seconds_total", "counter", "Time in batched target calls.",
              sched.get("compute_s", 0.0))
    ex.single("xcosd_queue_wait_seconds_mean", "gauge", "Mean wait of a round before scoring.",
              sched.get("mean_queue_wait_s", 0.0))
    ex.single("xcosd_busy_refusals_total", "counter", "Rounds refused with busy.",
              sched.get("busy_refusals", 0))
    by = g("bytes", {})
    ex.family("xcosd_wire_bytes_total", "counter",
              "Bytes on the wire by direction and message type (unknown types as \"other\").",
              _byte_samples(by if isinstance(by, Mapping) else {}))
    return ex.text()


def health_body(stats: Mapping[str, Any]) -> dict[str, Any]:
    """``/health``'s JSON: that the node serves, for how long, and its load now."""
    return {"status": "ok", "uptime_s": round(float(_number(stats.get("uptime_s"))), 3),
            "sessions": int(_number(stats.get("sessions_active"))),
            "peers": int(_number(stats.get("peers")))}


# ------------------------------------------------------------------- HTTP server

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}
_TEXT = "text/plain; charset=utf-8"
_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


class _TooLarge(Exception):
    """The request head did not end within ``max_request_bytes``."""


def _response(status: int, ctype: str, body: bytes, head_only: bool = False,
              extra: str = "") -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
    return head.encode("ascii") + (b"" if head_only else body)


def _head_end(buf: bytes | bytearray) -> int:
    """Where the request head ends (after its blank line), or -1. A bare ``\\n\\n``
    counts too, for hand-typed requests."""
    ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := buf.find(sep)) >= 0]
    return min(ends) if ends else -1


class MetricsServer:
    """``GET /metrics`` -> Prometheus text; ``GET /health`` -> JSON; anything else ->
    404 (or 405 for another method). One request per connection, no keep-alive:
    enough for a scraper or a load balancer's probe, and nothing for a client to hold.

    The limits (see the module's docstring) are attributes, read at each
    connection, so a test or an embedding can tighten them after construction.
    """

    def __init__(self, stats: Callable[[], Mapping[str, Any]], host: str = "127.0.0.1",
                 port: int = 0, *, read_timeout_s: float = 5.0, write_timeout_s: float = 10.0,
                 max_request_bytes: int = 8192, max_connections: int = 64) -> None:
        self._stats = stats
        self.host, self.port = host, port
        #: seconds for the whole request head to arrive (not per line: a client
        #: trickling a header every few seconds is dropped all the same)
        self.read_timeout_s = read_timeout_s
        #: seconds for the client to take the whole answer
        self.write_timeout_s = write_timeout_s
        #: the longest request head accepted (request line and headers)
        self.max_request_bytes = max_request_bytes
        #: connections served at once; more are closed unanswered
        self.max_connections = max_connections
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    @property
    def health_url(self) -> str:
        return f"http://{self.host}:{self.port}/health"

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._handlers)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _read_head(self, reader: asyncio.StreamReader) -> bytes:
        """The request head, read under the caller's deadline; at most
        ``max_request_bytes`` are ever buffered."""
        buf = bytearray()
        while (end := _head_end(buf)) < 0:
            if len(buf) >= self.max_request_bytes:
                raise _TooLarge
            chunk = await reader.read(self.max_request_bytes - len(buf))
            if not chunk:  # the client stopped sending: take what came if it is a line
                if b"\n" in buf:
                    return bytes(buf)
                raise asyncio.IncompleteReadError(bytes(buf), None)
            buf += chunk
        return bytes(buf[:end])

    def _answer(self, head: bytes) -> bytes:
        parts = head.split(b"\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(400, _TEXT, b"bad request\n")
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return _response(405, _TEXT, b"method not allowed\n", extra="Allow: GET, HEAD\r\n")
        path = target.split("?", 1)[0]
        head_only = method == "HEAD"
        try:
            if path == "/metrics":
                return _response(200, _PROMETHEUS, prometheus_text(self._stats()).encode(),
                                 head_only)
            if path == "/health":
                body = json.dumps(health_body(self._stats())).encode() + b"\n"
                return _response(200, "application/json", body, head_only)
        except Exception:
            # a bug in stats() or here: the scrape fails, the server and node keep going
            log.exception("metrics: answering %s failed", path)
            return _response(500, _TEXT, b"internal error\n", head_only)
        return _response(404, _TEXT, b"not found\n", head_only)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # asyncio.start_server runs each connection in its own task: a client that
        # stalls holds that task only, until its deadline
        if len(self._handlers) >= self.max_connections:
            # no answer: writing one and closing with the request unread would reset
            # the connection anyway, and reading it is the work the cap refuses
            writer.transport.abort()
            return
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        clean = False
        try:
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    head = await self._read_head(reader)
            except _TooLarge:
                out = _response(431, _TEXT, b"request too large\n")
            else:
                out = self._answer(head)
            async with asyncio.timeout(self.write_timeout_s):
                writer.write(out)
                await writer.drain()
            clean = True
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass  # stalled, too slow or gone: dropped below
        except asyncio.CancelledError:
            # close() dropped it. Ending normally, not cancelled: Python 3.11's
            # stream callback calls .exception() on the finished task, which raises
            # (and is logged as an error) for a cancelled one
            pass
        finally:
            if task is not None:
                self._handlers.discard(task)
            if clean:
                writer.close()  # the answer is in the kernel's hands: a plain close
            else:
                writer.transport.abort()  # nothing left worth flushing to this client
            with contextlib.suppress(Exception, asyncio.CancelledError):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

    async def close(self) -> None:
        """Stop listening, drop the connections being served, wait for their tasks."""
        if self._server is not None:
            self._server.close()
            handlers = list(self._handlers)
            for t in handlers:
                t.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
