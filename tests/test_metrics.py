"""The cloud's Prometheus endpoint and ``/health``, by the book: real HTTP over
loopback against a real CloudNode, the scrape read back with prometheus_client's
own parser.

What is checked: the exposition parses and has exactly the documented families;
counters read back exactly (as the float64 a scraper reads); a message type or an
error code a peer chose can add neither a metric nor a label value (the byte
meter's type is the peer's header ``"t"``, which once let a peer write
``xcosd_fake_metric{x="0"} 37`` into the scrape), and whatever a label or HELP
text holds is escaped by the writer the server answers with; ``/health`` answers
what its one function returns (a draining node's 503); a slow or hostile HTTP
client is dropped without holding the server, an idle kept-alive one too; and
``xcosd serve --replicas 2`` serves each replica's metrics on its own port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import msgpack
import numpy as np
import pytest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

import xcosd
from xcosd.errors import ErrorCode
from xcosd.nodes.metrics import (
    ERROR_CODE_LABELS,
    MESSAGE_TYPE_LABELS,
    OTHER,
    TREE_SHAPE_LABELS,
    MetricsServer,
    error_code_label,
    message_type_label,
    prometheus_text,
)
from xcosd.protocol.messages import MESSAGE_TYPES
from xcosd.transport import connect

from .helpers.slow_http import trickle_head
from .helpers.waits import HANG_S, until
from .session_pairs import pair

#: every family the exposition has, and only these (docs/NODES.md lists them)
FAMILIES = {
    "xcosd_spec_decode_num_draft_tokens", "xcosd_spec_decode_num_accepted_tokens",
    "xcosd_spec_decode_num_emitted_tokens", "xcosd_spec_decode_num_rounds",
    "xcosd_spec_decode_draft_acceptance_rate", "xcosd_spec_decode_mean_acceptance_length",
    "xcosd_uptime_seconds", "xcosd_num_sessions_running", "xcosd_num_peers",
    "xcosd_num_requests_waiting", "xcosd_sessions_opened", "xcosd_sessions_closed",
    "xcosd_sessions_timed_out", "xcosd_sessions_failed", "xcosd_messages_received",
    "xcosd_messages_dropped", "xcosd_control_messages_dropped", "xcosd_internal_errors",
    "xcosd_protocol_errors",
    "xcosd_batch_size", "xcosd_batch_compute_seconds", "xcosd_queue_wait_seconds_mean",
    "xcosd_busy_refusals", "xcosd_wire_bytes", "xcosd_renders", "xcosd_draining",
    "xcosd_spec_decode_tree_rounds",
}

#: header types a peer might send to break the scrape: each fits the 31-byte short
#: string the byte meter reads in place, so each reaches the meter as it is
HOSTILE_TYPES = [
    'x"} 1\nxcosd_fake_metric{x="0',
    "a\\",
    'q"',
    "\n# TYPE xcosd_evil counter\n",
    "hello ",  # a real type with a space: still not a real type
    "HELLO",
    "other\n",
]


# --------------------------------------------------------------------- helpers


async def http(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` raw, read the answer to EOF: status, headers, body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), HANG_S)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return status, headers, body


async def get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    return await http(port, f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                            "\r\n".encode())


def port_of(url: str | None) -> int:
    assert url is not None
    return int(url.rsplit(":", 1)[1].split("/")[0])


def parse(text: str) -> dict[str, Any]:
    """The families prometheus_client reads from ``text``, by name; also checks that
    no sample (name and labels) appears twice, which the parser lets through."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    seen = [(s.name, tuple(sorted(s.labels.items())))
            for f in families.values() for s in f.samples]
    assert len(seen) == len(set(seen)), "a sample appears twice"
    return families


def sample_value(families: Mapping[str, Any], name: str, labels: dict[str, str]) -> float:
    for f in families.values():
        for s in f.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise AssertionError(f"no sample {name}{labels}")


