"""Chat prompts (``render`` / ``rendered``) when things go wrong, over real ZeroMQ:
a chat of legal size that renders to more ids than an answer may carry, a link that
loses messages, and a broker whose replica dies between two requests. Every case
ends in the target's ids or a typed error, never in a silent wait for the deadline.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import xcosd
from xcosd.errors import ProtocolError
from xcosd.models import default_pair
from xcosd.nodes import Broker
from xcosd.protocol import Error, Render, Rendered, pack
from xcosd.protocol.messages import MAX_CHAT, MAX_RESUME, MAX_TEXT
from xcosd.transport import connect
from xcosd.transport.link import LinkSpec

from .helpers.raw import handshake, reply
from .helpers.waits import HANG_S, until

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does sorted() return?"}]


async def test_a_chat_that_renders_past_the_answers_bound_is_refused_too_large() -> None:
    """MAX_CHAT messages whose contents fill MAX_TEXT exactly are a legal request,
    but the template's words around each message take the ids past MAX_RESUME: the
    cloud answers ``too_large`` at once (sent anyway, the edge would drop the answer
    as malformed and ask again until its deadline), and serves on."""
    draft, target = default_pair()
    content = "qz" * (MAX_TEXT // MAX_CHAT // 2)  # no merges: one id a byte
    msgs = [{"role": ("user", "assistant")[i % 2], "content": content}
            for i in range(MAX_CHAT)]
    assert sum(len(m["content"].encode()) for m in msgs) == MAX_TEXT
    assert len(target.chat_prompt(msgs)) > MAX_RESUME
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, resend_after_s=HANG_S) as edge:
        t0 = time.monotonic()
        with pytest.raises(ProtocolError) as e:
            await edge.chat_prompt(msgs, timeout_s=HANG_S)
        assert e.value.code == "too_large" and str(MAX_RESUME) in e.value.message
        assert time.monotonic() - t0 < HANG_S / 2  # the answer, not the deadline
        assert cloud.stats()["renders"] == 1  # rendered once, not once per resend
        assert cloud.stats()["errors_by_code"] == {"too_large": 1}
        assert await edge.chat_prompt(CHAT) == target.chat_prompt(CHAT)
        res = await edge.generate(await edge.chat_prompt(CHAT), max_new_tokens=6, seed=3)
        assert res.token_ids and res.stats.finish_reason in ("length", "stop")


async def test_renders_over_a_lossy_link_are_asked_again_until_answered() -> None:
    """A third of all messages lost each way: each of many concurrent requests is
    sent again until its answer gets through, and each caller gets its own ids."""
    draft, target = default_pair()
    chats = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
             for i in range(12)]
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud:
        edge = xcosd.EdgeNode(draft=draft, connect=cloud.endpoint,
                              link=LinkSpec.of(loss=0.33, seed=11), silence_timeout_s=5.0,
                              connect_timeout_s=HANG_S, resend_after_s=0.05)
        async with edge:
            got = await asyncio.gather(*(edge.chat_prompt(c, timeout_s=HANG_S)
                                         for c in chats))
        assert got == [target.chat_prompt(c) for c in chats]
        # some request or answer was lost and the request sent again
        assert cloud.stats()["renders"] > len(chats)


async def test_chats_render_on_any_replica_behind_the_broker() -> None:
    """The broker forwards a connection's messages unread, so a render reaches the
    edge's replica like any other message, and every replica renders alike. When
    that replica dies, the next request is re-pinned, told ``handshake``, and the
    edge connects again and asks the new replica."""
    draft, target = default_pair()
    want = target.chat_prompt(CHAT)
    async with Broker(front="tcp://127.0.0.1:0") as broker:
        victim = await xcosd.CloudNode(target=target, bind=broker.back_endpoint,
                                       transport="replica", silence_timeout_s=HANG_S,
                                       transport_options={"goodbye": False}).start()
        survivor = await xcosd.CloudNode(target=target, bind=broker.back_endpoint,
                                         transport="replica", silence_timeout_s=HANG_S).start()
        try:
            await until(lambda: broker.stats()["replicas_live"] == 2, "both replicas")
            edges = [await xcosd.EdgeNode(draft=draft, connect=broker.endpoint,
                                          heartbeat_s=0.05, silence_timeout_s=HANG_S,
                                          resend_after_s=0.2).start() for _ in range(2)]
            try:
                # the least loaded replica takes each new edge: one each
                assert {e.server_id for e in edges} == {victim.server_id, survivor.server_id}
                assert await asyncio.gather(*(e.chat_prompt(CHAT) for e in edges)) == [want] * 2
                assert victim.stats()["renders"] == survivor.stats()["renders"] == 1
                await victim.close()  # no goodbye: as a killed process
                for e in edges:
                    assert await e.chat_prompt(CHAT, timeout_s=HANG_S) == want
                assert all(e.server_id == survivor.server_id for e in edges)
                assert survivor.stats()["renders"] >= 3
                res = await edges[0].generate(want, max_new_tokens=5, seed=1)
                assert res.token_ids and res.stats.resumes == 0
            finally:
                for e in edges:
                    await e.close()
        finally:
            await victim.close()
            await survivor.close()


async def test_many_concurrent_renders_on_one_node_each_get_their_own_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """More callers at once on one node (an HTTP server's chat requests) than the
    cloud takes from one connection: the node keeps a bounded number at the cloud
    and queues the rest, so none is refused; where the cloud is at its bound anyway
    (made 2 here), its ``busy`` answers are asked again after a pause, as a
    generation's are."""
    import xcosd.nodes.cloud_renders as cloud_renders

    draft, target = default_pair()
    chats = [[{"role": "user", "content": f"question {i}"}] for i in range(120)]
    want = [target.chat_prompt(c) for c in chats]
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, busy_retry_s=0.01) as edge:
        assert await asyncio.gather(*(edge.chat_prompt(c) for c in chats)) == want
        assert cloud.stats()["renders"] == len(chats)
        assert cloud.stats()["errors_by_code"] == {}
        monkeypatch.setattr(cloud_renders, "MAX_RENDERS_PER_PEER", 2)
        assert await asyncio.gather(*(edge.chat_prompt(c) for c in chats[:20])) == want[:20]
        assert cloud.stats()["errors_by_code"]["busy"] > 0


async def test_answers_sent_the_wrong_way_are_refused_and_the_cloud_serves_on() -> None:
    """A peer that sends the cloud a ``rendered`` (an answer it never asks for) is
    told ``unknown_type``; an ``error`` naming a render is only counted; the same
    connection's next request is answered, and so is an honest edge's."""
    draft, target = default_pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as honest:
        conn = await connect(cloud.endpoint)
        try:
            await handshake(conn, draft)
            await conn.send(pack(Rendered(3, np.array([1, 2], np.int64))))
            m = await reply(conn)
            assert isinstance(m, Error) and m.code == "unknown_type" and m.n is None
            await conn.send(pack(Error("unsupported", "not from a cloud", n=4)))
            await conn.send(pack(Render(5, chat=(("user", "hi"),))))
            m = await reply(conn)  # the error got no answer: this is the render's
            assert isinstance(m, Rendered) and m.n == 5
            assert m.ids.tolist() == target.chat_prompt([{"role": "user", "content": "hi"}])
        finally:
            await conn.close()
        assert await honest.chat_prompt(CHAT) == target.chat_prompt(CHAT)
