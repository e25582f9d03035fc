"""The OpenAI-compatible API against careless and hostile clients, with a real edge
and cloud over ZeroMQ and real sockets on loopback.

What it holds: every malformed body (nesting 100,000 deep, text that is not
Unicode, a wrong type at any level, absurd sizes and values) is a 4xx error object,
never a 500; a body over the limit gets its 413 error object before the connection
closes; a client that stops reading its stream is dropped and its generation ends,
freeing its cloud session; and 2,000 stalled heads from one address, opened by
another process, leave a client from another address served within 5x its unloaded
time + 2 s, the edge's memory growing by less than 50 MiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from xcosd.api import RequestLimits
from xcosd.http import ConnectionLimits
from xcosd.models.base import ModelWrapper

from .helpers.waits import HANG_S, until
from .session_pairs import pair
from .test_api import Served, metric, served

ROOT = Path(__file__).resolve().parents[1]


def _deep(levels: int) -> bytes:
    return b'{"model": ' + b"[" * levels + b"]" * levels + b', "prompt": "c"}'


#: raw bodies, each with what is wrong in it
MALFORMED: list[tuple[str, bytes]] = [
    ("nested 100,000 deep", _deep(100_000)),
    ("nested 900 deep", _deep(900)),
    ("nested 33 deep", _deep(33)),
    ("a lone surrogate in the prompt", b'{"model": "M", "prompt": "a\\ud800b"}'),
    ("a lone low surrogate in a key", b'{"model": "M", "prompt": "c", "\\udc00": 1}'),
    ("a lone surrogate in a stop string", b'{"model": "M", "prompt": "c", "stop": ["\\ud83d"]}'),
    ("invalid UTF-8", b'{"model": "M", "prompt": "\xff\xfe"}'),
    ("UTF-16", '{"model": "M", "prompt": "c"}'.encode("utf-16")),
    ("NaN top_p", b'{"model": "M", "prompt": "c", "top_p": NaN}'),
    ("Infinity temperature", b'{"model": "M", "prompt": "c", "temperature": Infinity}'),
    ("an integer of 5,000 digits", b'{"model": "M", "prompt": "c", "seed": ' + b"9" * 5000 + b"}"),
    ("truncated", b'{"model": "M", "prompt": "c'),
    ("empty", b""),
    ("a bare string", b'"hello"'),
    ("null", b"null"),
]

#: bodies that are JSON but wrong, for either endpoint ("M": the served model)
WRONG: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"model": "M", "prompt": "c", "max_tokens": 10**12}),
    ("/v1/completions", {"model": "M", "prompt": "c", "n": 1000}),
    ("/v1/completions", {"model": "M", "prompt": "c", "stop": ["s"] * 10_000}),
    ("/v1/completions", {"model": "M", "prompt": "c", "seed": 2**70}),
    ("/v1/completions", {"model": "M", "prompt": "c", "temperature": 1e308}),
    ("/v1/completions", {"model": "M", "prompt": "c", "logprobs": 5}),
    ("/v1/completions", {"model": "gpt-nothing", "prompt": "c"}),
    ("/v1/completions", {"model": ["M"], "prompt": "c"}),
    ("/v1/completions", {"model": "M", "prompt": [[1.5]]}),
    ("/v1/completions", {"model": "M", "prompt": [[["a"]]]}),
    ("/v1/completions", {"model": "M", "prompt": [10**30]}),
    ("/v1/completions", {"model": "M", "prompt": "c", "stream_options": []}),
    ("/v1/completions", {"model": "M", "prompt": "c", "stream": True,
                         "stream_options": {"include_usage": "yes"}}),
    ("/v1/completions", {"model": "M", "prompt": "c", "xcosd": []}),
    ("/v1/completions", {"model": "M", "prompt": "c", "xcosd": {"method": 3}}),
    ("/v1/completions", {"model": "M", "prompt": "c", "xcosd": {"codec": "no-such"}}),
    ("/v1/completions", {"model": "M", "prompt": "c", "xcosd": {"draft_len": True}}),
    ("/v1/completions", {"model": "M", "prompt": "c", "xcosd": {"tree": "3by2"}}),
    ("/v1/completions", {"model": "M", "prompt": "c", "xcosd": {"tree": 32}}),
    ("/v1/completions", {"model": "M", "prompt": "c", "logit_bias": [1]}),
    ("/v1/completions", {"model": "M", "prompt": "c", "ignore_eos": 1}),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": ["user"], "content": "x"}]}),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": {"a": 1}, "content": "x"}]}),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user",
                                                          "content": [{"type": "text",
                                                                       "text": {"a": 1}}]}]}),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user",
                                                          "content": [["text"]]}]}),
    ("/v1/chat/completions", {"model": "M", "messages": [[{"role": "user"}]]}),
    ("/v1/chat/completions", {"model": "M", "messages": {"role": "user"}}),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": {"type": "function"}}),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "modalities": [["text"]], "response_format": []}),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": [0]}),
]


def check_error(r: httpx.Response) -> dict[str, Any]:
    """``r`` is a well-formed error object with a client-error status."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    assert r.headers["x-request-id"].startswith("req_")
    return dict(err)