def check_bounded(families: Mapping[str, Any], text: str) -> None:
    """Only the documented families, and label values only from the fixed sets."""
    assert set(families) == FAMILIES
    for f in families.values():
        for s in f.samples:
            assert set(s.labels) <= {"code", "direction", "type", "le", "shape"}, s
            if "shape" in s.labels:
                assert s.labels["shape"] in TREE_SHAPE_LABELS | {OTHER}, s
            if "type" in s.labels:
                assert s.labels["type"] in MESSAGE_TYPE_LABELS | {OTHER}, s
            if "code" in s.labels:
                assert s.labels["code"] in ERROR_CODE_LABELS | {OTHER}, s
            if "direction" in s.labels:
                assert s.labels["direction"] in ("up", "down"), s
    for line in text.splitlines():
        assert line.startswith("# HELP xcosd_") or line.startswith("# TYPE xcosd_") or any(
            line.startswith(name) for name in FAMILIES), line


# -------------------------------------------------------------- text format units


def test_values_read_back_exactly() -> None:
    # a scraper reads float64: integers up to 2**53 and any double come back as they were
    text = prometheus_text({"messages": 2263730, "dropped": 2**53,
                            "sessions_opened": np.int64(123456789),
                            "scheduler": {"compute_s": 0.1 + 0.2}, "uptime_s": 1e-300 / 3,
                            "internal_errors": "12", "sessions_failed": None})
    fams = parse(text)
    assert sample_value(fams, "xcosd_messages_received_total", {}) == 2263730
    assert sample_value(fams, "xcosd_messages_dropped_total", {}) == 2**53
    assert sample_value(fams, "xcosd_sessions_opened_total", {}) == 123456789
    assert sample_value(fams, "xcosd_batch_compute_seconds_total", {}) == 0.1 + 0.2
    assert sample_value(fams, "xcosd_uptime_seconds", {}) == 1e-300 / 3
    # not a number: nothing of the caller's text, a zero
    assert sample_value(fams, "xcosd_internal_errors_total", {}) == 0
    assert sample_value(fams, "xcosd_sessions_failed_total", {}) == 0


def test_label_values_come_from_fixed_sets() -> None:
    assert set(MESSAGE_TYPES) == MESSAGE_TYPE_LABELS
    assert OTHER not in MESSAGE_TYPE_LABELS and OTHER not in ERROR_CODE_LABELS
    assert {c.value for c in ErrorCode} <= ERROR_CODE_LABELS
    assert message_type_label("draft") == "draft"
    assert error_code_label(ErrorCode.BUSY) == "busy"
    assert type(error_code_label(ErrorCode.BUSY)) is str
    for bad in [*HOSTILE_TYPES, "?", "", None, 3, b"hello"]:
        assert message_type_label(bad) == OTHER
        assert error_code_label(bad) == OTHER


def test_any_stats_dict_gives_a_valid_exposition() -> None:
    spoilt: list[dict[str, Any]] = [
        {}, {"scheduler": None, "bytes": 3, "errors_by_code": []},
        {"messages": "many", "bytes": {"up": {"hello": None}}}]
    for stats in spoilt:
        text = prometheus_text(stats)
        check_bounded(parse(text), text)
    text = prometheus_text({
        "errors_by_code": {ErrorCode.BUSY: 4, 'e"} 9\nxcosd_fake 1': 4, "zzz": 1},
        "bytes": {"up": {t: {"wire": 10} for t in [*HOSTILE_TYPES, "draft", "?"]}},
        "scheduler": {"batch_size_histogram": {1: 3, 4: 2, 300: 1}, "compute_s": 0.1 + 0.2},
    })
    fams = parse(text)
    check_bounded(fams, text)
    assert sample_value(fams, "xcosd_protocol_errors_total", {"code": "busy"}) == 4
    assert sample_value(fams, "xcosd_protocol_errors_total", {"code": OTHER}) == 5
    assert sample_value(fams, "xcosd_wire_bytes_total",
                        {"direction": "up", "type": OTHER}) == 10 * (len(HOSTILE_TYPES) + 1)
    assert sample_value(fams, "xcosd_batch_size_bucket", {"le": "4"}) == 5
    assert sample_value(fams, "xcosd_batch_size_bucket", {"le": "+Inf"}) == 6
    assert sample_value(fams, "xcosd_batch_size_sum", {}) == 3 + 8 + 300
    assert "xcosd_batch_compute_seconds_total 0.30000000000000004\n" in text


# ----------------------------------------------------------- against a real node


