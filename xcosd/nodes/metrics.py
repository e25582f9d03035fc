"""Prometheus metrics of :meth:`CloudNode.stats`, and ``/health``, on the project's
HTTP stack (:mod:`xcosd.http`: a Starlette app served by uvicorn in the node's loop).

Names follow vLLM's speculative-decoding metrics where one exists
(``vllm:spec_decode_num_accepted_tokens_total`` becomes
``xcosd_spec_decode_num_accepted_tokens_total``, and so on), so dashboards built
for one read the other.

The exposition is ``prometheus_client``'s (the Prometheus text format, served as
its ``CONTENT_TYPE_LATEST``: escaping, value printing, HELP and TYPE lines), from a
collector (:class:`CloudCollector`) that reads one stats snapshot per scrape, in a
registry of the server's own (never the process-wide default one: several nodes
in one process must not share series).
What this module adds is the bound on label values: **they come only from fixed
sets.** A message type labels the byte counters only if it is one of the
protocol's (:data:`MESSAGE_TYPE_LABELS`), an error code labels the refusal counter
only if it is a known code (:data:`ERROR_CODE_LABELS`); anything else is summed
under ``"other"``. The type a byte meter sees is the header's ``"t"``, which the
*peer* chose, so without this a peer could invent label values without end (a
time series each, in the scraper). The bound is by construction, not by filtering
characters; ``prometheus_client`` escapes anyway.

Values are the float64 a Prometheus scraper reads: integers up to 2**53 print and
parse back exactly (``2263730`` may print as ``2.26373e+06``, the same number).

The server answers ``GET`` / ``HEAD`` ``/metrics`` and ``/health``, 404 for any other
path and 405 for any other method; ``/health``'s status and body come from one
function (``health``), so a node that should take no new work (draining) can
answer 503. It is bounded against a slow or hostile client by
:class:`~xcosd.http.HttpServer`: a request head must arrive whole within
``read_timeout_s`` of the connection opening (or of the previous answer on a
kept-alive connection), so a client trickling a header a line at a time is
dropped all the same; a head still incomplete once ``max_request_bytes`` of it are
buffered is refused (400; the cap is on what h11 buffers, so a whole head that
arrives in one read may be longer); and at most ``max_connections`` are served at
once (one more is refused with 503 as it connects). A client that stalls is
dropped; it never holds the server or the node, which share the event loop.

Replicas (``xcosd serve --replicas N``): each replica is its own ``xcosd serve
--join`` process with its own :class:`CloudNode`, and serves its own port
(``--metrics-port`` + i; a free one each with ``--metrics-port 0``); the broker
process serves none. They are scraped as separate targets, which is how
Prometheus counts replicas (``sum`` across them). ``prometheus_client``'s
multiprocess mode does not fit: it sums Counter/Gauge/Histogram objects whose
every update the processes write to files, not custom collectors, and these
metrics are read from each node's live stats when scraped, not kept in such
objects; its files must lie in one directory every process shares, while a
replica may ``--join`` from another host; and a replica the broker restarts would
leave a dead process's files to clean up. Separate targets also show one
replica's restart as that replica's counter reset, and a slow replica apart from
the others.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..errors import ErrorCode
from ..http import ConnectionLimits, HttpServer
from ..http.exposition import metrics_response
from ..policies.tree_policy import DEFAULT_MAX_TREE, policy_shapes
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

# ------------------------------------------------------------------ label values


#: each label value to itself: a lookup returns our own string, never the caller's
#: object (a ``str`` subclass, an enum member), so what prints is from the fixed set
_TYPE_CANON = {t: t for t in MESSAGE_TYPE_LABELS}
_CODE_CANON = {c: c for c in ERROR_CODE_LABELS}
#: the tree shapes a metric names: those the tree policy chooses among and its probes
#: (an edge may send any shape; the others count as :data:`OTHER`)
TREE_SHAPE_LABELS = frozenset(s.label for s in policy_shapes(DEFAULT_MAX_TREE))
_SHAPE_CANON = {s: s for s in TREE_SHAPE_LABELS}


def message_type_label(t: object) -> str:
    """``t`` if it is one of the protocol's message types, else :data:`OTHER`."""
    return _TYPE_CANON.get(t, OTHER) if isinstance(t, str) else OTHER


def error_code_label(code: object) -> str:
    """``code`` if it is a known error code, else :data:`OTHER`."""
    return _CODE_CANON.get(code, OTHER) if isinstance(code, str) else OTHER


def tree_shape_label(shape: object) -> str:
    """``shape`` if it is one of :data:`TREE_SHAPE_LABELS`, else :data:`OTHER`."""
    return _SHAPE_CANON.get(shape, OTHER) if isinstance(shape, str) else OTHER


def _number(v: object) -> int | float:
    """``v`` if it is a number, else 0 (a counter that a stats dict lacks or spoils
    adds nothing rather than failing the scrape)."""
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    return 0


