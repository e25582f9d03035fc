"""Prometheus text exposition of :meth:`CloudNode.stats`, on a plain asyncio HTTP server.

Names follow vLLM's speculative-decoding metrics where one exists
(``vllm:spec_decode_num_accepted_tokens_total`` becomes
``xcosd_spec_decode_num_accepted_tokens_total``, and so on), so dashboards built
for one read the other. No dependency: the exposition format is a few lines of text.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

#: bounds of the batch-size histogram
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _line(name: str, value: float, labels: dict[str, str] | None = None) -> str:
    if labels:
        inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        return f"{name}{{{inner}}} {value:g}"
    return f"{name} {value:g}"


def prometheus_text(stats: dict[str, Any]) -> str:
    """The text exposition (version 0.0.4) of a :meth:`CloudNode.stats` dict."""
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float | None = None,
               samples: list[str] | None = None) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        if samples is not None:
            out.extend(samples)
        elif value is not None:
            out.append(_line(name, value))

    metric("xcosd_spec_decode_num_draft_tokens_total", "counter",
           "Draft tokens received for verification.", stats.get("draft_tokens", 0))
    metric("xcosd_spec_decode_num_accepted_tokens_total", "counter",
           "Draft tokens accepted by the target.", stats.get("accepted_tokens", 0))
    metric("xcosd_spec_decode_num_emitted_tokens_total", "counter",
           "Tokens emitted (accepted drafts plus one per round).", stats.get("emitted_tokens", 0))
    metric("xcosd_spec_decode_num_rounds_total", "counter",
           "Verification rounds (one target call each).", stats.get("rounds", 0))
    metric("xcosd_spec_decode_draft_acceptance_rate", "gauge",
           "Accepted / drafted tokens since start.", stats.get("acceptance_rate", 0.0))
    metric("xcosd_spec_decode_mean_acceptance_length", "gauge",
           "1 + accepted / rounds since start.", stats.get("mean_acceptance_length", 0.0))
    metric("xcosd_num_sessions_running", "gauge", "Open sessions.",
           stats.get("sessions_active", 0))
    metric("xcosd_num_peers", "gauge", "Connected edges.", stats.get("peers", 0))
    metric("xcosd_num_requests_waiting", "gauge", "Rounds queued for scoring.",
           stats.get("queued", 0))
    metric("xcosd_sessions_opened_total", "counter", "Sessions opened.",
           stats.get("sessions_opened", 0))
    metric("xcosd_sessions_timed_out_total", "counter", "Sessions freed after a peer vanished.",
           stats.get("sessions_timed_out", 0))
    metric("xcosd_messages_received_total", "counter", "Messages received.",
           stats.get("messages", 0))
    metric("xcosd_messages_dropped_total", "counter",
           "Replies dropped because the peer was gone or did not read.", stats.get("dropped", 0))
    errs = stats.get("errors_by_code", {})
    metric("xcosd_protocol_errors_total", "counter", "Messages refused, by error code.",
           samples=[_line("xcosd_protocol_errors_total", v, {"code": k})
                    for k, v in sorted(errs.items())] or
           [_line("xcosd_protocol_errors_total", 0, {"code": "none"})])
    sched = stats.get("scheduler", {})
    hist = {int(k): v for k, v in sched.get("batch_size_histogram", {}).items()}
    samples, cum = [], 0
    total = sum(hist.values())
    for b in BATCH_BUCKETS:
        cum = sum(v for k, v in hist.items() if k <= b)
        samples.append(_line("xcosd_batch_size_bucket", cum, {"le": str(b)}))
    samples.append(_line("xcosd_batch_size_bucket", total, {"le": "+Inf"}))
    samples.append(_line("xcosd_batch_size_sum", sum(k * v for k, v in hist.items())))
    samples.append(_line("xcosd_batch_size_count", total))
    metric("xcosd_batch_size", "histogram", "Sessions scored per target call.", samples=samples)
    metric("xcosd_batch_compute_seconds_total", "counter", "Time in batched target calls.",
           sched.get("compute_s", 0.0))
    metric("xcosd_queue_wait_seconds_mean", "gauge", "Mean wait of a round before scoring.",
           sched.get("mean_queue_wait_s", 0.0))
    metric("xcosd_busy_refusals_total", "counter", "Rounds refused with busy.",
           sched.get("busy_refusals", 0))
    by = stats.get("bytes", {})
    samples = []
    for direction in ("up", "down"):
        for t, tally in sorted(by.get(direction, {}).items()):
            samples.append(_line("xcosd_wire_bytes_total", tally.get("wire", 0),
                                 {"direction": direction, "type": t}))
    metric("xcosd_wire_bytes_total", "counter", "Bytes on the wire by direction and type.",
           samples=samples or [_line("xcosd_wire_bytes_total", 0,
                                     {"direction": "up", "type": "none"})])
    return "\n".join(out) + "\n"


class MetricsServer:
    """``GET /metrics`` -> Prometheus text; anything else -> 404. One request per
    connection, no keep-alive: enough for a scraper, nothing to configure."""

    def __init__(self, stats: Callable[[], dict[str, Any]], host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self._stats = stats
        self.host, self.port = host, port
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)).strip():
                pass
            parts = line.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                body = prometheus_text(self._stats()).encode()
                head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n"
                        b"Connection: close\r\n\r\n")
            else:
                body = b"not found\n"
                head = (b"HTTP/1.1 404 Not Found\r\nContent-Length: 10\r\n"
                        b"Connection: close\r\n\r\n")
            writer.write(head + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            if task is not None:
                self._handlers.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._handlers):
                t.cancel()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
