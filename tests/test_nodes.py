"""CloudNode and EdgeNode over real ZeroMQ (and TCP) on loopback: many edges, the
batching scheduler, per-call overrides, streaming, limits, metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import xcosd
from xcosd.errors import VocabError
from xcosd.methods import METHODS
from xcosd.models import SyntheticModel, default_pair
from xcosd.nodes.edge import LOOP_DRAFT_MAX_IDS, drafts_on_loop, shared_process_draft_thread
from xcosd.vocab import Vocabulary

from .helpers.waits import HANG_S, until
from .session_pairs import TARGET_EOS, close_pair, closed_sessions_settle, greedy_decode, pair


async def test_64_edges_against_one_cloud_greedy() -> None:
    target, draft = pair()
    prompts = ["", "a", "ab", "abc", "cd", "dd", "bca", "ca"]
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", max_batch=32,
                               max_wait_s=0.005) as cloud:
        edges = [xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, temperature=0.0,
                                method=list(METHODS)[i % 7]) for i in range(64)]
        try:
            await asyncio.gather(*[e.start() for e in edges])
            results = await asyncio.gather(*[
                e.generate(prompts[i % 8], max_new_tokens=24) for i, e in enumerate(edges)])
        finally:
            await asyncio.gather(*[e.close() for e in edges])
        stats = await closed_sessions_settle(cloud)
    for i, r in enumerate(results):
        assert r.token_ids == greedy_decode(target, prompts[i % 8], 24), i
        assert r.text == target.vocab.decode(r.token_ids).decode()
    hist = stats["scheduler"]["batch_size_histogram"]
    assert max(hist) > 1, hist
    assert stats["sessions_opened"] == 64 and stats["sessions_active"] == 0



async def test_a_lone_device_never_waits_for_a_batch_to_fill() -> None:
    """The batching window is for other sessions' rounds: with one session open
    there are none, so no round waits it out (here a window of ten minutes)."""
    target, draft = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0",
                               max_wait_s=600.0) as cloud:
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, method="xcosd-e",
                                  temperature=0.0) as edge:
            async with asyncio.timeout(HANG_S):
                r = await edge.generate("ab", max_new_tokens=12)
        stats = await closed_sessions_settle(cloud)
    assert r.token_ids == greedy_decode(target, "ab", 12)
    assert stats["scheduler"]["batches"] == r.stats.target_calls >= 2
    assert stats["scheduler"]["mean_queue_wait_s"] < HANG_S / 10


class Sleepy:
    """A model that sleeps ``per_call`` seconds (without the GIL) on every score, as
    a real one computes: the device's drafting then takes time a verdict can
    overlap."""

    def __init__(self, inner: Any, per_call: float) -> None:
        self.inner, self.per_call = inner, per_call
        #: calls started (a test can tell that one is computing)
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def score(self, batch: Any) -> Any:
        self.calls += 1
        time.sleep(self.per_call)
        return self.inner.score(batch)


async def test_the_device_drafts_while_a_verdict_is_in_flight() -> None:
    """Unseeded, the device drafts on while its block is verified (a 2 ms draft
    step against a 20 ms target call): rounds whose verdict took the speculated
    path send drafts drawn during the last wait, and greedy output is still the
    target's own. Seeded, or told not to, it never speculates."""
    target, draft = close_pair()
    async with (
        xcosd.CloudNode(target=Sleepy(target, 0.02), bind="tcp://127.0.0.1:0") as cloud,
        xcosd.EdgeNode(draft=Sleepy(draft, 0.002), connect=cloud.endpoint, draft_thread=True,
                       temperature=0.0, draft_cost="auto") as edge,
    ):
        runs = [await edge.generate(p, max_new_tokens=24) for p in ("a", "c", "ab")]
        seeded = await edge.generate("a", max_new_tokens=24, seed=3)
        off = await edge.generate("a", max_new_tokens=24, speculate=False)
    for p, r in zip(("a", "c", "ab"), runs, strict=True):
        assert r.token_ids == greedy_decode(target, p, 24)
    used = sum(r.stats.speculated_used for r in runs)
    assert 0 < used <= sum(r.stats.speculated for r in runs)
    assert sum(r.stats.drafted for r in runs) > used
    for r in (seeded, off):
        assert r.stats.speculated == r.stats.speculated_used == 0
        assert r.token_ids == greedy_decode(target, "a", 24)

