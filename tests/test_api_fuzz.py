"""Fuzzing the OpenAI-compatible API's request handling with hypothesis, against the
real app: a real edge and cloud over ZeroMQ (the embedded n-gram pair, so chats are
rendered by a real template), served by uvicorn on loopback, driven by httpx.

Requests are drawn as a client might get them wrong: valid bodies with fields
dropped, retyped, nested or added; arbitrary JSON; JSON cut or with bytes flipped;
arbitrary bytes; wrong methods, paths and content types. Every answer must be a
well-formed error object with a status below 500, or a valid completion (a JSON
object or a stream of Server-Sent Events ending in ``[DONE]``), and after each
request nothing is left behind: no generation in flight, no arrival mark pending,
no cloud session open, no task more than before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xcosd.api import RequestLimits
from xcosd.models import default_pair

from .helpers.waits import HANG_S, until
from .test_api import Served, served


class _Live:
    """The served stack on an event loop of its own thread, so that hypothesis's
    synchronous examples can each send a request to the one server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._stack = contextlib.AsyncExitStack()
        draft, target = default_pair()

        async def start() -> tuple[Served, httpx.AsyncClient, int]:
            s = await self._stack.enter_async_context(served(
                (target, draft), limits=RequestLimits(max_tokens=12, default_max_tokens=4)))
            c = await self._stack.enter_async_context(
                httpx.AsyncClient(base_url=s.http.url, timeout=HANG_S))
            return s, c, len(asyncio.all_tasks())

        self.s, self.client, self.tasks = self.run(start())
        #: (status, method, path, content type) of every answer
        self.seen: list[tuple[int, str, str, str]] = []

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(2 * HANG_S)

    def close(self) -> None:
        self.run(self._stack.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(HANG_S)
        self.loop.close()


@pytest.fixture(scope="module")
def live() -> Iterator[_Live]:
    lv = _Live()
    try:
        yield lv
    finally:
        lv.close()
    # the examples reached every kind of answer: whole completions, streams, refusals
    kinds = {(status, ctype.split(";")[0]) for status, _, _, ctype in lv.seen}
    assert {(200, "application/json"), (200, "text/event-stream"),
            (400, "application/json")} <= kinds, kinds


# ------------------------------------------------------------------ strategies

#: text as hypothesis draws it, and strings it leaves out (lone surrogates) or rarely
#: draws (NUL, astral characters, a line break)
_text = st.text(max_size=12) | st.sampled_from(["\ud800", "a\udfff", "\U0001f600", "\x00",
                                                 "\u00e9\n", "\ufeff"])
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False,
                                                                         allow_infinity=False)
    | _text,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4),
    max_leaves=12)

_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "logprobs",
           "ignore_eos", "xcosd", "echo", "user", "tools", "response_format", "logit_bias"]

_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(-2, 20) | _json,
    "max_completion_tokens": st.integers(-2, 20) | _json,
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2, 2.5, -1]) | _json,
    "top_p": st.sampled_from([0.5, 1, 0, 1.5]) | _json,
    "top_k": st.integers(-3, 5) | _json,
    "seed": st.integers(-2**64, 2**65) | _json,
    "stop": st.sampled_from(["a", ["b", "c"], [""], [], ["\n"]]) | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.sampled_from([{"include_usage": True}, {"include_usage": False},
                                       {"x": 1}]) | _json,
    "ignore_eos": st.booleans() | _json,
    "xcosd": st.sampled_from([{"method": "ar"}, {"method": "xcosd-e", "draft_len": 3},
                              {"codec": "f32"}, {"codec": "nope"}, {"draft_len": 99}]) | _json,
    "prompt": _text | st.lists(st.integers(-1, 300), max_size=6) | _json,
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _json,
         "content": _text | _json}), max_size=3) | _json,
}


