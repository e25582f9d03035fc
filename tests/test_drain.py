"""Readiness and the graceful drain of a cloud, and an edge with several addresses.

The state machine (xcosd/nodes/drain.py) is driven with chosen times; the nodes are
real (ZeroMQ on loopback, a synthetic target that sleeps per call so generations
are in flight when a drain begins). A drain must lose no token and no session:
every output equals the target's greedy decode, and the drain's counts add up
(``sessions_at_start == finished + handed_off + ended_otherwise``). The last test
runs ``xcosd serve`` itself and drains it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest

import xcosd
from xcosd.bench.scale import greedy_reference
from xcosd.errors import TransportError
from xcosd.models import SyntheticModel, load_model
from xcosd.nodes.drain import Drain, DrainPhase
from xcosd.transport.addresses import Addresses, Backoff, resolve, split_endpoints

from .helpers.waits import HANG_S, until

#: a target whose calls sleep 4 ms: a 48-token generation takes some rounds
SPEC = "synthetic:256:4:0"


def models() -> tuple[Any, Any, Any]:
    """(target served, its cost-free twin for references, a draft that mostly agrees)."""
    target = load_model(SPEC)
    free = load_model(SPEC, a=0.0, b=0.0)
    draft = SyntheticModel(free.vocab, skew=0.9, name="draft")
    return target, free, draft


def edge(connect: str, draft: Any, vocab: Any) -> xcosd.EdgeNode:
    return xcosd.EdgeNode(draft=draft, connect=connect, temperature=0.0, target_vocab=vocab,
                          heartbeat_s=0.05, silence_timeout_s=HANG_S, adaptive_draft=False)


@contextlib.asynccontextmanager
async def clouds(n: int, target: Any, **opts: Any) -> AsyncIterator[list[xcosd.CloudNode]]:
    nodes = [xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", silence_timeout_s=HANG_S, **opts)
             for _ in range(n)]
    try:
        for c in nodes:
            await c.start()
        yield nodes
    finally:
        for c in nodes:
            await c.close()


async def move_to(e: xcosd.EdgeNode, endpoint: str) -> None:
    """Reconnect ``e`` until it holds a connection to ``endpoint`` (one of its
    addresses: each reconnect takes the next)."""
    for _ in range(4):
        if e.address == endpoint:
            return
        await e._recover(e._epoch)
    raise AssertionError(f"the edge never reached {endpoint}")


def http_get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ------------------------------------------------------------------ sans-I/O


def test_the_drain_state_machine_counts_every_session_it_found() -> None:
    d = Drain()
    assert d.accepting and d.health(0, 2, {})[0] == 200
    assert d.health(2, 2, {}) == (503, {"status": "full"})
    assert d.start(10.0, 5.0, sessions=3)
    assert not d.start(11.0, 5.0, sessions=3)  # one drain at a time
    assert d.health(0, 2, {"x": 1}) == (503, {"x": 1, "status": "draining"})
    d.session_ended(by_peer=True)
    d.session_ended(by_peer=False)
    d.refused()
    assert d.left_s(12.0) == 3.0
    assert not d.due(12.0, sessions=1)  # one runs, before the deadline
    assert d.due(15.0, sessions=1) and d.phase is DrainPhase.HANDING_OFF
    d.handed_off(sessions=1, peers=1)
    d.session_ended(by_peer=False)  # the hand-off's own ending is not counted twice
    rep = d.done(15.5)
    assert (rep.sessions_at_start, rep.finished, rep.ended_otherwise, rep.handed_off) == (3, 1, 1, 1)
    assert rep.sessions_at_start == rep.finished + rep.handed_off + rep.ended_otherwise
    assert rep.refused == 1 and rep.took_s == 5.5
    d2 = Drain()
    d2.start(0.0, 30.0, sessions=0)
    assert d2.due(0.0, sessions=0)  # nothing runs: no need to wait for the deadline
    with pytest.raises(ValueError):
        Drain().start(0.0, -1.0, 0)


def test_addresses_take_turns_from_a_random_start_and_backoff_is_jittered() -> None:
    a = Addresses(["x", "y", "z"], rng=random.Random(1))
    first = a.pass_()
    assert sorted(first) == ["x", "y", "z"]
    a.tried(first[0])  # connected to it; lost it later: the next pass starts after it
    assert a.pass_() == [*first[1:], first[0]]
    starts = {Addresses(["x", "y", "z"], rng=random.Random(s)).pass_()[0] for s in range(40)}
    assert starts == {"x", "y", "z"}  # edges spread over the addresses
    a.update(["y", "w"])  # a fresh resolution keeps the place when it can
    assert a.pass_()[0] in ("y", "w")
    b = Backoff(0.1, 1.0, rng=random.Random(0))
    delays = [b.next() for _ in range(6)]
    for k, d in enumerate(delays):
        cap = min(1.0, 0.1 * 2 ** k)
        assert cap / 2 <= d <= cap
    assert len({round(d, 6) for d in delays[-3:]}) == 3  # drawn, not fixed
    b.reset()
    assert b.next() <= 0.1
    assert split_endpoints(" tcp://a:1, ,tcp://b:2") == ["tcp://a:1", "tcp://b:2"]
    with pytest.raises(TransportError):
        split_endpoints(" , ")


async def test_a_host_name_resolves_to_its_addresses() -> None:
    got = await resolve("tcp://localhost:5555,tcp://127.0.0.2:6000", ipv6=False)
    assert got[0] == "tcp://127.0.0.1:5555" and got[-1] == "tcp://127.0.0.2:6000"
    assert all(not a.startswith("tcp://[") for a in got)
    assert await resolve("mem://x") == ["mem://x"]


# ------------------------------------------------------------------ nodes


async def test_health_says_ok_full_and_draining() -> None:
    target, free, draft = models()
    async with clouds(1, target, metrics_port=0, max_sessions=1) as (cloud,):
        url = cloud._metrics.health_url  # type: ignore[union-attr]
        status, body = await asyncio.to_thread(http_get, url)
        assert status == 200 and body["status"] == "ok" and body["server_id"] == cloud.server_id
        async with edge(cloud.endpoint, draft, target.vocab) as e:
            gen = asyncio.create_task(e.generate("ab", max_new_tokens=400))
            await until(lambda: cloud.stats()["sessions_active"] == 1, "the session to open")
            status, body = await asyncio.to_thread(http_get, url)
            assert status == 503 and body["status"] == "full"
            drained = asyncio.create_task(cloud.drain(HANG_S))
            await until(lambda: cloud.draining, "the drain to begin")
            status, body = await asyncio.to_thread(http_get, url)
            assert status == 503 and body["status"] == "draining"
            res = await asyncio.wait_for(gen, HANG_S)  # the running generation finishes here
            rep = await asyncio.wait_for(drained, HANG_S)
        assert res.token_ids == greedy_reference(free, "ab", 400) and res.stats.resumes == 0
        assert rep["sessions_at_start"] == 1 and rep["finished"] == 1 and rep["handed_off"] == 0
        assert cloud.stats()["draining"] is True


async def test_a_drain_lets_generations_finish_and_sends_new_ones_elsewhere() -> None:
    """Four edges, each with both clouds' addresses; one cloud drains while every
    edge runs a generation: those on it finish there, and every generation after
    goes to the other cloud. All outputs are the target's greedy decode."""
    target, free, draft = models()
    n = 48
    want = greedy_reference(free, "ab", n)
    async with clouds(2, target) as (a, b):
        spec = f"{a.endpoint},{b.endpoint}"
        edges = [edge(spec, draft, target.vocab) for _ in range(4)]
        for e in edges:
            await e.start()
        try:
            await move_to(edges[0], a.endpoint)  # the cloud that drains has an edge
            first = [asyncio.create_task(e.generate("ab", max_new_tokens=n)) for e in edges]
            await until(lambda: a.stats()["sessions_active"] >= 1, "a session on the cloud")
            rep = await asyncio.wait_for(a.drain(HANG_S), HANG_S)
            results = await asyncio.wait_for(asyncio.gather(*first), HANG_S)
            later = await asyncio.wait_for(
                asyncio.gather(*(e.generate("ab", max_new_tokens=n) for e in edges)), HANG_S)
            assert all(e.address == b.endpoint for e in edges)
        finally:
            for e in edges:
                await e.close()
    assert [r.token_ids for r in results + later] == [want] * 8
    assert rep["sessions_at_start"] >= 1
    assert rep["sessions_at_start"] == rep["finished"] + rep["handed_off"] + rep["ended_otherwise"]
    assert rep["handed_off"] == 0 and rep["ended_otherwise"] == 0  # all finished in time
    assert sum(r.stats.resumes for r in results) == 0