class CloudCollector:
    """The cloud's metric families from one ``stats()`` snapshot per scrape.

    Metric names, label names and the label values' sets are fixed here: nothing in
    the stats can add a metric, a label or a line (see the module's docstring)."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # no fixed description: the registry must not call collect() to get one

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        g = stats.get

        def counter(name: str, help_: str, value: object) -> Metric:
            return CounterMetricFamily(name, help_, value=_number(value))

        def gauge(name: str, help_: str, value: object) -> Metric:
            return GaugeMetricFamily(name, help_, value=_number(value))

        yield counter("xcosd_spec_decode_num_draft_tokens", "Draft tokens received for "
                      "verification.", g("draft_tokens", 0))
        yield counter("xcosd_spec_decode_num_accepted_tokens", "Draft tokens accepted by the "
                      "target.", g("accepted_tokens", 0))
        yield counter("xcosd_spec_decode_num_emitted_tokens", "Tokens emitted (accepted drafts "
                      "plus one per round).", g("emitted_tokens", 0))
        yield counter("xcosd_spec_decode_num_rounds", "Verification rounds (one target call "
                      "each).", g("rounds", 0))
        yield gauge("xcosd_spec_decode_draft_acceptance_rate", "Accepted / drafted tokens "
                    "since start.", g("acceptance_rate", 0.0))
        yield gauge("xcosd_spec_decode_mean_acceptance_length", "1 + accepted / rounds since "
                    "start.", g("mean_acceptance_length", 0.0))
        yield gauge("xcosd_uptime_seconds", "Seconds since the node started serving.",
                    g("uptime_s", 0.0))
        yield gauge("xcosd_num_sessions_running", "Open sessions.", g("sessions_active", 0))
        yield gauge("xcosd_num_peers", "Connected edges.", g("peers", 0))
        yield gauge("xcosd_num_requests_waiting", "Rounds queued for scoring.", g("queued", 0))
        yield gauge("xcosd_draining", "1 once the node drains (takes no new session), else 0.",
                    1 if g("draining") else 0)
        yield counter("xcosd_sessions_opened", "Sessions opened.", g("sessions_opened", 0))
        yield counter("xcosd_sessions_closed", "Sessions closed, for any reason (timed-out "
                      "and failed ones included).", g("sessions_closed", 0))
        yield counter("xcosd_sessions_timed_out", "Sessions freed after a peer vanished.",
                      g("sessions_timed_out", 0))
        yield counter("xcosd_sessions_failed", "Sessions closed by an error.",
                      g("sessions_failed", 0))
        yield counter("xcosd_messages_received", "Messages received.", g("messages", 0))
        yield counter("xcosd_messages_dropped", "Replies dropped because the peer was gone "
                      "or did not read.", g("dropped", 0))
        yield counter("xcosd_control_messages_dropped", "Pings, vocabulary requests and "
                      "undecodable frames past their peer's budget, dropped unanswered.",
                      g("dropped_control", 0))
        yield counter("xcosd_internal_errors", "Messages whose handling hit a bug (logged; "
                      "the node keeps serving).", g("internal_errors", 0))
        yield counter("xcosd_renders", "Prompts tokenised and chats rendered for edges.",
                      g("renders", 0))
        errs = g("errors_by_code", {})
        fam = CounterMetricFamily("xcosd_protocol_errors", "Messages refused, by error code "
                                  "(unknown codes as \"other\").", labels=["code"])
        for code, n in _error_counts(errs if isinstance(errs, Mapping) else {}):
            fam.add_metric([code], n)
        yield fam
        shapes = g("tree_shapes", {})
        fam = CounterMetricFamily("xcosd_spec_decode_tree_rounds", "Rounds that verified a "
                                  "draft tree, by shape (those the tree policy picks "
                                  "from; any other as \"other\").", labels=["shape"])
        by_label: dict[str, int | float] = {}
        for shape, n in (shapes if isinstance(shapes, Mapping) else {}).items():
            label = tree_shape_label(shape)
            by_label[label] = by_label.get(label, 0) + _number(n)
        for label, n in sorted(by_label.items()):
            fam.add_metric([label], n)
        yield fam
        sched = g("scheduler", {})
        if not isinstance(sched, Mapping):
            sched = {}
        hist = sched.get("batch_size_histogram", {})
        buckets, total = _batch_buckets(hist if isinstance(hist, Mapping) else {})
        yield HistogramMetricFamily("xcosd_batch_size", "Sessions scored per target call.",
                                    buckets=buckets, sum_value=total)
        yield counter("xcosd_batch_compute_seconds", "Time in batched target calls.",
                      sched.get("compute_s", 0.0))
        yield gauge("xcosd_queue_wait_seconds_mean", "Mean wait of a round before scoring.",
                    sched.get("mean_queue_wait_s", 0.0))
        yield counter("xcosd_busy_refusals", "Rounds refused with busy.",
                      sched.get("busy_refusals", 0))
        by = g("bytes", {})
        fam = CounterMetricFamily("xcosd_wire_bytes", "Bytes on the wire by direction and "
                                  "message type (unknown types as \"other\").",
                                  labels=["direction", "type"])
        for direction, t, n in _byte_sums(by if isinstance(by, Mapping) else {}):
            fam.add_metric([direction, t], n)
        yield fam


def _error_counts(errs: Mapping[Any, Any]) -> list[tuple[str, int | float]]:
    # the wire codes always, at 0 until seen, so rate() has a series from the start
    counts: dict[str, int | float] = {c.value: 0 for c in CODES}
    for code, n in errs.items():
        label = error_code_label(code)
        counts[label] = counts.get(label, 0) + _number(n)
    return [(c, counts[c]) for c in sorted(counts)]


def _byte_sums(by: Mapping[str, Any]) -> list[tuple[str, str, int | float]]:
    out: list[tuple[str, str, int | float]] = []
    for direction in DIRECTIONS:
        sums: dict[str, int | float] = {}
        side = by.get(direction, {})
        for t, tally in (side.items() if isinstance(side, Mapping) else ()):
            label = message_type_label(t)
            wire = tally.get("wire", 0) if isinstance(tally, Mapping) else 0
            sums[label] = sums.get(label, 0) + _number(wire)
        out.extend((direction, t, sums[t]) for t in sorted(sums))
    return out


def _batch_buckets(hist_in: Mapping[Any, Any]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative ``(le, count)`` buckets of :data:`BATCH_BUCKETS` and +Inf, and the
    sum of the batch sizes."""
    hist: dict[int, int | float] = {}
    for k, v in hist_in.items():
        with contextlib.suppress(TypeError, ValueError):
            hist[int(k)] = hist.get(int(k), 0) + _number(v)
    buckets = [(str(b), float(sum(v for k, v in hist.items() if k <= b)))
               for b in BATCH_BUCKETS]
    buckets.append(("+Inf", float(sum(hist.values()))))
    return buckets, float(sum(k * v for k, v in hist.items()))