@st.composite
def _body(draw: st.DrawFn, model: str, chat: bool) -> bytes:
    kind = ["mutated", "json", "bytes", "broken"][draw(st.integers(0, 9)) % 4 if draw(
        st.booleans()) else 0]
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "json":
        return json.dumps(draw(_json)).encode()
    body: dict[str, Any] = {"model": model, "max_tokens": 3, "stream": draw(st.booleans())}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(_text)}]
    else:
        body["prompt"] = draw(_text)
    for _ in range(max(0, draw(st.integers(-2, 3)))):
        key = draw(st.sampled_from(_FIELDS) | st.text(max_size=6))
        if draw(st.booleans()) and key in body:
            del body[key]
        else:
            body[key] = draw(_VALUES.get(key, _json))
    raw = json.dumps(body).encode()
    if kind == "broken":
        cut = draw(st.integers(0, len(raw)))
        raw = bytearray(raw[:cut] if draw(st.booleans()) else raw)
        for _ in range(max(0, draw(st.integers(-2, 3)))):
            if raw:
                i = draw(st.integers(0, len(raw) - 1))
                raw[i] = draw(st.integers(0, 255))
        raw = bytes(raw)
    return raw


_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/other",
          "/health", "/metrics", "/v1/completions/", "/v1", "/"]
_CTYPES = ["application/json", "application/json; charset=utf-8", "text/plain", "",
           "multipart/form-data; boundary=x", "application/x-www-form-urlencoded"]


@st.composite
def _request(draw: st.DrawFn, model: str) -> tuple[str, str, dict[str, str], bytes]:
    # mostly what an API client sends (a POST of JSON to an endpoint), else anything
    if draw(st.integers(0, 3)):
        method, path = "POST", draw(st.sampled_from(_PATHS[:2]))
    else:
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "HEAD", "OPTIONS", "POST"]))
        path = draw(st.sampled_from(_PATHS))
    body = draw(_body(model, chat=path == "/v1/chat/completions"))
    headers = {"content-type": draw(st.sampled_from(_CTYPES)) if not draw(st.integers(0, 4))
               else "application/json"}
    if draw(st.booleans()):
        headers[draw(st.sampled_from(["accept", "x-anything", "authorization",
                                      "content-encoding"]))] = draw(
            st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=16))
    return method, path, headers, body


# ------------------------------------------------------------------- checking


def _check_error(status: int, data: Any) -> None:
    assert isinstance(data, dict) and set(data) == {"error"}, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)


def _check_stream(text: str, chat: bool) -> None:
    events = [ln[len("data: "):] for ln in text.split("\n") if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    for e in events[:-1]:
        data = json.loads(e)
        if "error" in data:  # a failure after the stream began: never the client's input
            _check_error(200, data)
            assert data["error"]["type"] != "internal_error", data
            continue
        assert data["object"] == ("chat.completion.chunk" if chat else "text_completion")


async def _send(lv: _Live, method: str, path: str, headers: dict[str, str],
                body: bytes) -> None:
    r = await lv.client.request(method, path, headers=headers,
                                content=body if method not in ("GET", "HEAD") else None)
    lv.seen.append((r.status_code, method, path, r.headers.get("content-type", "")))
    assert r.status_code < 500, (r.status_code, r.text[:400])
    assert r.headers.get("x-request-id", "").startswith("req_")
    if method == "HEAD":
        return
    if r.status_code >= 400:
        _check_error(r.status_code, r.json())
    elif path in ("/v1/completions", "/v1/chat/completions"):
        chat = path.endswith("chat/completions")
        if r.headers["content-type"].startswith("text/event-stream"):
            _check_stream(r.text, chat)
        else:
            data = r.json()
            assert data["object"] == ("chat.completion" if chat else "text_completion")
            assert data["choices"][0]["finish_reason"] in ("stop", "length")
            assert 1 <= data["usage"]["completion_tokens"] <= 12
    s = lv.s
    await until(lambda: s.api.in_flight == 0, "no generation in flight")
    assert s.edge.arrivals.pending == 0
    await until(lambda: s.cloud.stats()["sessions_active"] == 0, "every cloud session closed")
    await until(lambda: len(asyncio.all_tasks()) <= lv.tasks, "no task left behind")


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_every_answer_is_an_error_object_or_a_completion_and_nothing_is_left(
        live: _Live, data: st.DataObject) -> None:
    method, path, headers, body = data.draw(_request(live.s.model))
    live.run(_send(live, method, path, headers, body))
