"""An edge's hold on its cloud (``xcosd/nodes/reach.py``), sans-I/O: the phases and
only the moves their table lists, the deadline of a stretch of connecting (none
by default for a server), the jittered backoff between passes, and what /health
says. Then the same through an edge in this process with no cloud yet: the API
answers while it looks, and learns the model's id from the first handshake."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import openai
import pytest

import xcosd
from xcosd.api import OpenAIApp
from xcosd.http import HttpServer
from xcosd.models import default_pair
from xcosd.nodes.reach import REACH_TRANSITIONS, Reach, ReachPhase, ReachStep
from xcosd.transport.addresses import Backoff

from .helpers.processes import free_port
from .helpers.waits import until
from .session_pairs import pair
from .test_api import HeldAfterFirstCall, metric, served


def test_a_stretch_without_a_deadline_never_gives_up() -> None:
    r = Reach(100.0, connect_timeout_s=None, backoff=Backoff(0.05, 1.0, random.Random(1)))
    assert r.phase is ReachPhase.CONNECTING and r.left_s(1e9) is None
    pauses = []
    for k in range(40):
        r.attempt_failed("Connection refused")
        pause = r.pause(100.0 + 10.0 * k)
        assert pause is not None
        pauses.append(pause)
    # doubling from 50 ms, capped at 1 s, each drawn from [d/2, d]
    assert 0.025 <= pauses[0] <= 0.05 and all(0.5 <= p <= 1.0 for p in pauses[6:])
    assert r.phase is ReachPhase.CONNECTING and r.failed_attempts == 40
    assert r.attempt_s(1e9, 15.0) == 15.0  # each attempt its own bound, not cut
    r.connected_now(600.0)
    assert r.connected and r.error is None and r.connects == 1 and r.reconnects == 0
    assert r.health(700.0) == {"state": "connected", "connected": True, "reconnects": 0}


def test_a_deadline_ends_a_stretch_unreachable_and_a_retry_starts_a_fresh_one() -> None:
    r = Reach(0.0, connect_timeout_s=2.0, backoff=Backoff(0.05, 1.0, random.Random(2)))
    r.begin(10.0)  # the node started later than it was made: the clock starts now
    assert r.left_s(10.5) == 1.5
    assert r.attempt_s(11.9, 15.0) == pytest.approx(0.1)  # cut to what is left
    assert r.attempt_s(12.5, 15.0) == 0.05  # never under 50 ms
    r.attempt_failed("no answer within 1 s")
    assert r.pause(11.0) is not None
    assert r.pause(11.99) is None  # the pause would end past the deadline
    assert r.phase is ReachPhase.UNREACHABLE and r.gave_up == 1
    assert r.health(13.0) == {"state": "unreachable", "connected": False, "reconnects": 0,
                              "waiting_s": 1.01, "error": "no answer within 1 s"}
    r.retry(20.0)
    assert r.phase is ReachPhase.CONNECTING and r.left_s(20.0) == 2.0
    r.connected_now(21.0)
    r.lost(30.0, "the cloud was silent for 15 s")
    assert r.phase is ReachPhase.CONNECTING and r.losses == 1 and r.left_s(30.0) == 2.0
    assert r.health(31.0)["waiting_s"] == 1.0
    r.connected_now(32.0)
    assert (r.connects, r.reconnects, r.waited_s(40.0)) == (2, 1, 0.0)


def test_an_answer_retrying_cannot_change_gives_up_at_once() -> None:
    r = Reach(0.0, connect_timeout_s=None)
    r.give_up(1.0, "the cloud speaks protocol 9, this edge 1")
    assert r.phase is ReachPhase.UNREACHABLE and r.error.startswith("the cloud speaks")


def _move(r: Reach, step: ReachStep) -> None:
    {ReachStep.CONNECTED: lambda: r.connected_now(1.0),
     ReachStep.LOST: lambda: r.lost(1.0, "x"),
     ReachStep.GAVE_UP: lambda: r.give_up(1.0, "x"),
     ReachStep.RETRY: lambda: r.retry(1.0),
     ReachStep.CLOSE: lambda: r.close(1.0)}[step]()


def test_only_the_listed_moves_are_allowed() -> None:
    for phase in ReachPhase:
        for step in ReachStep:
            r = Reach(0.0, None)
            r.phase = phase
            if (phase, step) in REACH_TRANSITIONS:
                _move(r, step)
                assert r.phase is REACH_TRANSITIONS[(phase, step)]
            else:
                with pytest.raises(ValueError, match="not allowed"):
                    _move(r, step)
                assert r.phase is phase
    with pytest.raises(ValueError):
        Reach(0.0, connect_timeout_s=0)


async def test_the_api_answers_while_its_edge_looks_for_the_cloud() -> None:
    """No cloud yet: /health is 503 ``connecting``; /v1/models and a completion wait
    their bound (the model's id comes from the cloud's welcome) and get 503 with
    an error object; once a cloud binds the address, the same requests succeed
    and the edge's own waits are counted."""
    draft, target = default_pair()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    edge = xcosd.EdgeNode(draft=draft, connect=endpoint, connect_timeout_s=None,
                          cloud_wait_s=0.2)
    await edge.start(wait=False)
    try:
        async with HttpServer(OpenAIApp(edge)) as http, httpx.AsyncClient(
                base_url=http.url, timeout=30) as c:
            h = await c.get("/health")
            assert h.status_code == 503
            body: dict[str, Any] = h.json()
            assert body["status"] == "connecting" and body["connected"] is False
            assert body["waiting_s"] >= 0 and body["cloud"] == endpoint
            for r in (await c.get("/v1/models"),
                      await c.post("/v1/completions", json={"model": "llama3", "prompt": "a"})):
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "unreachable"
            assert edge.waits_expired == 2
            async with xcosd.CloudNode(target=target, bind=endpoint):
                await until(lambda: edge.connected, "the edge to find its cloud")
                assert (await c.get("/health")).status_code == 200
                models = (await c.get("/v1/models")).json()
                assert [m["id"] for m in models["data"]] == [target.vocab.name]
                r = await c.post("/v1/completions", json={"model": target.vocab.name,
                                                          "prompt": "a", "max_tokens": 4,
                                                          "ignore_eos": True})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            assert edge.reach.connects == 1
    finally:
        await edge.close()
    assert edge.reach.phase is ReachPhase.CLOSED


