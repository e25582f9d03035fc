"""``xcosd edge serve`` outlives its cloud's absences, run as a user runs it: the
edge server and the cloud are ``python -m xcosd`` processes on loopback (the
embedded default pair), driven by the official ``openai`` client and httpx.

An edge server started before its cloud listens at once and says 503
``connecting`` on /health; a request sent meanwhile is held until the cloud is up
and its text is then the edge's own ``generate``'s for its seed, while one whose
wait bound is shorter than the cloud's delay gets 503 with an OpenAI error object
and ``Retry-After``. A cloud killed and started again under a serving edge turns
/health 503, then 200, and every request completes exact. Deadlines stay where
they are asked for: a server given ``--connect-timeout`` gives up past it, and the
one-shot ``xcosd edge PROMPT`` ends within ``--timeout`` / ``--connect-timeout``
when its cloud goes silent or is not there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import xcosd
from xcosd.api import OpenAIApp
from xcosd.http import HttpServer
from xcosd.models import default_pair

from .helpers.processes import free_port, xcosd_process
from .helpers.waits import HANG_S, until

PROMPT = "The default value of the"
TOKENS = 16


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    """The embedded pair (draft, target): what ``xcosd edge`` and ``xcosd serve``
    load by default."""
    return default_pair()


async def health(url: str) -> tuple[int, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=HANG_S) as c:
        r = await c.get(url + "/health")
        return r.status_code, r.json()


async def scrape(url: str, name: str, **labels: str) -> float:
    async with httpx.AsyncClient(timeout=HANG_S) as c:
        text = (await c.get(url + "/metrics")).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(f"{name} {labels} not in the scrape")


async def until_health(url: str, status: int) -> dict[str, Any]:
    """/health's body once it answers ``status`` (a server not listening yet is
    waited for too)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_S
    while True:
        with contextlib.suppress(httpx.TransportError):
            code, body = await health(url)
            if code == status:
                return body
        if loop.time() > deadline:
            raise AssertionError(f"/health never answered {status}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def edge_server(cloud: str, *flags: str, rc: int | None = 0) -> AsyncIterator[Any]:
    """``xcosd edge serve`` on a free port; yields (its URL, the running process)."""
    port = free_port()
    async with xcosd_process("edge", "serve", "--connect", cloud, "--http",
                             f"127.0.0.1:{port}", *flags, rc=rc) as proc:
        yield f"http://127.0.0.1:{port}", proc


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                              timeout=HANG_S)


async def reference(draft: Any, cloud: str, seeds: list[int], **kw: Any) -> dict[int, str]:
    """Each seed's text from ``EdgeNode.generate``, in process, on the same cloud."""
    async with xcosd.EdgeNode(draft=draft, connect=cloud) as edge:
        return {s: (await edge.generate(PROMPT, max_new_tokens=TOKENS, seed=s, **kw)).text
                for s in seeds}


async def streamed(c: openai.AsyncOpenAI, model: str, seed: int, **kw: Any) -> str:
    stream = await c.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS,
                                        seed=seed, stream=True, **kw)
    return "".join([ch.choices[0].text async for ch in stream if ch.choices])


async def whole(c: openai.AsyncOpenAI, model: str, seed: int) -> str:
    r = await c.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, seed=seed)
    return r.choices[0].text


# --------------------------------------------------------- started before its cloud


