"""Many target replicas behind one broker, over real ZeroMQ sockets on loopback.

Every edge connection stays on one replica (its sessions live there); a replica
that dies has its generations resumed exactly on another (the output is the
target's greedy decode: no token lost or repeated); a replica that joins later is
given new edges; the broker forgets a silent replica and keeps its only queue (the
messages that arrive while no replica is registered) bounded. The last test runs
``xcosd serve --replicas 2`` itself and kills a replica process with SIGKILL.

Nothing here sleeps for something to happen: tests wait for states (``until``),
with :data:`HANG_S` only as a hang bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

import xcosd
from xcosd.commands.serve import replica_argv
from xcosd.errors import TransportError
from xcosd.nodes import Broker
from xcosd.transport.replica import (
    DATA,
    GONE,
    HEARTBEAT,
    PROTOCOL,
    READY,
    RESET,
    ReplicaListener,
)

from .helpers.processes import free_port, xcosd_process
from .helpers.waits import HANG_S, until
from .session_pairs import greedy_decode, pair


@contextlib.asynccontextmanager
async def cluster(n: int, **broker_opts: Any) -> AsyncIterator[tuple[Broker, list[xcosd.CloudNode]]]:
    """A broker and ``n`` replicas of the bigram target, all in this event loop."""
    target, _ = pair()
    async with Broker(front="tcp://127.0.0.1:0", **broker_opts) as broker:
        clouds: list[xcosd.CloudNode] = []
        try:
            for _ in range(n):
                clouds.append(await replica(target, broker))
            await until(lambda: broker.stats()["replicas_live"] == n, f"{n} replicas to join")
            yield broker, clouds
        finally:
            for c in clouds:
                await c.close()


async def replica(target: Any, broker: Broker, goodbye: bool = True) -> xcosd.CloudNode:
    """A CloudNode serving as a replica of ``broker``; without ``goodbye`` it leaves
    as a killed process does (its connection just closes)."""
    return await xcosd.CloudNode(target=target, bind=broker.back_endpoint, transport="replica",
                                 silence_timeout_s=HANG_S,
                                 transport_options={"goodbye": goodbye}).start()


def edge(broker: Broker, draft: Any) -> xcosd.EdgeNode:
    # pings every 50 ms: a moved edge hears "handshake" from its new replica at once
    return xcosd.EdgeNode(draft=draft, connect=broker.endpoint, temperature=0.0,
                          heartbeat_s=0.05, silence_timeout_s=HANG_S)


async def test_each_edge_stays_on_one_replica_and_outputs_are_exact() -> None:
    target, draft = pair()
    want = greedy_decode(target, "ab", 40)
    async with cluster(2) as (broker, clouds):
        edges = [await edge(broker, draft).start() for _ in range(4)]
        try:
            results = await asyncio.gather(*(e.generate("ab", max_new_tokens=40)
                                             for e in edges for _ in range(3)))
            assert all(r.token_ids == want for r in results)
            assert all(r.stats.resumes == 0 for r in results)
            on = Counter(e.server_id for e in edges)
            # least loaded when it first speaks: two edges each
            assert on == Counter({c.server_id: 2 for c in clouds})
            for c in clouds:
                # every session of an edge was opened on that edge's replica
                assert c.stats()["sessions_opened"] == 3 * on[c.server_id]
                assert c.stats()["peers"] == 2
            st = broker.stats()
            assert sorted(r["edges"] for r in st["replicas"].values()) == [2, 2]
            assert st["dropped_stale"] == st["dropped_replica_full"] == 0
            assert len(set(broker.pinned().values())) == 2
        finally:
            for e in edges:
                await e.close()


async def test_a_replica_killed_mid_generation_loses_and_repeats_no_token() -> None:
    target, draft = pair()
    n = 160
    want = target.vocab.decode(greedy_decode(target, "ab", n)).decode()
    async with Broker(front="tcp://127.0.0.1:0") as broker:
        victim = await replica(target, broker, goodbye=False)
        survivor = await replica(target, broker)
        try:
            await until(lambda: broker.stats()["replicas_live"] == 2, "both replicas to join")
            edges = [await edge(broker, draft).start() for _ in range(4)]
            doomed = sum(e.server_id == victim.server_id for e in edges)
            assert doomed == 2
            texts = ["" for _ in range(8)]
            started = asyncio.Event()

            async def run(i: int, e: xcosd.EdgeNode) -> None:
                async for piece in e.stream("ab", max_new_tokens=n, method="xcosd-e"):
                    texts[i] += piece
                    if all(texts):
                        started.set()

            tasks = [asyncio.create_task(run(i, edges[i % 4])) for i in range(8)]
            await asyncio.wait_for(started.wait(), HANG_S)  # every generation under way
            await victim.close()  # no goodbye: the broker sees a connection close
            await asyncio.wait_for(asyncio.gather(*tasks), HANG_S)
            assert texts == [want] * 8
            # the victim's four generations resumed on the survivor, nobody else's
            assert sum(e.resumes for e in edges) == doomed
            assert all(e.server_id == survivor.server_id for e in edges)
            assert survivor.stats()["sessions_opened"] == 8
            st = broker.stats()
            assert st["replicas_live"] == 1 and sum(st["replicas_lost"].values()) == 1
            for e in edges:
                await e.close()
        finally:
            await victim.close()
            await survivor.close()


async def test_a_replica_that_joins_later_receives_new_edges() -> None:
    target, draft = pair()
    want = greedy_decode(target, "ab", 20)
    async with cluster(1) as (broker, [first]), edge(broker, draft) as e1:
        assert e1.server_id == first.server_id
        late = await replica(target, broker)
        try:
            await until(lambda: broker.stats()["replicas_live"] == 2, "the late replica")
            async with edge(broker, draft) as e2:
                assert e2.server_id == late.server_id  # the least loaded one
                res = await e2.generate("ab", max_new_tokens=20)
                assert res.token_ids == want
                assert late.stats()["sessions_opened"] == 1
                assert (await e1.generate("ab", max_new_tokens=20)).token_ids == want
                assert first.stats()["sessions_opened"] == 1
        finally:
            await late.close()


async def _rebind(front: str, back: str) -> Broker:
    """A new broker on the old endpoints as soon as the ports are free again (ZeroMQ
    releases a closed socket's port in its I/O thread, a moment after close)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_S
    while True:
        try:
            return await Broker(front=front, back=back).start()
        except TransportError as e:
            if e.code != "address_in_use" or loop.time() > deadline:
                raise
        await asyncio.sleep(0.005)


async def test_a_broker_restart_mid_generation_loses_no_token() -> None:
    """The new broker knows no replica: each is told RESET when it next speaks,
    registers once (not once per message it had in flight), and the edges resume."""
    target, draft = pair()
    n = 160
    want = target.vocab.decode(greedy_decode(target, "ab", n)).decode()
    broker = await Broker(front="tcp://127.0.0.1:0").start()
    front, back = broker.endpoint, broker.back_endpoint
    clouds = [await replica(target, broker) for _ in range(2)]
    restarted: Broker | None = None
    try:
        await until(lambda: broker.stats()["replicas_live"] == 2, "both replicas to join")
        async with edge(broker, draft) as e:
            text = ""
            async for piece in e.stream("ab", max_new_tokens=n, method="xcosd-e"):
                text += piece
                if restarted is None and len(text) > 20:
                    await broker.close()
                    restarted = await _rebind(front, back)
            assert text == want
            assert e.resumes >= 1
        assert restarted is not None
        await until(lambda: restarted.stats()["replicas_live"] == 2, "both to register again")
        for c in clouds:
            assert c._listener is not None
            assert c._listener.registrations == 2  # type: ignore[attr-defined]
    finally:
        for c in clouds:
            await c.close()
        await broker.close()
        if restarted is not None:
            await restarted.close()


@contextlib.asynccontextmanager
async def back_end(**opts: Any) -> AsyncIterator[tuple[zmq.asyncio.Socket, ReplicaListener, bytes]]:
    """A ROUTER speaking the broker's back-end protocol by hand, and a replica
    listener registered with it (its routing id)."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind("tcp://127.0.0.1:0")
    listener = await ReplicaListener.open(router.getsockopt_string(zmq.LAST_ENDPOINT),
                                          context=ctx, **opts)
    try:
        rid, *ready = await asyncio.wait_for(router.recv_multipart(), HANG_S)
        assert ready == [READY, PROTOCOL]
        yield router, listener, rid
    finally:
        await listener.close()
        router.close(linger=0)
        ctx.term()


async def take(listener: ReplicaListener, n: int) -> list[tuple[bytes, list[bytes] | None]]:
    """The next ``n`` things the listener reports (over as many calls as it takes)."""
    got: list[tuple[bytes, list[bytes] | None]] = []
    while len(got) < n:
        got += await asyncio.wait_for(listener.recv_many(64), HANG_S)
    assert len(got) == n, got
    return got


async def test_a_replica_listener_reports_edges_in_order_and_answers_without_waiting() -> None:
    """What the broker forwards comes out in order, the broker's own commands
    handled on the way (a heartbeat is liveness only, GONE ends an edge it
    served, GONE for an edge it never saw is nothing); a reply goes straight to
    the socket (``send_nowait``), enveloped with the edge's routing id."""
    async with back_end() as (router, listener, rid):
        await router.send_multipart([rid, DATA, b"e0", b"h0", b"body0"])
        await router.send_multipart([rid, HEARTBEAT])
        await router.send_multipart([rid, DATA, b"e1", b"h1"])
        await router.send_multipart([rid, GONE, b"never-seen"])
        await router.send_multipart([rid, GONE, b"e0"])
        await router.send_multipart([rid, DATA, b"e2", b"h2"])
        assert await take(listener, 4) == [(b"e0", [b"h0", b"body0"]), (b"e1", [b"h1"]),
                                           (b"e0", None), (b"e2", [b"h2"])]
        assert listener.send_nowait(b"e1", [b"reply", memoryview(b"rows")])
        got = await asyncio.wait_for(router.recv_multipart(), HANG_S)
        while got[1] == HEARTBEAT:
            got = await asyncio.wait_for(router.recv_multipart(), HANG_S)
        assert got == [rid, DATA, b"e1", b"reply", b"rows"]
        assert listener.meter.total("down").payload == len(b"reply") + len(b"rows")
        assert listener.meter.total("up").messages == 3
        with pytest.raises(TransportError):
            listener.send_nowait(b"e1", [])


async def test_a_reset_reports_every_served_edge_gone_before_what_came_after() -> None:
    """RESET: the broker has forgotten this replica and handed its edges on. Each
    edge it served is reported gone before the next edge message, and it
    registers again."""
    async with back_end() as (router, listener, rid):
        for e in (b"e0", b"e1"):
            await router.send_multipart([rid, DATA, e, b"h"])
        assert [p for p, _ in await take(listener, 2)] == [b"e0", b"e1"]
        await router.send_multipart([rid, RESET])
        await router.send_multipart([rid, DATA, b"e2", b"h"])
        assert await take(listener, 3) == [(b"e0", None), (b"e1", None), (b"e2", [b"h"])]
        while (await asyncio.wait_for(router.recv_multipart(), HANG_S))[1] != READY:
            pass  # heartbeats
        assert listener.registrations == 2


async def test_a_replica_whose_broker_falls_silent_reports_its_edges_gone_at_once() -> None:
    """A broker silent past the timeout has forgotten this replica: its edges are
    reported gone to the node now, while it waits for messages that will not
    come, not whenever the broker speaks again."""
    async with back_end(heartbeat_ivl=0.05, heartbeat_timeout=0.2) as (router, listener, rid):
        await router.send_multipart([rid, DATA, b"e0", b"h"])
        assert await take(listener, 1) == [(b"e0", [b"h"])]
        # the router says nothing more: the waiting receive is woken to report e0
        assert await asyncio.wait_for(listener.recv_many(64), HANG_S) == [(b"e0", None)]
        assert listener.registrations >= 2


async def test_a_silent_replica_is_forgotten_and_told_to_register_again() -> None:
    """The Paranoid Pirate side: a replica that registers and then says nothing is
    forgotten after the timeout; when it speaks again it is told RESET. An edge
    whose hello went to it gets a live replica when it asks again."""
    target, draft = pair()
    ctx = zmq.asyncio.Context()
    async with Broker(front="tcp://127.0.0.1:0", heartbeat_s=0.05,
                      replica_timeout_s=0.3) as broker:
        mute = ctx.socket(zmq.DEALER)
        mute.linger = 0
        try:
            mute.connect(broker.back_endpoint)
            await mute.send_multipart([READY, PROTOCOL])
            await until(lambda: broker.stats()["replicas_live"] == 1, "the mute replica")
            # an edge connecting now is pinned to the mute replica: its hello is lost
            e = xcosd.EdgeNode(draft=draft, connect=broker.endpoint, temperature=0.0,
                               heartbeat_s=0.05, silence_timeout_s=0.5, connect_timeout_s=HANG_S)
            starting = asyncio.create_task(e.start())
            await until(lambda: broker.stats()["edges"] == 1, "the edge to be pinned")
            await until(lambda: broker.stats()["replicas_lost"].get("timeout") == 1,
                        "the mute replica to be forgotten")
            await mute.send_multipart([HEARTBEAT])
            while (await asyncio.wait_for(mute.recv_multipart(), HANG_S))[0] != RESET:
                pass  # heartbeats sent before it was forgotten
            live = await replica(target, broker)
            try:
                await asyncio.wait_for(starting, HANG_S)
                assert e.server_id == live.server_id
                res = await e.generate("ab", max_new_tokens=10)
                assert res.token_ids == greedy_decode(target, "ab", 10)
            finally:
                await e.close()
                await live.close()
            assert broker.stats()["resets_sent"] >= 1
        finally:
            mute.close(linger=0)
            ctx.term()


async def test_the_broker_stays_bounded_against_a_flooding_edge() -> None:
    """Without a replica the broker parks at most ``max_parked`` messages and drops
    the rest; with one, a flood waits in bounded ZeroMQ pipes or is dropped and
    counted, and an honest edge on the same replica still gets exact answers."""
    target, draft = pair()
    ctx = zmq.asyncio.Context()
    async with Broker(front="tcp://127.0.0.1:0", hwm=50, back_hwm=50, max_parked=100,
                      max_parked_bytes=64 << 10) as broker:
        flood = ctx.socket(zmq.DEALER)
        flood.linger = 0
        flood.sndhwm = 0  # the flooder's own side holds nothing back
        blob = np.zeros(256, dtype=np.uint8).tobytes()
        try:
            flood.connect(broker.endpoint)

            async def burst(n: int) -> None:
                for k in range(n):
                    await flood.send_multipart([b"\x81\xa1t\xa4ping", blob])
                    if k % 256 == 0:
                        await asyncio.sleep(0)

            await burst(1000)
            await until(lambda: broker.stats()["from_edges"] == 1000, "the flood to be read")
            st = broker.stats()
            assert st["parked_now"] <= 100 and st["parked_bytes"] <= 64 << 10
            assert st["dropped_no_replica"] == 1000 - st["parked_now"]
            cloud = await replica(target, broker)
            try:
                await until(lambda: broker.stats()["parked_now"] == 0, "the parked flush")
                flooding = asyncio.create_task(burst(4000))
                async with edge(broker, draft) as honest:
                    res = await honest.generate("ab", max_new_tokens=30)
                    assert res.token_ids == greedy_decode(target, "ab", 30)
                await asyncio.wait_for(flooding, HANG_S)
                await until(lambda: broker.stats()["from_edges"] >= 5000, "the flood")
                st = broker.stats()
                # nothing is held in the broker: every message it read was forwarded
                # or dropped and counted (the pipes behind it are bounded by hwm)
                assert st["parked_now"] == 0
                assert st["from_edges"] == (st["to_replicas"] + st["dropped_replica_full"]
                                            + st["dropped_no_replica"])
                assert cloud.stats()["internal_errors"] == 0
            finally:
                await cloud.close()
        finally:
            flood.close(linger=0)
            ctx.term()


def test_replica_command_line_carries_the_servers_settings() -> None:
    from xcosd.cli import build_parser

    args = build_parser().parse_args([
        "serve", "--replicas", "3", "--target", "synthetic:64:1:0.5", "--max-batch", "64",
        "--max-batch-tokens", "512", "--methods", "xcosd,xcosd-e", "--metrics-port", "9100",
        "--link-rtt-ms", "5"])
    argv = replica_argv(args, "tcp://127.0.0.1:7000", 2, ["--join-curve-secret", "r.key_secret"])
    assert argv[:6] == [sys.executable, "-m", "xcosd", "serve", "--join", "tcp://127.0.0.1:7000"]
    flat = " ".join(argv)
    for part in ("--target synthetic:64:1:0.5", "--max-batch 64", "--max-batch-tokens 512",
                 "--methods xcosd,xcosd-e", "--metrics-port 9102", "--link-rtt-ms 5.0",
                 f"--parent-pid {os.getpid()}", "--join-curve-secret r.key_secret"):
        assert part in flat, part


@pytest.mark.parametrize(("argv", "says"), [
    (["serve", "--replicas", "2", "--join", "tcp://127.0.0.1:7000"], "not both"),
    (["serve", "--backend", "tcp://127.0.0.1:7000"], "needs --replicas"),
    (["serve", "--replicas", "2", "--transport", "tcp"], "ZeroMQ"),
])
def test_replica_options_that_do_not_go_together(argv: list[str], says: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from xcosd.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def synthetic_greedy(model: Any, prompt: str, n: int) -> list[int]:
    """The model's own greedy continuation, through its batch API."""
    eos = model.vocab.roles["eos"]
    sess = model.start(model.tokenize(prompt))
    out: list[int] = []
    while len(out) < n:
        t = int(np.argmax(model.score([(sess, [])])[0][-1]))
        out.append(t)
        if t == eos:
            break
        model.append(sess, [t])
    return out


@contextlib.asynccontextmanager
async def serve_process(*argv: str) -> AsyncIterator[list[str]]:
    """``xcosd serve ARGV`` as a user runs it; yields the lines it prints (stderr),
    kept up to date. Stopped with SIGINT (a Ctrl-C) on exit, which must end it with
    status 0."""
    async with xcosd_process("serve", *argv) as running:
        yield running.lines


async def test_serve_replicas_survives_a_killed_replica_process() -> None:
    """``xcosd serve --replicas 2`` as a user runs it; one replica process is killed
    (SIGKILL) mid-generation, its edges resume on the other and it is started again."""
    from xcosd.models import SyntheticModel, load_model

    spec = "synthetic:256"
    target = load_model(spec)
    draft = SyntheticModel(target.vocab, skew=0.9, name="draft")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    async with serve_process("--replicas", "2", "--target", spec, "--bind", endpoint) as lines:

        def pids() -> list[int]:
            return [int(m.group(1)) for ln in lines
                    if (m := re.search(r"started \(pid (\d+)\)", ln))]

        await until(lambda: "replicas live: 2 (joined 2, lost 0)" in lines, "two replicas")
        n = 200
        want = synthetic_greedy(target, "ab", n)
        edges = [xcosd.EdgeNode(draft=draft, connect=endpoint, temperature=0.0,
                                target_vocab=target.vocab, heartbeat_s=0.05, silence_timeout_s=HANG_S)
                 for _ in range(2)]
        for e in edges:
            await e.start()
        try:
            assert edges[0].server_id != edges[1].server_id
            progress = [0, 0]

            def counter(i: int) -> Any:
                def on_text(_piece: str) -> None:
                    progress[i] += 1
                return on_text

            gens = [asyncio.create_task(e.generate("ab", max_new_tokens=n, on_text=counter(i)))
                    for i, e in enumerate(edges)]
            await until(lambda: min(progress) > 0, "both generations to be under way")
            os.kill(pids()[0], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*gens), HANG_S)
            assert [r.token_ids for r in results] == [want, want]
            assert sum(r.stats.resumes for r in results) == 1
            await until(lambda: len(pids()) == 3, "the killed replica to be started again")
        finally:
            for e in edges:
                await e.close()


def test_scale_report_renders_and_its_ideal_matches_the_cost_model() -> None:
    from xcosd.bench.scale import ScaleConfig, format_report, ideal_tokens_per_s, section_lines

    cfg = ScaleConfig()
    one, two, four = (ideal_tokens_per_s(cfg, n) or 0.0 for n in (1, 2, 4))
    # 128 devices x 5 rows: 20 ms + 0.5 ms/row per batch, whole batches per replica
    assert one == pytest.approx(640 / 0.34) and four == pytest.approx(6400.0)
    assert round(two / one, 2) == 1.89 and round(four / one, 2) == 3.40
    assert ideal_tokens_per_s(ScaleConfig(target="default-target"), 2) is None
    points = [{"replicas": n, "tokens_per_s": t, "ratio": t / 1000, "goal_ratio": g,
               "meets_goal": None if g is None else t / 1000 >= g, "ideal_tokens_per_s": None,
               "ideal_ratio": None, "efficiency": None, "round_ms_p50": r, "errors": 0,
               "resumes": 0, "machine_busy": 0.5, "devices_cores": 0.25}
              for n, t, g, r in ((1, 1000.0, None, 379.0), (2, 1900.0, 1.8, 209.0))]
    rep = {"schema_version": 1, "config": cfg.to_dict(), "points": points, "killed": None,
           "machine": {"nproc": 2}}
    assert "1.90" in format_report(rep) and "50%" in format_report(rep)
    text = "\n".join(section_lines(rep))
    assert "1 of 1 ratio goals met" in text and "No replica was killed" in text
    # a round's time outside its call: 379 - (20 + 0.5 * 128 * 5), 209 - (20 + 0.5 * 64 * 5)
    assert ("39 ms with 1 replica (10 % of its round), 29 ms with 2 replicas (14 % of its "
            "round): it shrinks more slowly than the call") in text
    assert "The controls" not in text  # a report without them says nothing of them
    # the controls: 2 x 980 alone, 1,950 without a broker, 1,900 behind it
    points[0].update(efficiency=0.9, devices=128)
    rep["controls"] = [
        {"replicas": 2, "kind": "alone", "devices": 64, "tokens_per_s": 980.0, "ratio": 1.96,
         "ideal_tokens_per_s": 1000.0, "efficiency": 0.98, "round_ms_p50": 200.0,
         "machine_busy": 0.25},
        {"replicas": 2, "kind": "no-broker", "devices": 128, "tokens_per_s": 1950.0,
         "ratio": 1.95, "ideal_tokens_per_s": 2000.0, "efficiency": 0.975,
         "round_ms_p50": 205.0, "machine_busy": 0.5, "sharing_cost": 1 - 1950 / 1960,
         "broker_cost": 1 - 1900 / 1950}]
    text = "\n".join(section_lines(rep))
    assert "| 2 | one replica alone | 64 | 980 | 1,960 | 1.96 |" in text
    assert "2 x 980 = 1,960 tokens/s (1.96x)" in text
    assert "alone delivers 0.98 of the cost model's best where the one serving all 128 " \
           "delivers 0.90" in text
    assert "costs 1 % (2 clouds without a broker: 1,950 tokens/s, 1.95x), the broker 3 %" in text
    rep["controls"][1].update(sharing_cost=-0.01, broker_cost=0.004)  # gains are noise
    text = "\n".join(section_lines(rep))
    assert "costs nothing measurable (2 clouds" in text and "broker nothing measurable" in text
    assert "2 clouds, no broker" in format_report(rep)
    assert section_lines(None)[2].endswith("is missing.")


# ------------------------------------------------------------ CURVE on the back end


async def test_a_back_end_with_curve_admits_only_the_replica_keys_it_allows() -> None:
    """A rogue replica (a key not on the back end's list, the plain transport, or a
    key the front end admits as a device) never joins: no edge is pinned to it and
    every output comes from the allowed replica, exact."""
    from xcosd.transport import CurveClient, CurveServer, KeyPair

    target, draft = pair()
    want = greedy_decode(target, "ab", 40)
    front, back, device, good, rogue = (KeyPair.generate() for _ in range(5))
    async with Broker(front="tcp://127.0.0.1:0",
                      curve=CurveServer(front, {device.public}),
                      back_curve=CurveServer(back, {good.public})) as broker:

        async def join(curve: CurveClient | None) -> xcosd.CloudNode:
            return await xcosd.CloudNode(target=target, bind=broker.back_endpoint,
                                         transport="replica", silence_timeout_s=HANG_S,
                                         curve=curve).start()

        rogues = [await join(CurveClient(rogue, back.public)), await join(None),
                  await join(CurveClient(device, back.public))]
        allowed: xcosd.CloudNode | None = None
        edges: list[xcosd.EdgeNode] = []
        try:
            # a loopback handshake takes milliseconds: had any been admitted, it
            # would have joined (and taken the first edges: the least loaded) by now
            await asyncio.sleep(0.5)
            assert broker.stats()["replicas_joined"] == 0
            allowed = await join(CurveClient(good, back.public))
            await until(lambda: broker.stats()["replicas_live"] == 1, "the allowed replica")
            edges = [await xcosd.EdgeNode(draft=draft, connect=broker.endpoint, temperature=0.0,
                                          silence_timeout_s=HANG_S,
                                          curve=CurveClient(device, front.public)).start()
                     for _ in range(3)]
            results = await asyncio.gather(*(e.generate("ab", max_new_tokens=40) for e in edges))
            assert [r.token_ids for r in results] == [want] * 3
            assert {e.server_id for e in edges} == {allowed.server_id}
            st = broker.stats()
            assert st["replicas_joined"] == 1 and st["bad_messages"] == 0
            assert all(r.stats()["sessions_opened"] == 0 for r in rogues)
        finally:
            for e in edges:
                await e.close()
            for c in [*rogues, *([allowed] if allowed else [])]:
                await c.close()


async def test_a_replica_takes_a_curve_client_not_a_server_key() -> None:
    from xcosd.transport import CurveServer, KeyPair, listen

    with pytest.raises(TransportError, match="CurveClient"):
        await listen("tcp://127.0.0.1:1", transport="replica",
                     curve=CurveServer(KeyPair.generate()))


def test_curve_options_of_broker_and_replica_that_do_not_go_together(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from xcosd.cli import main
    from xcosd.transport import KeyPair

    pub, sec = KeyPair.generate().save(tmp_path, "k")
    cases = [
        (["serve", "--backend-curve-secret", str(sec)], "needs --replicas"),
        (["serve", "--replicas", "0", "--backend-curve-secret", str(sec)], "admits no replica"),
        (["serve", "--replicas", "1", "--backend-curve-allow", str(tmp_path)],
         "needs --backend-curve-secret"),
        (["serve", "--join", "tcp://127.0.0.1:7000", "--join-curve-secret", str(sec)],
         "go together"),
        (["serve", "--replicas", "1", "--join-curve-secret", str(sec),
          "--join-curve-server-key", str(pub)], "needs --join"),
    ]
    for argv, says in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err, argv


async def test_serve_replicas_with_a_curve_back_end_serves_exactly(tmp_path: Any) -> None:
    """``xcosd serve --replicas 1 --backend-curve-secret``: the replica the broker
    process starts joins with a key made for it; its key files are gone at exit."""
    import glob
    import tempfile

    from xcosd.models import SyntheticModel, load_model
    from xcosd.transport import KeyPair

    _pub, sec = KeyPair.generate().save(tmp_path, "back")
    spec = "synthetic:256"
    target = load_model(spec)
    draft = SyntheticModel(target.vocab, skew=0.9, name="draft")
    pattern = os.path.join(tempfile.gettempdir(), "xcosd-replica-keys-*")
    before = set(glob.glob(pattern))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    async with serve_process("--replicas", "1", "--target", spec, "--bind", endpoint,
                             "--backend-curve-secret", str(sec)) as lines:
        await until(lambda: "replicas live: 1 (joined 1, lost 0)" in lines, "the replica")
        assert len(set(glob.glob(pattern)) - before) == 1  # its keys, while it runs
        e = await xcosd.EdgeNode(draft=draft, connect=endpoint, temperature=0.0,
                                 target_vocab=target.vocab, silence_timeout_s=HANG_S).start()
        try:
            r = await e.generate("ab", max_new_tokens=50)
        finally:
            await e.close()
        assert r.token_ids == synthetic_greedy(target, "ab", 50)
    assert set(glob.glob(pattern)) - before == set()
