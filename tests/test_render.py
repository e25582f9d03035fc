"""Prompts made into target ids by the cloud's target (``render`` / ``rendered``):
``EdgeNode.tokenize`` and ``EdgeNode.chat_prompt`` over real ZeroMQ, and what the
cloud does with render requests that are malformed, hostile or impossible."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

import xcosd
from xcosd.errors import ProtocolError
from xcosd.models import default_pair
from xcosd.models.chat import plain_chat
from xcosd.protocol import Error, Render, Rendered, pack
from xcosd.protocol.messages import MAX_CHAT, MAX_TEXT, from_wire
from xcosd.transport import connect

from .helpers.gated import GatedModel
from .helpers.raw import handshake, reply
from .helpers.waits import until
from .session_pairs import pair


def test_render_messages_are_checked() -> None:
    def decode(h: dict) -> object:
        return from_wire({"t": "render", "n": 1, **h}, [])

    assert decode({"text": "hi"}) == Render(1, text="hi")
    assert decode({"chat": [["user", "hi"]]}) == Render(1, chat=(("user", "hi"),))
    for bad in ({}, {"text": "a", "chat": [["user", "b"]]}, {"chat": []},
                {"chat": [["wizard", "x"]]}, {"chat": [["user", 3]]}, {"chat": [["user"]]},
                {"chat": "user: hi"}, {"chat": [["user", "x"]] * (MAX_CHAT + 1)},
                {"chat": [["user", "x" * (MAX_TEXT // 2 + 1)]] * 2}, {"text": 5}):
        with pytest.raises(ProtocolError) as e:
            decode(bad)
        assert e.value.code == "bad_field", bad


async def test_tokenize_and_chat_prompt_are_the_targets() -> None:
    draft, target = default_pair()
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What does sorted() return?"}]
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge:
        text = "Return a new list containing all items"
        assert await edge.tokenize(text) == target.tokenize(text)
        ids = await edge.chat_prompt(msgs)
        assert ids == target.chat_prompt(msgs) == target.tokenize(plain_chat(msgs))
        # many at once on one connection: each gets its own answer
        texts = [f"item {i} of the list" for i in range(40)]
        got = await asyncio.gather(*[edge.tokenize(t) for t in texts])
        assert got == [target.tokenize(t) for t in texts]
        # a generation from the ids is the generation from the text
        a = await edge.generate(text, max_new_tokens=12, seed=4)
        b = await edge.generate(await edge.tokenize(text), max_new_tokens=12, seed=4)
        assert a.token_ids == b.token_ids
        with pytest.raises(ValueError, match="role"):
            await edge.chat_prompt([{"role": "tool", "content": "x"}])
        assert cloud.stats()["renders"] == 43


async def test_a_target_without_a_template_is_a_typed_error_and_the_cloud_serves_on() -> None:
    target, draft = pair()
    plain = GatedModel(target)  # no chat_prompt: no template
    plain.gate.set()
    async with xcosd.CloudNode(target=plain, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge:
        with pytest.raises(ProtocolError) as e:
            await edge.chat_prompt([{"role": "user", "content": "hi"}])
        assert e.value.code == "unsupported" and "no chat template" in e.value.message
        assert await edge.tokenize("ab") == target.tokenize("ab")
        res = await edge.generate("ab", max_new_tokens=5, seed=1)
        assert len(res.token_ids) == 5
        assert cloud.stats()["errors_by_code"] == {"unsupported": 1}


async def test_hostile_render_requests_get_typed_errors() -> None:
    target, draft = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as honest:
        conn = await connect(cloud.endpoint)
        try:
            # before the handshake: refused as any message would be
            await conn.send(pack(Render(1, text="ab")))
            first = await reply(conn)
            assert isinstance(first, Error) and first.code == "handshake"
            await handshake(conn, draft)
            for header, code in [
                    ({"t": "render", "n": 2}, "bad_field"),
                    ({"t": "render", "n": -1, "text": "x"}, "bad_field"),
                    ({"t": "render", "n": 3, "chat": [["root", "x"]]}, "bad_field"),
                    ({"t": "render", "n": 4, "chat": {"user": "x"}}, "bad_field")]:
                await conn.send([msgpack.packb(header)])
                m = await reply(conn)
                assert isinstance(m, Error) and m.code == code, (header, m)
            # a good one still works on the same connection, and the honest edge too
            await conn.send(pack(Render(9, text="abc")))
            m = await reply(conn)
            assert isinstance(m, Rendered) and m.n == 9
            assert m.ids.tolist() == target.tokenize("abc")
            # a chat the target cannot tokenise (the table's few letters lack "U"):
            # an error that names the request, and the connection carries on
            await conn.send(pack(Render(10, chat=(("user", "ab"),))))
            m = await reply(conn)
            assert isinstance(m, Error) and m.n == 10 and m.code == "vocab"
            res = await honest.generate("ab", max_new_tokens=4, seed=2)
            assert len(res.token_ids) == 4
        finally:
            await conn.close()


class SlowTokenizer(GatedModel):
    """A target whose tokenizer takes 30 ms for a text starting with ``"slow"`` and
    records the order it tokenised texts in."""

    def __init__(self, inner: object) -> None:
        super().__init__(inner)
        self.gate.set()
        self.texts: list[str] = []

    def tokenize(self, text: str) -> list[int]:
        self.texts.append(text)
        if text.startswith("slow"):
            time.sleep(0.03)
        return self.inner.tokenize(text[4:] if text.startswith("slow") else text)


async def test_renders_are_served_round_robin_across_peers() -> None:
    target, draft = pair()
    slow = SlowTokenizer(target)
    async with xcosd.CloudNode(target=slow, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as honest:
        conn = await connect(cloud.endpoint)
        try:
            await handshake(conn, draft)
            seen = cloud.stats()["messages"]
            for n in range(30):  # one peer queues 30 slow renders at once
                await conn.send(pack(Render(n, text="slowab")))
            await until(lambda: cloud.stats()["messages"] >= seen + 30, "all 30 queued")
            # another peer's render is served after at most one more of them, not 30
            assert await honest.tokenize("abc") == target.tokenize("abc")
            assert slow.texts.index("abc") <= 2, slow.texts[:5]
            answers = [await reply(conn) for _ in range(30)]
            assert sorted(m.n for m in answers if isinstance(m, Rendered)) == list(range(30))
        finally:
            await conn.close()