async def test_scrape_parses_and_prints_counters_exactly() -> None:
    target, draft = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", metrics_port=0) as cloud:
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge:
            await edge.generate("ab", max_new_tokens=12)
        # the edge's close is the last message it sends; once the cloud has taken it
        # in, nothing else moves the counters
        await until(lambda: cloud.config.sessions == 0, "the edge's close to arrive")
        # counts no test could reach by traffic
        cloud.counters["messages"] = 2263730
        cloud.counters["dropped"] = 2**53  # the largest a double holds exactly
        status, headers, body = await get(port_of(cloud.metrics_endpoint), "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=")
    assert int(headers["content-length"]) == len(body)
    text = body.decode()
    fams = parse(text)
    assert sample_value(fams, "xcosd_messages_received_total", {}) == 2263730
    assert sample_value(fams, "xcosd_messages_dropped_total", {}) == 2**53
    check_bounded(fams, text)
    assert sample_value(fams, "xcosd_spec_decode_num_draft_tokens_total", {}) > 0
    assert sample_value(fams, "xcosd_batch_size_count", {}) > 0
    assert sample_value(fams, "xcosd_wire_bytes_total", {"direction": "up", "type": "draft"}) > 0
    assert sample_value(fams, "xcosd_wire_bytes_total", {"direction": "down", "type": "verdict"}) > 0


async def test_a_peer_cannot_add_a_metric_or_a_label_value() -> None:
    target, _ = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", metrics_port=0) as cloud:
        conn = await connect(cloud.endpoint)
        try:
            for t in HOSTILE_TYPES:
                await conn.send([msgpack.packb({"t": t, "s": 1})])
            await until(lambda: cloud.stats()["errors_by_code"].get("unknown_type", 0)
                        >= len(HOSTILE_TYPES), "the hostile messages to be refused")
        finally:
            await conn.close()
        # every type reached the byte meter as the peer wrote it
        assert set(HOSTILE_TYPES) <= set(cloud.stats()["bytes"]["up"])
        # and a code from nowhere (no peer can set one today; the bound must not rely on it)
        cloud.counters["errors_by_code"]['x"} 1\nxcosd_fake_metric{x="0'] = 37
        status, _, body = await get(port_of(cloud.metrics_endpoint), "/metrics")
    assert status == 200
    text = body.decode()
    assert "xcosd_fake_metric" not in text and "xcosd_evil" not in text
    fams = parse(text)
    check_bounded(fams, text)
    assert sample_value(fams, "xcosd_wire_bytes_total", {"direction": "up", "type": OTHER}) > 0
    assert sample_value(fams, "xcosd_protocol_errors_total", {"code": OTHER}) == 37
    assert sample_value(fams, "xcosd_protocol_errors_total",
                        {"code": "unknown_type"}) >= len(HOSTILE_TYPES)


async def test_health_and_unknown_paths() -> None:
    target, draft = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", metrics_port=0) as cloud:
        port = port_of(cloud.metrics_endpoint)
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge:
            await edge.generate("a", max_new_tokens=4)
            # generate returns before the cloud has taken the session's close in
            await until(lambda: cloud.config.sessions == 0, "the edge's close to arrive")
            status, headers, body = await get(port, "/health")
            assert status == 200 and headers["content-type"] == "application/json"
            health = json.loads(body)
            assert health["status"] == "ok" and health["peers"] == 1
            assert health["sessions"] == 0 and health["uptime_s"] >= 0
            assert set(health) == {"status", "uptime_s", "sessions", "peers", "server_id"}
        assert (await get(port, "/health?verbose=1"))[0] == 200
        assert (await get(port, "/metrics?x=1"))[0] == 200
        for path in ("/", "/metricsx", "/health/", "/../metrics"):
            assert (await get(port, path))[0] == 404, path
        assert (await get(port, "/metrics", "POST"))[0] == 405
        assert (await http(port, b"\x00\xff garbage\r\n\r\n"))[0] == 400
        status, headers, body = await get(port, "/metrics", "HEAD")
        assert status == 200 and body == b"" and int(headers["content-length"]) > 0
    # the node is gone: so is its endpoint
    with pytest.raises(OSError):
        await get(port, "/health")