async def test_generations_in_flight_end_with_an_error_object_when_their_cloud_stays_away(
        ) -> None:
    """The cloud goes and does not come back within ``cloud_wait_s``: a stream
    already answering ends with an error event, a whole request with 503, each an
    OpenAI error object, and the edge counts them as errors and its wait as
    expired; /health says why."""
    target, draft = pair()
    gated = HeldAfterFirstCall(target)
    async with served((gated, draft), edge_kw={"silence_timeout_s": 0.3, "heartbeat_s": 0.05,
                                               "cloud_wait_s": 0.3}) as s:
        run_on = {"ignore_eos": True}  # neither may end before its cloud goes
        stream = await s.client.completions.create(model=s.model, prompt="c", max_tokens=4000,
                                                   stream=True, extra_body=run_on)
        it = stream.__aiter__()
        await it.__anext__()  # round 0's text streamed; round 1 waits inside the target
        whole = asyncio.ensure_future(s.client.completions.create(
            model=s.model, prompt=[0, 1], max_tokens=4000, extra_body=run_on))
        await until(lambda: s.api.in_flight == 2, "both requests in flight")
        closing = asyncio.ensure_future(s.cloud.close())  # gone, for good
        gated.gate.set()
        with pytest.raises(openai.APIError, match="not connected"):
            async for _chunk in it:
                pass
        with pytest.raises(openai.APIStatusError) as e:
            await whole
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "unreachable"  # type: ignore[index]
        await closing
        await until(lambda: s.api.in_flight == 0, "both requests ended")
        scrape = (await s.raw("GET", "/metrics")).text
        assert metric(scrape, "xcosd_edge_generations_total", finish_reason="error") == 2
        assert metric(scrape, "xcosd_edge_cloud_waits_expired_total") == 2
        assert metric(scrape, "xcosd_edge_cloud_losses_total") == 1
        h = await s.raw("GET", "/health")
        assert h.status_code == 503 and h.json()["status"] == "connecting"
        assert h.json()["error"]  # why: the loss, then the last attempt's reason