def prometheus_text(stats: Mapping[str, Any]) -> str:
    """The text exposition of a :meth:`CloudNode.stats` dict (what ``/metrics``
    answers for it)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CloudCollector(lambda: stats))
    return generate_latest(registry).decode()


def health_body(stats: Mapping[str, Any]) -> dict[str, Any]:
    """``/health``'s JSON: that the node serves, for how long, and its load now."""
    return {"status": "ok", "uptime_s": round(float(_number(stats.get("uptime_s"))), 3),
            "sessions": int(_number(stats.get("sessions_active"))),
            "peers": int(_number(stats.get("peers")))}


#: ``/health``'s answer: an HTTP status and the JSON body (a draining or full node
#: answers 503, so a balancer's check sends new connections elsewhere)
Health = Callable[[], tuple[int, Mapping[str, Any]]]


class MetricsServer:
    """``GET /metrics`` -> Prometheus text; ``GET /health`` -> JSON; anything else ->
    404 (or 405 for another method), on :class:`~xcosd.http.HttpServer`.

    ``health``: what ``/health`` answers (default: 200 and :func:`health_body`).
    The bounds are :class:`~xcosd.http.HttpServer`'s: ``read_timeout_s`` for a
    request head, ``max_request_bytes`` of it, ``max_connections`` at once."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], host: str = "127.0.0.1",
                 port: int = 0, *, read_timeout_s: float = 5.0,
                 max_request_bytes: int = 8192, max_connections: int = 64,
                 health: Health | None = None) -> None:
        self._stats = stats
        self._health = health or (lambda: (200, health_body(self._stats())))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(CloudCollector(stats))
        self.app = Starlette(routes=[
            Route("/metrics", self._metrics, methods=["GET", "HEAD"]),
            Route("/health", self._health_route, methods=["GET", "HEAD"]),
        ], exception_handlers={HTTPException: _plain_error})
        self.app.router.redirect_slashes = False  # /health/ is not /health: 404
        self._http = HttpServer(self.app, host, port, limits=ConnectionLimits(
            max_connections=max_connections, max_per_address=max_connections,
            head_timeout_s=read_timeout_s, max_head_bytes=max_request_bytes),
            grace_s=1.0, name="xcosd-metrics")
        self.host = host

    @property
    def port(self) -> int:
        return self._http.port

    @property
    def url(self) -> str:
        return f"{self._http.url}/metrics"

    @property
    def health_url(self) -> str:
        return f"{self._http.url}/health"

    @property
    def connections(self) -> int:
        """Connections open now."""
        return self._http.connections

    async def start(self) -> None:
        await self._http.start()

    async def _metrics(self, request: Request) -> Response:
        try:
            return metrics_response(self.registry, request)
        except Exception:
            # a bug in stats() or here: the scrape fails, the server and node keep going
            log.exception("metrics: answering /metrics failed")
            return PlainTextResponse("internal error\n", status_code=500)

    async def _health_route(self, request: Request) -> Response:
        try:
            status, body = self._health()
        except Exception:
            log.exception("metrics: answering /health failed")
            return PlainTextResponse("internal error\n", status_code=500)
        if request.method == "HEAD":
            return Response(b"", status_code=status, media_type="application/json")
        return JSONResponse(dict(body), status_code=status)

    async def close(self) -> None:
        """Stop listening and let go of the connections."""
        await self._http.close()


async def _plain_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return PlainTextResponse(f"{exc.detail}\n".lower(), status_code=exc.status_code,
                             headers=exc.headers)