async def test_a_stalled_client_is_dropped_and_others_are_served() -> None:
    target, _ = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", metrics_port=0) as cloud:
        # the node's own server: a stalled client holds nobody else up
        port = port_of(cloud.metrics_endpoint)
        _, stalled = await asyncio.open_connection("127.0.0.1", port)
        stalled.write(b"GET /metr")
        for _ in range(3):
            assert (await get(port, "/metrics"))[0] == 200
            assert (await get(port, "/health"))[0] == 200
        stalled.close()

        # a server on the same node with a short deadline, to see the drop itself
        server = MetricsServer(cloud.stats, read_timeout_s=0.2)
        await server.start()
        try:
            r1, w1 = await asyncio.open_connection("127.0.0.1", server.port)
            w1.write(b"GET /metrics HTTP/1.1\r\n")  # never finishes the head
            r2, w2 = await asyncio.open_connection("127.0.0.1", server.port)

            trickler = asyncio.get_running_loop().create_task(
                trickle_head(r2, w2, b"GET /metrics HTTP/1.1\r\n"))
            assert (await get(server.port, "/metrics"))[0] == 200
            for r in (r1, r2):  # each dropped, told why (408)
                got = await asyncio.wait_for(r.read(), HANG_S)
                assert got.startswith(b"HTTP/1.1 408 "), got
            await asyncio.wait_for(trickler, HANG_S)
            await until(lambda: server.connections == 0, "the server to let go of them")
            assert (await get(server.port, "/health"))[0] == 200
            for w in (w1, w2):
                w.close()
        finally:
            await server.close()


async def test_request_size_and_connection_count_are_capped() -> None:
    target, _ = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud:
        server = MetricsServer(cloud.stats, max_request_bytes=1024, max_connections=2,
                               read_timeout_s=HANG_S)
        await server.start()
        try:
            # a head that never ends: refused once the cap is read, not buffered on
            status, _, _ = await http(server.port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 2000)
            assert status == 400
            with contextlib.suppress(ConnectionError):
                await http(server.port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (1 << 20))
            assert (await get(server.port, "/metrics"))[0] == 200

            held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
            await until(lambda: server.connections == 2, "two held connections")
            # a third is answered 503 at once (no read deadline to wait out)
            status, _, _ = await get(server.port, "/metrics")
            assert status == 503
            await until(lambda: server.connections == 2, "the third one closed")
            for _, w in held:
                w.close()
            await until(lambda: server.connections == 0, "the held ones to be let go")
            assert (await get(server.port, "/metrics"))[0] == 200
        finally:
            await server.close()


async def test_a_failing_stats_call_is_a_500_not_a_dead_server() -> None:
    calls = 0

    def stats() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        return {"messages": 5}

    server = MetricsServer(stats)
    await server.start()
    try:
        assert (await get(server.port, "/metrics"))[0] == 500
        status, _, body = await get(server.port, "/metrics")
        assert status == 200
        assert sample_value(parse(body.decode()), "xcosd_messages_received_total", {}) == 5
    finally:
        await server.close()


async def test_health_answers_what_its_one_function_returns() -> None:
    # the hook a draining node plugs into: /health's status and body come from
    # one function, read at each request; /metrics is not its business
    state = {"draining": False, "broken": False}

    def health() -> tuple[int, dict[str, Any]]:
        if state["broken"]:
            raise RuntimeError("boom")
        return (503, {"status": "draining"}) if state["draining"] else (200, {"status": "ok"})

    server = MetricsServer(lambda: {"messages": 1}, health=health)
    await server.start()
    try:
        status, _, body = await get(server.port, "/health")
        assert status == 200 and json.loads(body) == {"status": "ok"}
        state["draining"] = True
        status, headers, body = await get(server.port, "/health")
        assert status == 503 and json.loads(body) == {"status": "draining"}
        assert headers["content-type"] == "application/json"
        status, _, body = await get(server.port, "/health", "HEAD")
        assert status == 503 and body == b""
        assert (await get(server.port, "/metrics"))[0] == 200
        # a failing health function is a 500, not a dead server
        state["broken"] = True
        assert (await get(server.port, "/health"))[0] == 500
        state["broken"] = False
        assert (await get(server.port, "/health"))[0] == 503
    finally:
        await server.close()