async def _no_leftovers(s: Served) -> None:
    await until(lambda: s.api.in_flight == 0, "no generation in flight")
    assert s.edge.arrivals.pending == 0
    await until(lambda: s.cloud.stats()["sessions_active"] == 0, "every cloud session closed")


async def test_no_malformed_body_gets_a_500() -> None:
    async with served() as s:
        statuses = []
        for what, raw in MALFORMED:
            raw = raw.replace(b'"M"', json.dumps(s.model).encode())
            r = await s.raw("POST", "/v1/completions", content=raw,
                            headers={"content-type": "application/json"})
            err = check_error(r)
            statuses.append(r.status_code)
            assert r.status_code == 400 and err["code"] in ("invalid_json", "invalid_value",
                                                            "invalid_type"), (what, err)
        for path, body in WRONG:
            body = {k: (s.model if v == "M" else v) for k, v in body.items()}
            r = await s.raw("POST", path, json=body)
            check_error(r)
            statuses.append(r.status_code)
        assert 500 not in statuses
        # the nesting names where it is, a surrogate where it was found
        r = await s.raw("POST", "/v1/completions", content=_deep(40),
                        headers={"content-type": "application/json"})
        assert r.json()["error"]["param"] == "model"
        r = await s.raw("POST", "/v1/completions",
                        content=b'{"model": "x", "prompt": "\\ud800"}')
        assert r.json()["error"]["param"] == "prompt" and "surrogate" in r.text
        # and the server still serves, with nothing left behind
        ok = await s.client.completions.create(model=s.model, prompt="c", max_tokens=3)
        assert ok.usage.completion_tokens == 3
        await _no_leftovers(s)