async def test_past_its_deadline_a_drain_hands_generations_off_exactly() -> None:
    target, free, draft = models()
    n = 300
    want = greedy_reference(free, "ab", n)
    async with clouds(2, target) as (a, b), \
            edge(f"{a.endpoint},{b.endpoint}", draft, target.vocab) as e:
        await move_to(e, a.endpoint)
        progress: list[str] = []
        gen = asyncio.create_task(e.generate("ab", max_new_tokens=n, on_text=progress.append))
        await until(lambda: len(progress) > 5, "the generation to be under way")
        rep = await asyncio.wait_for(a.drain(0.05), HANG_S)
        res = await asyncio.wait_for(gen, HANG_S)
        assert e.address == b.endpoint
    assert res.token_ids == want and res.stats.resumes == 1
    assert rep["sessions_at_start"] == 1 and rep["handed_off"] == 1 and rep["finished"] == 0
    assert rep["peers_told"] >= 1 and a.stats()["sessions_active"] == 0


async def test_an_edge_reaches_the_next_address_when_one_is_dead() -> None:
    target, free, draft = models()
    with socket.socket() as s:  # a port nobody serves (TCP refuses it at once)
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    async with clouds(1, target, transport="tcp") as (cloud,):
        e = xcosd.EdgeNode(draft=draft, connect=f"{dead},{cloud.endpoint}", transport="tcp",
                           temperature=0.0, target_vocab=target.vocab, silence_timeout_s=HANG_S,
                           connect_timeout_s=HANG_S)
        async with e:
            assert e.address == cloud.endpoint
            res = await e.generate("ab", max_new_tokens=16)
    assert res.token_ids == greedy_reference(free, "ab", 16)


