"""Three ``xcosd serve`` processes behind a real HAProxy (Debian's package; ``make
setup`` installs it where it is missing), in TCP mode with HTTP checks of each
cloud's ``/health`` (the configuration of docs/DEPLOY.md, from
xcosd/bench/haproxy_fleet.py).

A ``xcosd bench load --connect`` run of 32 devices goes through the balancer while
one cloud is drained with SIGTERM and another is killed with SIGKILL and started
again: no error, every generation equal to the target's greedy decode, the
drained cloud gone within its deadline, and the connections spread over the three
(the balancer's counts and the clouds' own). Then the law: 1,500 sampled
generations (T=1) through the balancer while a cloud is killed; the first token's
law is the target's (chi-square and TV, tests/helpers/stats.py).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import numpy as np

import xcosd
from xcosd.bench.haproxy_fleet import Balanced, Process, haproxy_binary
from xcosd.models import SyntheticModel, load_model

from .helpers.stats import assert_exact
from .helpers.waits import HANG_S, until

#: the deadline the drained cloud gets (it must be gone within it, plus a start-up
#: margin for the process's own exit)
DRAIN_S = 2.0
#: generations in the law test (as the replica fault law test: tests/test_e2e_exactness.py)
N_LAW = 1_500
#: the law test's target and prompt (target ids)
LAW_TARGET = "synthetic:16"
PROMPT = [3]


def test_haproxy_is_installed() -> None:
    # `make setup` installs it; a machine without it fails here, it does not skip
    assert haproxy_binary() is not None, "haproxy is missing: run `make setup`"


async def _wait_status(b: Balanced, name: str, status: str) -> None:
    async def seen() -> bool:
        return (await asyncio.to_thread(b.server_stats))[name]["status"].startswith(status)

    deadline = time.monotonic() + HANG_S
    while not await seen():
        assert time.monotonic() < deadline, f"HAProxy never saw {name} {status}"
        await asyncio.sleep(0.05)


async def test_a_load_run_through_haproxy_survives_a_drain_and_a_kill(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    async with Balanced(3, "synthetic:256:10:0.5", drain_timeout_s=DRAIN_S) as b:
        bench = Process([sys.executable, "-m", "xcosd", "bench", "load", "--connect", b.endpoint,
                         "--target", "synthetic:256", "--greedy", "--check-greedy",
                         "-n", "32", "--duration", "7", "--warmup", "1",
                         "--max-new-tokens", "32", "--timeout", "60", "--json", str(out)])
        await bench.start()
        try:
            async def connected() -> int:
                rows = (await asyncio.to_thread(b.server_stats)).values()
                return sum(int(r["scur"] or 0) for r in rows)

            deadline = time.monotonic() + HANG_S
            while await connected() < 32:
                assert bench.running and time.monotonic() < deadline, "\n".join(bench.lines[-20:])
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.5)
            drained, killed, kept = b.clouds
            t0 = time.monotonic()
            drained.process.send(signal.SIGTERM)
            await _wait_status(b, drained.backend.name, "DOWN")
            rc = await drained.process.wait(HANG_S)
            gone_s = time.monotonic() - t0
            killed.process.send(signal.SIGKILL)
            await killed.process.wait(HANG_S)
            await asyncio.sleep(0.5)
            await killed.start()  # the same ports: the balancer takes it back
            await _wait_status(b, killed.backend.name, "UP")
            assert await bench.wait(HANG_S) == 0, "\n".join(bench.lines[-20:])
            counts = await asyncio.to_thread(b.server_stats)
            await kept.process.stop()
        finally:
            if bench.running:
                await bench.stop(signal.SIGKILL)
    rep = json.loads(out.read_text())
    assert rc == 0 and gone_s < DRAIN_S + 3.0, (rc, gone_s, drained.process.lines[-10:])
    drain = json.loads(next(ln for ln in drained.process.lines
                            if ln.startswith("drained: "))[len("drained: "):])
    assert drain["sessions_at_start"] == drain["finished"] + drain["handed_off"]
    assert drain["ended_otherwise"] == 0
    assert rep["errors_total"] == 0, rep["error_messages"]
    assert rep["exact"]["mismatched"] == 0 and rep["exact"]["checked"] >= 64, rep["exact"]
    assert rep["exact"]["equal"] == rep["exact"]["checked"]
    assert rep["resumed_generations"] >= 1  # the killed cloud's generations moved
    # the spread: every cloud was given connections, and served sessions itself
    assert all(int(counts[c.backend.name]["stot"]) > 0 for c in b.clouds), counts
    for c in (drained, kept):
        stats = c.process.exit_stats()
        assert stats is not None and stats["sessions_opened"] > 0, c.process.lines[-5:]


async def test_the_first_token_law_holds_through_haproxy_with_a_cloud_killed() -> None:
    # a small vocabulary, so N_LAW samples bound the TV tightly; the prompt is target ids
    free = load_model(LAW_TARGET)
    draft = SyntheticModel(free.vocab, skew=0.9, name="draft")
    sess = free.start(PROMPT)
    row = np.asarray(free.score([(sess, [])])[0][-1], dtype=np.float64)
    free.end(sess)
    async with Balanced(3, LAW_TARGET) as b:
        edges = [xcosd.EdgeNode(draft=draft, connect=b.endpoint, target_vocab=free.vocab,
                                heartbeat_s=0.2, silence_timeout_s=HANG_S) for _ in range(6)]
        for e in edges:
            await e.start()
        try:
            firsts: list[int] = []
            resumed = 0
            todo = iter(range(N_LAW))
            killed_at = N_LAW // 2

            async def worker(e: xcosd.EdgeNode) -> None:
                nonlocal resumed
                for i in todo:
                    res = await e.generate(PROMPT, max_new_tokens=2, seed=i, timeout_s=HANG_S)
                    firsts.append(res.token_ids[0])
                    resumed += res.stats.resumes

            async def fault() -> None:
                await until(lambda: len(firsts) >= killed_at, "half the generations")
                victim = b.clouds[0]
                victim.process.send(signal.SIGKILL)
                await victim.process.wait(HANG_S)
                await victim.start()

            await asyncio.wait_for(asyncio.gather(
                *(worker(e) for e in edges for _ in range(8)), fault()), 4 * HANG_S)
        finally:
            for e in edges:
                await e.close()
    assert len(firsts) == N_LAW
    assert resumed >= 1 or sum(e.reconnects for e in edges) >= 1  # the kill was felt
    assert_exact(firsts, row / row.sum(), "first token through HAProxy, a cloud killed")