@pytest.mark.parametrize("late", [
    pytest.param("5 s", marks=pytest.mark.slow),
    "40 s, modeled",
])
async def test_an_edge_server_started_before_its_cloud_waits_for_it(
        late: str, models: tuple[Any, Any]) -> None:
    """The cloud comes 5 s after the edge server, as it does when it loads a model
    that is cached; or "40 s" after, as the real pair's first load (converting its
    GGUF) took, past the 30 s a one-shot edge allows. That second case is modeled
    rather than waited for: what 40 s means to the edge is that several handshake
    attempts end unanswered (at the defaults, one per ``--timeout``, 15 s) with
    backoff pauses between, past any deadline it used to have. With ``--timeout
    0.5`` the edge goes through the same steps in about 2 s, and the cloud is
    started only once four attempts have failed while the requests wait (its
    ``xcosd_edge_cloud_connect_failures_total``). The cloud's ``--heartbeat 0.1``
    keeps that short timeout from taking a live connection for a lost one."""
    draft, target = models
    model = target.vocab.name  # the id the server takes from the cloud's welcome
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    modeled = late != "5 s"
    async with contextlib.AsyncExitStack() as stack:
        url, proc = await stack.enter_async_context(edge_server(
            endpoint, "--cloud-wait", str(HANG_S), *(["--timeout", "0.5"] if modeled else [])))
        body = await until_health(url, 503)
        assert body["status"] == "connecting" and body["connected"] is False
        # a second edge whose requests wait for the cloud at most 0.5 s: shorter than
        # its delay (the cloud is started only after this request's answer)
        short = await stack.enter_async_context(_in_process_server(draft, endpoint, 0.5))
        async with httpx.AsyncClient(timeout=HANG_S) as c:
            r = await c.post(short + "/v1/completions",
                             json={"model": model, "prompt": PROMPT, "max_tokens": TOKENS})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "service_unavailable_error" and err["code"] == "unreachable"
        assert "not connected" in err["message"]
        # requests sent while the edge server looks for its cloud: held, not refused
        c = client(url)
        stack.push_async_callback(c.close)
        held = []
        for send in (whole, streamed):  # one at a time: each is a request alone
            held.append(asyncio.ensure_future(send(c, model, 7 + len(held))))
            await until_scraped(url, "xcosd_edge_num_requests_running", len(held))
        if modeled:  # four more attempts fail while they wait: over 2 s (4 x --timeout)
            failed = await scrape(url, "xcosd_edge_cloud_connect_failures_total")
            await until_scraped(url, "xcosd_edge_cloud_connect_failures_total", failed + 4)
        else:
            await asyncio.sleep(5)  # the case as it happens: the cloud starts 5 s later
        code, body = await health(url)
        assert code == 503 and body["status"] == "connecting"
        assert not any(t.done() for t in held)
        flags = ["--heartbeat", "0.1"] if modeled else []
        await stack.enter_async_context(xcosd_process("serve", "--bind", endpoint, *flags))
        texts = await asyncio.wait_for(asyncio.gather(*held), HANG_S)
        body = await until_health(url, 200)
        assert body["status"] == "ok" and body["connected"] is True
        assert texts == list((await reference(draft, endpoint, [7, 8])).values())
        assert await scrape(url, "xcosd_edge_cloud_state", state="connected") == 1
        assert await scrape(url, "xcosd_edge_cloud_waits_expired_total") == 0
        assert any("connected to the cloud" in ln for ln in proc.lines)


async def until_scraped(url: str, name: str, at_least: float) -> None:
    """Return once the metric ``name`` on ``url`` is at least ``at_least``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_S
    while (value := await scrape(url, name)) < at_least:
        if loop.time() > deadline:
            raise AssertionError(f"{name} stayed at {value} < {at_least}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _in_process_server(draft: Any, cloud: str, wait_s: float) -> AsyncIterator[str]:
    """An edge server in this process (what ``xcosd edge serve`` runs), whose
    requests wait for the cloud at most ``wait_s``; yields its URL."""
    edge = xcosd.EdgeNode(draft=draft, connect=cloud, connect_timeout_s=None,
                          cloud_wait_s=wait_s)
    await edge.start(wait=False)
    try:
        async with HttpServer(OpenAIApp(edge)) as http:
            yield http.url
    finally:
        await edge.close()


# ------------------------------------------------------------ a cloud lost later


@pytest.mark.slow
async def test_a_cloud_killed_and_restarted_under_an_edge_server(
        models: tuple[Any, Any]) -> None:
    """The cloud process is killed (SIGKILL: no goodbye) while streams run through
    the edge server, and started again on the same address while more requests
    wait for it. /health turns 503, then 200; every request completes, exact.

    The streams cut by the kill are greedy: a resumed generation draws its rest
    with a fresh seed (docs/PROTOCOL.md, "Faults"), so only greedy output is one
    fixed text whatever the point it resumed from; the requests sent while the
    cloud is away are seeded and must equal ``generate``'s text for their seed."""
    draft, target = models
    model = target.vocab.name
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    long = 400
    async with contextlib.AsyncExitStack() as stack:
        cloud = await stack.enter_async_context(xcosd_process(
            "serve", "--bind", endpoint, "--heartbeat", "0.1", rc=None))
        url, proc = await stack.enter_async_context(edge_server(
            endpoint, "--cloud-wait", str(HANG_S), "--timeout", "0.5"))
        await until_health(url, 200)
        async with xcosd.EdgeNode(draft=draft, connect=endpoint) as edge:
            want_greedy = (await edge.generate(PROMPT, max_new_tokens=long, temperature=0,
                                               ignore_eos=True)).text
        c = client(url)
        stack.push_async_callback(c.close)
        progress = [0, 0, 0]

        async def cut(i: int) -> tuple[str, int]:
            stream = await c.completions.create(model=model, prompt=PROMPT, max_tokens=long,
                                                stream=True, **greedy)  # type: ignore[arg-type]
            text, resumes = "", 0
            async for ch in stream:
                if ch.choices:
                    text += ch.choices[0].text
                    progress[i] += 1
                if ch.model_extra and "xcosd" in ch.model_extra:
                    resumes = ch.model_extra["xcosd"]["resumes"]
            return text, resumes

        running = [asyncio.ensure_future(cut(i)) for i in range(3)]
        await until(lambda: min(progress) > 0, "every stream under way")
        cloud.proc.send_signal(signal.SIGKILL)
        await cloud.exited()
        body = await until_health(url, 503)
        assert body["status"] == "connecting" and body["connected"] is False
        waiting = []
        for seed in (21, 22):  # one at a time: each is a request alone, tokenised at once
            waiting.append(asyncio.ensure_future(whole(c, model, seed)))
            await until_scraped(url, "xcosd_edge_num_requests_running", 3 + len(waiting))
        # four attempts fail while they wait: over 2 s, past the deadline of an answer
        # from a cloud that is there (4 x --timeout), which must not bound this wait
        failed = await scrape(url, "xcosd_edge_cloud_connect_failures_total")
        await until_scraped(url, "xcosd_edge_cloud_connect_failures_total", failed + 4)
        await stack.enter_async_context(xcosd_process("serve", "--bind", endpoint,
                                                      "--heartbeat", "0.1"))
        cut_results = await asyncio.wait_for(asyncio.gather(*running), HANG_S)
        texts = await asyncio.wait_for(asyncio.gather(*waiting), HANG_S)
        await until_health(url, 200)
        assert [t for t, _ in cut_results] == [want_greedy] * 3
        assert all(resumes >= 1 for _, resumes in cut_results)  # cut, and resumed
        assert texts == list((await reference(draft, endpoint, [21, 22])).values())
        assert await scrape(url, "xcosd_edge_cloud_losses_total") >= 1
        assert await scrape(url, "xcosd_edge_cloud_reconnects_total") >= 1
        assert await scrape(url, "xcosd_edge_generations_total", finish_reason="error") == 0
        assert any("lost the cloud" in ln for ln in proc.lines)


