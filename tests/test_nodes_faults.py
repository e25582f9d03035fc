"""Faults over real ZeroMQ: a device that vanishes mid-round has its session and
model state freed once it times out; a cloud killed and restarted on the same
endpoint mid-generation loses and repeats no token.

Nothing here sleeps to let something happen: the target holds its calls at a gate
the test opens, the test waits for states, and a timeout is made to expire with
:meth:`CloudNode.reap` rather than waited out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import numpy as np

import xcosd
from xcosd.errors import TransportError
from xcosd.methods.base import Draft
from xcosd.protocol import DraftMsg, Open, pack
from xcosd.transport import connect

from .helpers.gated import GatedModel
from .helpers.raw import handshake, reply
from .helpers.waits import HANG_S, until
from .session_pairs import greedy_decode, pair


async def test_a_device_that_vanishes_mid_round_is_freed() -> None:
    target, draft = pair()
    gated = GatedModel(target, hold_score=True)
    # a timeout the reaper task never reaches in this test: the test expires it
    async with xcosd.CloudNode(target=gated, bind="tcp://127.0.0.1:0",
                               silence_timeout_s=HANG_S) as cloud:
        try:
            conn = await connect(cloud.endpoint)
            vmap = await handshake(conn, draft)
            await conn.send(pack(Open(1, 0, vmap.fingerprint, "xcosd", "f32", {}, 1.0, 0, 1.0,
                                      1, "ab", 50)))
            assert (await reply(conn)).TYPE == "opened"
            c = int(vmap.common_target_ids[0])
            await conn.send(pack(DraftMsg(1, 1, 0, None, Draft(
                ids=np.array([c, c]), q_values=np.array([0.5, 0.5], dtype=np.float32)))))
            await until(gated.in_score.is_set, "the round's batch to be computing")
            await conn.close()  # gone in the middle of the round, without a goodbye
            # ZeroMQ tells the cloud nothing: only the timeout can free the session
            assert cloud.stats()["sessions_active"] == 1
            assert await cloud.reap() == 0  # the peer spoke a moment ago
            assert await cloud.reap(time.monotonic() + cloud.silence_timeout_s + 1.0) == 1
            st = cloud.stats()
            assert st["sessions_active"] == 0
            assert st["sessions_timed_out"] == 1 and st["peers"] == 0
            # the batch still runs on the session's model state: it is freed after
            assert gated.started == 1 and gated.ended == 0
        finally:
            gated.gate.set()
        await until(lambda: gated.ended == gated.started == 1,
                    "the vanished session's model state to be freed")
        # the cloud still serves
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge:
            assert len((await edge.generate("a", max_new_tokens=5)).token_ids) == 5


async def _restart(target: Any, endpoint: str) -> xcosd.CloudNode:
    """A new cloud bound to ``endpoint`` as soon as the port is free again: ZeroMQ
    releases a closed socket's port in its I/O thread, a moment after ``close``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_S
    while True:
        try:
            return await xcosd.CloudNode(target=target, bind=endpoint).start()
        except TransportError as e:
            if e.code != "address_in_use" or loop.time() > deadline:
                raise
        await asyncio.sleep(0.005)


async def test_cloud_restart_mid_generation_loses_no_token() -> None:
    target, draft = pair()
    want = target.vocab.decode(greedy_decode(target, "ab", 120)).decode()
    cloud = await xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0").start()
    endpoint = cloud.endpoint
    restarted = None
    try:
        # the edge learns of the restart from the new cloud's "handshake" answer to
        # its next ping (every 50 ms), not from a silence: its timeout only bounds a
        # hang, so a slow round on a loaded machine never looks like a lost cloud
        async with xcosd.EdgeNode(draft=draft, connect=endpoint, temperature=0.0,
                                  heartbeat_s=0.05, silence_timeout_s=HANG_S) as edge:
            first_server = edge.server_id
            text = ""
            async for piece in edge.stream("ab", max_new_tokens=120, method="xcosd-e"):
                text += piece
                if restarted is None and len(text) > 20:
                    await cloud.close()  # killed mid-generation
                    restarted = await _restart(target, endpoint)
            assert edge.resumes >= 1 and edge.server_id != first_server
        assert text == want
        assert restarted is not None and restarted.stats()["sessions_opened"] == 1
    finally:
        await cloud.close()
        if restarted is not None:
            await restarted.close()


async def test_session_closed_during_its_first_round_frees_its_model_state() -> None:
    target, draft = pair()
    gated = GatedModel(target, hold_start=True)
    async with (
        xcosd.CloudNode(target=gated, bind="tcp://127.0.0.1:0") as cloud,
        xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, method="xcosd",
                       target_vocab=target.vocab) as edge,
    ):
        try:
            task = asyncio.create_task(edge.generate("ab", max_new_tokens=8, seed=0))
            await until(gated.in_start.is_set,
                        "the cloud's worker to be inside start() for this session")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # the close reaches the cloud while start() still holds the worker
            await until(lambda: cloud.stats()["sessions_closed"] == 1,
                        "the cloud to close the cancelled session")
            assert gated.started == 0
        finally:
            gated.gate.set()
        await until(lambda: gated.ended == 1, "the session's model state to be freed")
    assert gated.started == 1 and gated.ended == 1