class _ThreadsSeen(SyntheticModel):
    """A synthetic draft that notes the thread each of its scoring calls ran in."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.threads: set[str] = set()

    def score(self, batch: Any) -> Any:
        self.threads.add(threading.current_thread().name)
        return super().score(batch)


@pytest.mark.parametrize("ids", [256, LOOP_DRAFT_MAX_IDS + 1])
async def test_a_context_model_drafts_on_the_loop_only_over_a_short_vocabulary(
        ids: int) -> None:
    """A step of a context model costs about a nanosecond an id: over a short
    vocabulary the edge drafts on its event loop (cheaper than the hand-off), over a
    long one in its draft thread, so a round of long steps does not hold up the
    other generations' verdicts (nor an HTTP server on that loop)."""
    target = SyntheticModel(ids, name="synthetic")
    draft = _ThreadsSeen(target.vocab, skew=0.9, name="synthetic-draft")
    assert drafts_on_loop(draft) is (ids <= LOOP_DRAFT_MAX_IDS)
    async with (
        xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud,
        xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge,
    ):
        res = await edge.generate("ab", max_new_tokens=12, seed=1, ignore_eos=True)
    assert len(res.token_ids) == 12 and res.stats.drafted > 0
    if ids <= LOOP_DRAFT_MAX_IDS:
        assert draft.threads == {threading.current_thread().name}
    else:
        assert draft.threads and all(t.startswith("xcosd-draft") for t in draft.threads)
    # many simulated devices in one process keep any context model on the loop
    assert shared_process_draft_thread(draft) is False
    assert shared_process_draft_thread(Sleepy(draft, 0.0)) is None


def test_the_embedded_pairs_draft_is_not_drafted_on_the_loop() -> None:
    draft, _ = default_pair()  # n-gram over o200k: 200k ids, about 340 us a step
    assert not drafts_on_loop(draft)
    assert xcosd.EdgeNode(draft=draft, connect="tcp://127.0.0.1:9").draft_thread
    assert not xcosd.EdgeNode(draft=draft, connect="tcp://127.0.0.1:9",
                              draft_thread=False).draft_thread


@pytest.mark.parametrize("merge", [True, False])
async def test_a_partial_batch_waits_for_the_sessions_just_answered(merge: bool) -> None:
    """Eight devices that answer within milliseconds, against a target whose call
    costs 30 ms whatever its size, start in two groups of four. Started as soon as
    the target is free, the queued group's batch leaves the group just answered to
    queue behind it: the groups take turns in half batches for good, paying the
    30 ms twice per cycle. Holding a partial batch for the sessions just answered
    (``xcosd/nodes/merging.py``; the fixed cost and the time they take to come back
    are measured) merges them into whole batches. Greedy output is the target's
    own either way."""
    target, draft = pair()
    prompts = ["a", "ab", "abc", "cd", "dd", "bca", "ca", "b"]
    slow = Sleepy(target, 0.03)
    async with xcosd.CloudNode(target=slow, bind="tcp://127.0.0.1:0",
                               merge_batches=merge) as cloud:
        edges = [xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, temperature=0.0,
                                method="xcosd-e") for _ in range(8)]
        try:
            await asyncio.gather(*[e.start() for e in edges])

            async def run(i: int) -> Any:
                return await edges[i].generate(prompts[i], max_new_tokens=160)

            first = [asyncio.create_task(run(i)) for i in range(4)]
            # the second group starts while the first group's first batch computes
            await until(lambda: slow.calls >= 1, "the first group's first batch")
            second = [asyncio.create_task(run(i)) for i in range(4, 8)]
            async with asyncio.timeout(HANG_S):
                results = await asyncio.gather(*first, *second)
        finally:
            await asyncio.gather(*[e.close() for e in edges])
        stats = await closed_sessions_settle(cloud)
    for i, r in enumerate(results):
        assert r.token_ids == greedy_decode(target, prompts[i], 160), i
    hist = {int(k): v for k, v in stats["scheduler"]["batch_size_histogram"].items()}
    rounds = sum(k * v for k, v in hist.items())
    whole = sum(k * v for k, v in hist.items() if k >= 7) / rounds
    held = stats["scheduler"]["merge"]
    if merge:
        assert held["holds"] > 0 and held["fixed_cost_s"] is not None
        assert whole > 0.5, hist
    else:
        assert held is None
        # two groups taking turns, each batch paying the call: a mean batch of about
        # half the devices (4 + 4, or, once one device's draft reached the idle
        # target ahead of its group's, 1 + 7)
        assert rounds / sum(hist.values()) < 5, hist