# --------------------------------------------------------------------- deadlines


async def test_an_edge_server_given_a_connect_timeout_gives_up_past_it() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    async with edge_server(endpoint, "--connect-timeout", "2", rc=2) as (url, proc):
        body = await until_health(url, 503)  # it serves while it looks
        assert body["status"] == "connecting"
        assert await proc.exited() == 2
    assert re.search(r"xcosd: error: cannot reach the cloud at .*\(tried for 2 s\)",
                     "\n".join(proc.lines))


@pytest.mark.slow
async def test_the_one_shot_edge_keeps_its_deadlines() -> None:
    """``xcosd edge PROMPT`` (no server): a cloud that is not there ends it after
    ``--connect-timeout``; one that goes silent mid-generation (SIGSTOP) is taken
    for lost after ``--timeout`` and given up after ``--connect-timeout`` more,
    each with its reason and status 2. (3 s for the second: its first handshake,
    which uploads the vocabulary map, must fit in it on a loaded machine too.)"""
    dead = f"tcp://127.0.0.1:{free_port()}"
    async with xcosd_process("edge", "--connect", dead, "--connect-timeout", "1", PROMPT,
                             rc=2) as proc:
        await proc.exited()
    assert any(re.match(r"xcosd: error: cannot reach the cloud .*Connection refused "
                        r"\(tried for 1 s\)", ln) for ln in proc.lines), proc.lines
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    async with xcosd_process("serve", "--bind", endpoint, "--heartbeat", "0.1",
                             rc=None) as cloud:
        await until(lambda: any(ln.startswith("serving") for ln in cloud.lines), "the cloud")
        async with xcosd_process("edge", "--connect", endpoint, "--timeout", "0.5",
                                 "--connect-timeout", "3", "--max-new-tokens", "5000",
                                 "--ignore-eos", PROMPT, rc=2) as edge:
            await until(lambda: len(edge.out) > len(PROMPT), "the first text")
            os.kill(cloud.proc.pid, signal.SIGSTOP)
            try:
                assert await edge.exited() == 2
            finally:
                os.kill(cloud.proc.pid, signal.SIGCONT)
        assert any(re.match(r"xcosd: error: cannot reach the cloud .*\(tried for 3 s\)", ln)
                   for ln in edge.lines), edge.lines
