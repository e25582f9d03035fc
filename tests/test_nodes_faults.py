"""Faults over real ZeroMQ: a device that vanishes mid-round has its session and
model state freed within the timeout; a cloud killed and restarted on the same
endpoint mid-generation loses and repeats no token."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import xcosd
from xcosd.methods.base import Draft
from xcosd.protocol import DraftMsg, EdgeHandshake, Open, pack, unpack
from xcosd.transport import connect
from xcosd.vocab import VocabMap

from .session_pairs import greedy_decode, pair


class SlowModel:
    """A target that takes ``delay`` seconds per batched call (and ``start_delay`` to
    set up a session) and counts its sessions."""

    def __init__(self, inner: Any, delay: float, start_delay: float = 0.0) -> None:
        self.inner, self.delay, self.start_delay = inner, delay, start_delay
        self.name, self.vocab = inner.name, inner.vocab
        self.started = 0
        self.ended = 0

    def tokenize(self, text: str) -> list[int]:
        return self.inner.tokenize(text)

    def start(self, prompt_ids: Sequence[int]) -> Any:
        time.sleep(self.start_delay)
        self.started += 1
        return self.inner.start(prompt_ids)

    def score(self, batch: Any) -> list[np.ndarray]:
        time.sleep(self.delay)
        return self.inner.score(batch)

    def append(self, session: Any, ids: Sequence[int]) -> None:
        self.inner.append(session, ids)

    def rollback(self, session: Any, length: int) -> None:
        self.inner.rollback(session, length)

    def end(self, session: Any) -> None:
        self.ended += 1
        self.inner.end(session)


async def _wait_for(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


async def test_a_device_that_vanishes_mid_round_is_freed() -> None:
    target, draft = pair()
    slow = SlowModel(target, 0.3)
    async with xcosd.CloudNode(target=slow, bind="tcp://127.0.0.1:0", timeout_s=0.5) as cloud:
        conn = await connect(cloud.endpoint)
        hs = EdgeHandshake(lambda tv: VocabMap(draft.vocab, tv))
        pending = [hs.hello()]
        while not hs.ready:
            for m in pending:
                await conn.send(pack(m))
            pending = hs.receive(unpack(await asyncio.wait_for(conn.recv(), 5)))
        vmap = hs.vmap
        assert vmap is not None
        await conn.send(pack(Open(1, 0, vmap.fingerprint, "xcosd", "f32", {}, 1.0, 0, 1.0, 1,
                                  "ab", 50)))
        assert unpack(await asyncio.wait_for(conn.recv(), 5)).TYPE == "opened"
        c = int(vmap.common_target_ids[0])
        await conn.send(pack(DraftMsg(1, 1, 0, None, Draft(ids=np.array([c, c]),
                                      q_values=np.array([0.5, 0.5], dtype=np.float32)))))
        assert await _wait_for(lambda: cloud.stats()["scheduler"].get("batches", 0) > 0
                               or slow.started > 0, 5)
        await conn.close()  # gone in the middle of the round, without a goodbye
        assert cloud.stats()["sessions_active"] == 1
        assert await _wait_for(lambda: cloud.stats()["sessions_active"] == 0, 3)
        assert await _wait_for(lambda: slow.ended == slow.started == 1, 3)
        st = cloud.stats()
        assert st["sessions_timed_out"] == 1 and st["peers"] == 0
        # the cloud still serves
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge:
            assert len((await edge.generate("a", max_new_tokens=5)).token_ids) == 5


async def test_cloud_restart_mid_generation_loses_no_token() -> None:
    target, draft = pair()
    slow = SlowModel(target, 0.01)
    want = target.vocab.decode(greedy_decode(target, "ab", 120)).decode()
    cloud = await xcosd.CloudNode(target=slow, bind="tcp://127.0.0.1:0").start()
    endpoint = cloud.endpoint
    restarted = None
    try:
        async with xcosd.EdgeNode(draft=draft, connect=endpoint, temperature=0.0,
                                  heartbeat_s=0.05, timeout_s=1.0) as edge:
            first_server = edge.server_id
            text = ""
            async for piece in edge.stream("ab", max_new_tokens=120, method="xcosd-e"):
                text += piece
                if restarted is None and len(text) > 20:
                    await cloud.close()  # killed mid-generation
                    await asyncio.sleep(0.2)
                    restarted = await xcosd.CloudNode(target=slow, bind=endpoint).start()
            assert edge.resumes >= 1 and edge.server_id != first_server
        assert text == want
        assert restarted is not None and restarted.stats()["sessions_opened"] == 1
    finally:
        await cloud.close()
        if restarted is not None:
            await restarted.close()


async def test_session_closed_during_its_first_round_frees_its_model_state() -> None:
    from .session_pairs import pair

    target, draft = pair()
    slow = SlowModel(target, 0.0, start_delay=0.4)
    async with (
        xcosd.CloudNode(target=slow, bind="tcp://127.0.0.1:0") as cloud,
        xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, method="xcosd",
                       target_vocab=target.vocab) as edge,
    ):
        task = asyncio.create_task(edge.generate("ab", max_new_tokens=8, seed=0))
        await asyncio.sleep(0.2)  # the cloud is inside start() for this session
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert slow.started == 1 and slow.ended == 1
