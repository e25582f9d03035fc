"""The edge's Prometheus metrics, as its HTTP API serves them on ``/metrics``.

Written with ``prometheus_client`` into a registry of the app's own (never the
process-wide default one: two apps in one process must not share counters).
Names follow vLLM's where one exists (``vllm:time_to_first_token_seconds`` is
``xcosd_edge_time_to_first_token_seconds`` here, ``vllm:spec_decode_num_accepted_tokens``
is ``xcosd_edge_spec_decode_num_accepted_tokens_total``), so a dashboard built for
one reads the other. Label values come only from fixed sets (the endpoint's name,
a finish reason of :data:`FINISH_REASONS`, an HTTP status class, the name of an
API key the operator gave): nothing a client sends becomes a label, so no client
can grow the number of series.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..nodes.arrivals import Arrivals
from ..nodes.metrics import tree_shape_label
from ..nodes.reach import ReachPhase
from ..nodes.stats import GenerationStats

if TYPE_CHECKING:
    from ..nodes.edge import EdgeNode

#: the ``endpoint`` label's values
ENDPOINTS = ("completions", "chat", "models", "health", "metrics", "other")
#: the ``finish_reason`` label's values; ``abort``: the client went away, ``error``:
#: the generation failed
FINISH_REASONS = ("stop", "length", "abort", "error")

#: time-to-first-token and latency buckets, in seconds (vLLM's, cut at 2 minutes)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 120.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0)


def status_class(status: int) -> str:
    """``2xx``, ``4xx`` ...: a bounded label for a status code."""
    return f"{min(max(status // 100, 1), 5)}xx"


class _ArrivalsCollector:
    """How the edge's first rounds waited for the requests arriving beside them
    (xcosd/nodes/arrivals.py), read from its counters at each scrape."""

    def __init__(self, arrivals: Arrivals) -> None:
        self.arrivals = arrivals

    def collect(self) -> Iterator[Metric]:
        a = self.arrivals
        yield CounterMetricFamily("xcosd_edge_opens_held", "first rounds that waited for "
                                  "requests arriving beside them", value=a.held)
        yield CounterMetricFamily("xcosd_edge_opens_hold_expired", "of them, released by the "
                                  "bound rather than by the last of those requests",
                                  value=a.expired)
        yield GaugeMetricFamily("xcosd_edge_open_hold_bound_seconds", "how long a first round "
                                "may wait now: the cloud's least recent call time, at most "
                                "open_hold_s", value=a.bound_s)


class _ReachCollector:
    """Whether the edge holds its cloud, and how its connecting went
    (xcosd/nodes/reach.py), read from the node at each scrape."""

    def __init__(self, edge: EdgeNode) -> None:
        self.edge = edge

    def collect(self) -> Iterator[Metric]:
        import time

        reach = self.edge.reach
        p = "xcosd_edge_cloud_"
        yield GaugeMetricFamily(p + "connected", "1 while the edge holds its cloud "
                                "(handshake done), else 0", value=int(self.edge.connected))
        state = GaugeMetricFamily(p + "state", "the edge's hold on its cloud: 1 for the "
                                  "state it is in", labels=["state"])
        for phase in ReachPhase:
            state.add_metric([phase.value], int(reach.phase is phase))
        yield state
        yield GaugeMetricFamily(p + "unavailable_seconds", "how long the cloud has been "
                                "missing (0 while connected)",
                                value=reach.waited_s(time.monotonic()))
        yield CounterMetricFamily(p + "reconnects", "connections made after the first",
                                  value=reach.reconnects)
        yield CounterMetricFamily(p + "losses", "connections lost once held (the transport "
                                  "failed, the cloud was silent, restarted or left)",
                                  value=reach.losses)
        yield CounterMetricFamily(p + "connect_failures", "connection attempts that failed",
                                  value=reach.failed_attempts)
        yield CounterMetricFamily(p + "waits_expired", "requests that waited for a missing "
                                  "cloud for the longest they may (cloud_wait_s), and failed",
                                  value=self.edge.waits_expired)


class EdgeMetrics:
    """Counters of the generations an edge's HTTP API served (``arrivals``: the
    edge's, whose holds it reports too; ``edge``: the node, whose hold on its cloud
    it reports)."""

    def __init__(self, arrivals: Arrivals | None = None, edge: EdgeNode | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        if arrivals is not None:
            r.register(_ArrivalsCollector(arrivals))
        if edge is not None:
            r.register(_ReachCollector(edge))
        p = "xcosd_edge_"
        self.requests = Counter(p + "http_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.running = Gauge(p + "num_requests_running", "generations in flight", registry=r)
        self.generations = Counter(p + "generations", "generations ended, by finish reason",
                                   ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens (target)", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "generated tokens (target)",
                                         registry=r)
        self.drafts = Counter(p + "spec_decode_num_drafts", "rounds (one target call each)",
                              registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "tokens drafted",
                                    registry=r)
        self.accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens",
                                       "drafted tokens the target accepted", registry=r)
        self.tree_rounds = Counter(p + "spec_decode_tree_rounds",
                                   "rounds that drafted a tree, by shape (those the tree policy "
                                   "picks from; any other as other)", ["shape"], registry=r)
        self.uplink_bytes = Counter(p + "uplink_bytes", "wire bytes sent to the cloud",
                                    registry=r)
        self.downlink_bytes = Counter(p + "downlink_bytes", "wire bytes received from the cloud",
                                      registry=r)
        self.resumes = Counter(p + "resumes", "sessions resumed after a fault", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "request arrival to the first generated text",
                              buckets=TTFT_BUCKETS, registry=r)
        self.latency = Histogram(p + "e2e_request_latency_seconds",
                                 "request arrival to the generation's end",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.refused = Counter(p + "http_unauthorized", "requests refused for want of a "
                               "right API key (401), before any work", registry=r)
        self.client_uplink = Counter(p + "client_uplink_bytes", "wire bytes sent to the cloud "
                                     "for each API key's requests ('-': no keys)", ["client"],
                                     registry=r)
        self.client_downlink = Counter(p + "client_downlink_bytes", "wire bytes received "
                                       "from the cloud for each API key's requests",
                                       ["client"], registry=r)
        self.client_generations = Counter(p + "client_generations", "generations run for "
                                          "each API key", ["client"], registry=r)
        for reason in FINISH_REASONS:  # every series exists from the start, at 0
            self.generations.labels(reason)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint if endpoint in ENDPOINTS else "other",
                             status_class(status)).inc()

    def unauthorized(self, path: str) -> None:
        """Count a request refused by the API-key check (``path``: not a label)."""
        self.refused.inc()

    def client(self, name: str, st: GenerationStats) -> None:
        """Meter one generation of the API key ``name``: every byte it moved, also
        when it failed or its client left."""
        self.client_generations.labels(name).inc()
        self.client_uplink.labels(name).inc(st.uplink_bytes)
        self.client_downlink.labels(name).inc(st.downlink_bytes)

    def generation(self, finish_reason: str, prompt_tokens: int, st: GenerationStats | None,
                   ttft_s: float | None, latency_s: float) -> None:
        """Count one generation that ended (``st``: its stats, if it got that far)."""
        self.generations.labels(finish_reason if finish_reason in FINISH_REASONS
                                else "error").inc()
        self.prompt_tokens.inc(prompt_tokens)
        if st is not None:
            self.generation_tokens.inc(st.tokens)
            self.drafts.inc(st.rounds)
            self.draft_tokens.inc(st.drafted)
            self.accepted_tokens.inc(st.accepted)
            for shape, n in st.shapes.items():
                self.tree_rounds.labels(tree_shape_label(shape)).inc(n)
            self.uplink_bytes.inc(st.uplink_bytes)
            self.downlink_bytes.inc(st.downlink_bytes)
            self.resumes.inc(st.resumes)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.latency.observe(latency_s)