@pytest.mark.parametrize("transport", ["zmq", "tcp"])
async def test_generate_stream_and_stats(transport: str) -> None:
    target, draft = pair(eos_mass=0.02)
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0",
                               transport=transport) as cloud:
        assert not cloud.endpoint.endswith(":0")
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, transport=transport,
                                  method="xcosd-e", codec="f32") as edge:
            res = await edge.generate("ab", max_new_tokens=40, temperature=1.0, top_k=0,
                                      top_p=1.0, seed=7)
            again = await edge.generate("ab", max_new_tokens=40, seed=7)
            assert again.token_ids == res.token_ids  # same seed, same tokens
            pieces = [p async for p in edge.stream("ab", max_new_tokens=40, seed=7)]
            assert "".join(pieces) == res.text
            empty = await edge.generate("", max_new_tokens=5, seed=1)
            zero = await edge.generate("abc", max_new_tokens=0)
            other = await edge.generate("ab", max_new_tokens=30, method="xcosd", codec="q8",
                                        draft_len=2, hr_presample=False, seed=3)
    st = res.stats
    assert res.token_ids and all(0 <= t < target.vocab.size for t in res.token_ids)
    assert res.text == target.vocab.decode(res.token_ids).decode()
    assert st.tokens == len(res.token_ids) <= 40
    assert st.finish_reason in ("length", "stop")
    if st.finish_reason == "stop":
        assert res.token_ids[-1] == TARGET_EOS
    assert st.rounds == st.target_calls > 0
    assert st.acceptance_rate == pytest.approx(st.accepted / st.drafted)
    assert st.mean_acceptance_length == pytest.approx(1 + st.accepted / st.rounds)
    assert st.uplink_by_type["draft"] > 0 and st.downlink_by_type["verdict"] > 0
    assert st.uplink_bytes == sum(st.uplink_by_type.values())
    # round 0 rode on the open, and its verdict answered both: no "opened" came
    # back, and every message down is a round's verdict or a follow-up's reply
    assert "opened" not in st.downlink_by_type
    assert st.messages_down == st.rounds + st.extra_round_trips
    assert zero.stats.downlink_by_type.keys() == {"opened"}  # nothing to draft: plain open
    assert st.wall_s > 0 and st.cloud_compute_s > 0
    assert len(empty.token_ids) <= 5 and zero.token_ids == [] and zero.text == ""
    assert other.stats.method == "xcosd" and other.stats.codec == "q8"
    assert other.stats.drafted <= 2 * other.stats.rounds


async def test_modeled_time_uses_the_link() -> None:
    target, draft = pair()
    link = xcosd.LinkSpec.of(up_bps=1e6, down_bps=1e6, rtt_s=0.01)
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, link=link) as edge:
        res = await edge.generate("a", max_new_tokens=10, seed=2)
    st = res.stats
    # every message costs at least RTT/2 plus its bytes at 1 Mbps
    floor = (st.messages_up + st.messages_down - 1) * 0.005
    assert st.modeled_s >= floor
    assert st.wall_s >= 0.01 * st.rounds  # the emulated link really delayed the rounds


async def test_wrong_target_vocabulary_is_refused() -> None:
    target, draft = pair()
    other = Vocabulary("other", [b"x", b"y", b"z"])
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud:
        edge = xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, target_vocab=other,
                              connect_timeout_s=HANG_S)  # only bounds a hang
        with pytest.raises(VocabError):
            await edge.start()
        await edge.close()
        # with the right one given, nothing is fetched from the cloud
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint,
                                  target_vocab=target.vocab) as edge2:
            res = await edge2.generate("a", max_new_tokens=4)
            assert len(res.token_ids) == 4
        assert "vocab" not in cloud.stats()["bytes"]["down"]


async def test_busy_cloud_makes_edges_wait_not_fail() -> None:
    target, draft = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", max_sessions=2) as cloud:
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint,
                                  busy_retry_s=0.01) as edge:
            results = await asyncio.gather(*[edge.generate("a", max_new_tokens=20, seed=i)
                                             for i in range(8)])
        stats = cloud.stats()
    assert all(len(r.token_ids) == 20 for r in results)
    assert sum(r.stats.busy_retries for r in results) > 0
    assert stats["errors_by_code"].get("busy", 0) > 0