async def test_a_kept_alive_connection_is_served_again_and_dropped_once_idle() -> None:
    # HTTP/1.1 keeps a connection open after its answer (a scraper reuses it); an
    # idle one is still bounded: the next request head has a deadline too
    server = MetricsServer(lambda: {"messages": 3}, read_timeout_s=0.3)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        for _ in range(2):
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_S)
            assert head.startswith(b"HTTP/1.1 200 ")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            assert length is not None
            body = await asyncio.wait_for(reader.readexactly(int(length.group(1))), HANG_S)
            assert sample_value(parse(body.decode()), "xcosd_messages_received_total", {}) == 3
        assert server.connections == 1
        # then it sends nothing more: the server closes it
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(reader.read(), HANG_S) == b""
        await until(lambda: server.connections == 0, "the idle connection to be let go")
        writer.close()
    finally:
        await server.close()


async def test_the_served_exposition_escapes_whatever_a_label_or_help_holds() -> None:
    # no label of the node's can hold these (its values come from fixed sets); a
    # collector added to the server's registry later could, and the writer the
    # server answers with escapes them: they read back as they were, no line added
    nasty = 'a\\b"c\nd} 1\nxcosd_fake_metric{x="0"} 37\n'

    class Nasty:
        def collect(self) -> Iterator[Metric]:
            fam = CounterMetricFamily("xcosd_nasty", "two\nlines \\ and a \"quote\"",
                                      labels=["l"])
            fam.add_metric([nasty], 1)
            yield fam

    server = MetricsServer(lambda: {"messages": 2})
    server.registry.register(Nasty())
    await server.start()
    try:
        status, _, body = await get(server.port, "/metrics")
    finally:
        await server.close()
    assert status == 200
    text = body.decode()
    fams = parse(text)
    assert "xcosd_fake_metric" not in fams and set(fams) == FAMILIES | {"xcosd_nasty"}
    assert fams["xcosd_nasty"].documentation == "two\nlines \\ and a \"quote\""
    assert [s.labels["l"] for s in fams["xcosd_nasty"].samples] == [nasty]
    assert not any(line.startswith("xcosd_fake_metric") for line in text.splitlines())
    assert sample_value(fams, "xcosd_messages_received_total", {}) == 2


async def test_each_replica_of_serve_replicas_serves_its_own_metrics() -> None:
    """``xcosd serve --replicas 2 --metrics-port 0`` as a user runs it: each replica
    process serves its own /metrics and /health (a free port each), and a scraper
    summing the two sees both edges' work, label values bounded in each."""
    from xcosd.models import SyntheticModel, load_model

    from .helpers.processes import free_port
    from .test_replicas import serve_process

    spec = "synthetic:256"
    target = load_model(spec)
    draft = SyntheticModel(target.vocab, skew=0.9, name="draft")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    async with serve_process("--replicas", "2", "--target", spec, "--bind", endpoint,
                             "--metrics-port", "0") as lines:

        def urls() -> list[str]:
            return [m.group(1) for ln in lines if (m := re.search(r"metrics on (\S+)", ln))]

        await until(lambda: "replicas live: 2 (joined 2, lost 0)" in lines, "two replicas")
        await until(lambda: len(urls()) == 2, "both replicas' metrics endpoints")
        ports = {port_of(u) for u in urls()}
        assert len(ports) == 2
        edges = [xcosd.EdgeNode(draft=draft, connect=endpoint, temperature=0.0,
                                target_vocab=target.vocab, silence_timeout_s=HANG_S)
                 for _ in range(2)]
        for e in edges:
            await e.start()
        try:
            assert edges[0].server_id != edges[1].server_id  # one edge on each replica
            results = [await e.generate("ab", max_new_tokens=16) for e in edges]
        finally:
            for e in edges:
                await e.close()
        scrapes = []
        for port in ports:
            status, _, body = await get(port, "/metrics")
            assert status == 200
            text = body.decode()
            fams = parse(text)
            check_bounded(fams, text)
            scrapes.append(fams)
            status, _, body = await get(port, "/health")
            assert status == 200 and json.loads(body)["status"] == "ok"
    assert all(len(r.token_ids) == 16 for r in results)
    for fams in scrapes:  # each replica served one of the generations
        assert sample_value(fams, "xcosd_sessions_opened_total", {}) == 1
        assert sample_value(fams, "xcosd_spec_decode_num_rounds_total", {}) > 0