async def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` whole, then read the answer until the server closes."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        await w.drain()
        return await asyncio.wait_for(r.read(), HANG_S)
    finally:
        w.close()


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_over_the_limit_gets_its_413_before_the_connection_closes(
        chunked: bool) -> None:
    async with served(max_body_bytes=4096) as s:
        body = b'{"prompt": "' + b"x" * 200_000 + b'"}'
        if chunked:
            framing = b"Transfer-Encoding: chunked\r\n\r\n"
            payload = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in
                               (body[i:i + 8192] for i in range(0, len(body), 8192)))
            payload += b"0\r\n\r\n"
        else:
            framing = b"Content-Length: %d\r\n\r\n" % len(body)
            payload = body
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\n" + framing)
        got = await _exchange(s.http.port, head + payload)
        status_line, _, rest = got.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 413 "), got[:200]
        err = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
        await _no_leftovers(s)


@pytest.mark.slow  # the stream must outgrow the socket buffers: about 5 s of generation
async def test_a_client_that_stops_reading_its_stream_is_dropped_and_frees_its_session() -> None:
    limits = ConnectionLimits(write_buffer_bytes=8 << 10, write_timeout_s=0.3)
    async with served(http_limits=limits, limits=RequestLimits(max_tokens=1 << 15)) as s:
        body = json.dumps({"model": s.model, "prompt": "c", "max_tokens": 1 << 15, "stream": True,
                           "ignore_eos": True}).encode()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", s.http.port))
        try:  # asks for a long stream, and never reads it
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await until(lambda: s.api.in_flight == 1, "the stream under way")
            await until(lambda: s.http.slots.total == 0, "the reader dropped")
            await _no_leftovers(s)
        finally:
            sock.close()
        t = (await s.raw("GET", "/metrics")).text
        # ended once: cut short, or run out before the client was dropped (never an error)
        assert sum(metric(t, "xcosd_edge_generations_total", finish_reason=r)
                   for r in ("abort", "length")) == 1
        assert metric(t, "xcosd_edge_generations_total", finish_reason="error") == 0
        # and others are served as before
        ok = await s.client.completions.create(model=s.model, prompt="c", max_tokens=3)
        assert ok.usage.completion_tokens == 3


class _BrokenDraft(ModelWrapper):
    """A draft with a bug: its every session fails to start."""

    def start(self, prompt_ids: Any) -> Any:
        raise ZeroDivisionError("a bug in the draft")


async def test_an_internal_error_is_a_500_error_object_logged_with_its_request_id(
        caplog: pytest.LogCaptureFixture) -> None:
    target, draft = pair()
    async with served((target, _BrokenDraft(draft))) as s:
        for stream in (False, True):
            r = await s.raw("POST", "/v1/completions", json={
                "model": s.model, "prompt": "c", "max_tokens": 3, "stream": stream})
            rid = r.headers["x-request-id"]
            if stream:  # the stream had begun: its error is an event
                assert r.status_code == 200
                err = json.loads(r.text.split("data: ")[1])["error"]
            else:
                assert r.status_code == 500
                err = r.json()["error"]
            assert err["type"] == "internal_error" and err["code"] == "internal"
            assert rid in err["message"] and "ZeroDivisionError" in err["message"]
            logged = [rec for rec in caplog.records if rid in rec.getMessage()]
            assert logged and logged[0].exc_info is not None
            assert logged[0].exc_info[0] is ZeroDivisionError
        await _no_leftovers(s)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


STALLED = 2000


async def _healthy(s: Served) -> float:
    """One completion from 127.0.0.2: its seconds."""
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    async with httpx.AsyncClient(transport=transport, timeout=HANG_S) as c:
        t0 = time.perf_counter()
        r = await c.post(s.http.url + "/v1/completions",
                         json={"model": s.model, "prompt": "c", "max_tokens": 8, "seed": 1})
        took = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    return took


@pytest.mark.slow
async def test_2000_stalled_heads_from_one_address_leave_another_address_served() -> None:
    # the defaults of `xcosd edge serve` (xcosd/commands/http_limits.py) at --max-in-flight 64
    limits = ConnectionLimits(max_connections=4 * 64 + 16, max_per_address=64)
    async with served(http_limits=limits) as s:
        for _ in range(3):  # warm
            await _healthy(s)
        unloaded = statistics.median([await _healthy(s) for _ in range(5)])
        rss0 = _rss_mib()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.helpers.stall_heads", str(s.http.port), str(STALLED),
            "127.0.0.1", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            cwd=str(ROOT), env=env)
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), HANG_S)).decode()
            assert line.split()[:1] == ["stalled"], line
            opened = int(line.split()[1])
            assert opened == STALLED
            # its address holds its share, the rest was refused as it came
            await until(lambda: s.http.slots.refused >= STALLED - limits.max_per_address,
                        "the connections over the cap refused")
            assert s.http.slots.held.get("127.0.0.1") == limits.max_per_address
            loaded = await _healthy(s)
            assert loaded <= 5 * unloaded + 2.0, (loaded, unloaded)
            grown = _rss_mib() - rss0
            assert grown < 50, f"the edge's RSS grew by {grown:.1f} MiB"
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            with contextlib.suppress(ProcessLookupError):
                await asyncio.wait_for(proc.wait(), HANG_S)
        await until(lambda: s.http.slots.total == 0, "every stalled connection let go")
        await _no_leftovers(s)