# ------------------------------------------------------------------ the command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_serve_drains_on_sigterm_and_exits_within_its_deadline() -> None:
    """``xcosd serve`` as an orchestrator stops it: SIGTERM with generations running
    on two edges. /health turns 503, the generations finish (or move) exactly, and
    the process exits 0 within the drain deadline."""
    _target, free, draft = models()
    port, mport = _free_port(), _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "xcosd", "serve", "--target", "synthetic:256:10:0", "--bind",
        endpoint, "--metrics-port", str(mport), "--drain-timeout", "3",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    lines: list[str] = []

    async def read() -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            lines.append(raw.decode(errors="replace").rstrip())

    reader = asyncio.create_task(read())
    try:
        await until(lambda: any(ln.startswith("serving ") for ln in lines), "the cloud to serve")
        n = 120
        want = greedy_reference(free, "ab", n)
        async with edge(endpoint, draft, free.vocab) as e1, edge(endpoint, draft, free.vocab) as e2:
            gens = [asyncio.create_task(e.generate("ab", max_new_tokens=n)) for e in (e1, e2)]
            await until(lambda: e1.server_id is not None, "a session")
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await until(lambda: any(ln.startswith("draining:") for ln in lines), "the drain")
            status, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{mport}/health")
            assert status == 503 and body["status"] == "draining"
            results = await asyncio.wait_for(asyncio.gather(*gens), HANG_S)
            await asyncio.wait_for(proc.wait(), HANG_S)
            took = time.monotonic() - t0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(reader, HANG_S)
    assert proc.returncode == 0, "\n".join(lines[-20:])
    assert took < 3 + 2.5, f"took {took:.1f} s to leave"
    assert [r.token_ids for r in results] == [want, want]
    drained = json.loads(next(ln for ln in lines if ln.startswith("drained: "))[len("drained: "):])
    assert drained["sessions_at_start"] == 2
    assert drained["finished"] + drained["handed_off"] == 2 and drained["ended_otherwise"] == 0