async def test_prometheus_endpoint() -> None:
    target, draft = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", metrics_port=0) as cloud:
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge:
            await edge.generate("a", max_new_tokens=10)
        url = cloud.metrics_endpoint
        assert url is not None
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # the body is read to EOF: without Connection: close the server keeps the
        # connection open for a next request (until its idle deadline, seconds)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        body = (await reader.read()).decode()
        writer.close()
        await writer.wait_closed()
    assert body.startswith("HTTP/1.1 200")
    for name in ("xcosd_spec_decode_num_accepted_tokens_total",
                 "xcosd_spec_decode_num_draft_tokens_total", "xcosd_batch_size_bucket",
                 "xcosd_num_sessions_running", "xcosd_wire_bytes_total"):
        assert name in body
    drafted = [ln for ln in body.splitlines()
               if ln.startswith("xcosd_spec_decode_num_draft_tokens_total ")]
    assert float(drafted[0].split()[1]) > 0


async def test_curve_admits_allowlisted_devices_only() -> None:
    from xcosd.errors import TransportError

    target, draft = pair()
    server, device, stranger = (xcosd.KeyPair.generate() for _ in range(3))
    curve = xcosd.CurveServer(server, {device.public})
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", curve=curve) as cloud:
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint,
                                  curve=xcosd.CurveClient(device, server.public)) as edge:
            res = await edge.generate("ab", max_new_tokens=8, seed=1)
            assert len(res.token_ids) == 8
            # CURVE framing is counted in the wire bytes
            assert res.stats.uplink_bytes > 8 * res.stats.messages_up
        intruder = xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, connect_timeout_s=0.6,
                                  silence_timeout_s=0.3,
                                  curve=xcosd.CurveClient(stranger, server.public))
        with pytest.raises(TransportError):
            await intruder.start()
        await intruder.close()
        assert cloud.stats()["sessions_opened"] == 1


class _ThreadRecordingTarget:
    """The test pair's target, recording which thread ran each batch; ``cost`` is
    what a batch takes besides: ``("sleep", s)`` waits (a GPU, say), ``("spin", s)``
    computes."""

    def __init__(self, inner: object, cost: tuple[str, float] | None = None) -> None:
        self.inner, self.cost = inner, cost
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def score(self, batch: object) -> object:
        import threading
        import time

        self.threads.append(threading.current_thread().name)
        if self.cost is not None:
            kind, s = self.cost
            if kind == "sleep":
                time.sleep(s)
            else:
                end = time.perf_counter() + s
                while time.perf_counter() < end:
                    pass
        return self.inner.score(batch)  # type: ignore[attr-defined]


@pytest.mark.parametrize("cost, inline", [(None, True), (("sleep", 0.003), False),
                                          (("spin", 0.012), False)])
async def test_cheap_batches_run_on_the_loop_real_ones_in_the_thread(
        cost: tuple[str, float] | None, inline: bool) -> None:
    """A near-free target's batches run on the event loop once measured; one whose
    batches wait (a GPU) or compute for longer than a switch interval keeps the
    worker thread. The output is the same either way."""
    target, draft = pair()
    rec = _ThreadRecordingTarget(target, cost)
    async with (xcosd.CloudNode(target=rec, bind="tcp://127.0.0.1:0") as cloud,  # type: ignore[arg-type]
                xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge):
        res = await edge.generate("ab", max_new_tokens=40, temperature=0.0)
    assert res.token_ids == greedy_decode(target, "ab", 40)
    on_loop = sum(t == "MainThread" for t in rec.threads)
    assert rec.threads[0] != "MainThread"  # nothing measured yet: the thread
    if inline:
        assert on_loop >= len(rec.threads) - 2, rec.threads
    else:
        assert on_loop == 0, rec.threads


async def test_an_idle_edge_keeps_pinging() -> None:
    """An edge skips its ping while rounds flow both ways (each side has just heard
    from the other); an idle one still pings every heartbeat."""
    target, draft = pair()
    async with (xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0",
                                heartbeat_s=0.05) as cloud,
                xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge):
        res = await edge.generate("ab", max_new_tokens=40, temperature=0.0)
        assert res.token_ids == greedy_decode(target, "ab", 40)

        def pings() -> int:
            return int(cloud.stats()["bytes"]["up"].get("ping", {}).get("messages", 0))

        before = pings()
        await until(lambda: pings() >= before + 3, "an idle edge to ping")
