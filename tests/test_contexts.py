"""A conversation's next turn by reference (``xcosd/protocol/contexts.py``): the
stores both ends keep, the law of generations whose prompt names a context the
cloud holds (through refusals when it holds it no more, restarts, lost and
duplicated messages), chat turns over ZeroMQ whose uplink carries the new turn
only, and hostile references."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import xcosd
from xcosd.models import default_pair
from xcosd.nodes.pump import Pump
from xcosd.protocol import Error, Open, Render, Rendered, pack
from xcosd.protocol.contexts import (
    Budget,
    ContextStore,
    RenderStore,
    common_text,
    ids_key,
    render_key,
)
from xcosd.sampling import SamplingParams, warp
from xcosd.transport import connect

from .helpers.faults import Faults, FaultyLink
from .helpers.law import bigram_law, check_law, committed_row
from .helpers.raw import handshake, reply
from .session_pairs import pair

# -- the stores ------------------------------------------------------------------------


def test_the_stores_name_by_content_and_keep_to_their_bounds() -> None:
    s = ContextStore(max_entries=3, max_tokens=100)
    a = s.put([1, 2, 3, 4])
    assert a == ids_key(np.array([1, 2, 3, 4])) and s.put([1, 2, 3, 4]) == a
    assert s.longest([1, 2, 3, 9, 9]) == (a, 3)
    assert s.longest([7]) is None and s.put([]) is None
    b, c = s.put([1, 2, 5]), s.put([8] * 50)
    assert s.longest([1, 2, 5, 6]) == (b, 3)
    s.get(a)  # used: b is the oldest now
    s.put([9] * 10)
    assert s.get(b) is None and s.get(a) is not None and len(s) == 3
    s.put(list(range(60)))  # past 100 tokens: the oldest go until it fits
    assert s.tokens <= 100 and s.get(c) is None
    assert s.put(list(range(101))) is None  # alone over the bound: not held

    r = RenderStore(max_entries=2, max_chars=40)
    chat = (("system", "be brief"), ("user", "hi"))
    k = r.put(None, chat, [5, 6, 7])
    assert k == render_key(None, chat) != render_key("be brief", None)
    assert r.longest(None, (*chat, ("assistant", "yo"))) == (k, 2)
    assert r.longest("be brief", None) is None  # a text never continues a chat
    t = r.put("once upon a time", None, [1])
    assert r.longest("once upon a mattress", None) == (t, 12)
    base = r.get(k)
    assert base is not None
    assert RenderStore.expand(base, 1, None, (("user", "x"),)) == (
        None, (("system", "be brief"), ("user", "x")))
    for keep, text, ch in ((3, None, ()), (0, None, ()), (1, "x", None)):
        with pytest.raises(ValueError):
            RenderStore.expand(base, keep, text, ch)
    assert common_text("abcdef", "abcxyz") == 3 and common_text("", "a") == 0


def test_the_clouds_connections_share_one_budget() -> None:
    """Past the cloud's budget a connection drops its own oldest entries, never
    another's, and holds nothing new when that is not enough; what a connection
    held goes back to the budget when it is cleared (its peer gone)."""
    budget = Budget(100)
    a, b = ContextStore(budget=budget), ContextStore(budget=budget)
    ka = a.put(list(range(60)))
    kb1 = b.put([7] * 30)
    assert budget.used == 90
    kb2 = b.put([8] * 30)  # over: b drops its own oldest, a keeps its context
    assert a.get(ka) is not None and b.get(kb1) is None and b.get(kb2) is not None
    assert b.put([9] * 50) is None and b.get(kb2) is not None  # alone too much: not held
    assert budget.used == 90
    a.clear()
    assert budget.used == 30 and b.put([9] * 50) is not None
    chars = Budget(10)
    r = RenderStore(budget=chars)
    assert r.put("0123456789a", None, [1]) is None and chars.used == 0


# -- the law through opens by reference ---------------------------------------------------

T1 = SamplingParams()
TOKENS = 3
#: the context the cloud holds (an earlier turn's): the prompt is its first KEEP ids
HELD = [0, 1, 2, 3, 5, 6]
KEEP = 4
N_LAW = 1_500  # TV about 0.1 at one step
N_CONTROL = 800


def _law(pump: Pump, prompt: list[int], method: str = "ar") -> np.ndarray:
    target: Any = pump.target
    return bigram_law(target.table, prompt, TOKENS,
                      lambda p: committed_row(method, "f32", warp(p, T1), pump.space))


def _by_reference(faulty: FaultyLink, method: str, n: int, seed: int, *, hold: float,
                  keep: int = KEEP, **kw: Any) -> np.ndarray:
    """``n`` generations whose prompt (``HELD[:KEEP]``) names ``HELD`` with ``keep``
    ids; before each, the cloud holds ``HELD`` with probability ``hold`` (else its
    open is refused ``no_context`` and goes again whole)."""
    rng = np.random.default_rng(seed)
    prompt = HELD[:KEEP]
    text = faulty.pump.target.vocab.decode(prompt).decode()
    seqs = np.empty((n, TOKENS), dtype=np.int64)
    for i in range(n):
        faulty.cloud.contexts.clear()
        if rng.random() < hold:
            faulty.cloud.contexts.put(HELD)
        es = faulty.generate(method, seed=seed + i, prompt=text, prompt_ids=prompt,
                             prompt_base=(ids_key(HELD), keep), max_new_tokens=TOKENS,
                             params=T1, draft_len=2, adaptive_draft=False, **kw)
        seqs[i] = es.token_ids
    return seqs


@pytest.fixture(scope="module")
def pump() -> Pump:
    return Pump(*pair())


@pytest.mark.slow
@pytest.mark.parametrize(("method", "tree"), [("xcosd-e", None), ("xcosd", None),
                                              ("xcosd-e", "2x2")])
def test_opens_by_reference_keep_the_law_through_refusals_and_faults(
        pump: Pump, method: str, tree: str | None) -> None:
    """Generations drafting from round 0 (the block rides on the open by reference),
    chains and trees: the cloud holds the named context or not, restarts (its
    stores gone with it), drops, duplicates and delays messages; every first token
    follows the target's law after the prompt the reference stands for."""
    faulty = FaultyLink(pump, Faults(), seed=60_000)
    events = len(faulty.events)
    seqs = _by_reference(faulty, method, N_LAW, 60_000, hold=0.7, tree=tree)
    report = check_law(seqs, _law(pump, HELD[:KEEP]))
    c = faulty.counts
    assert report.ok, f"{method} {tree} ({c}): {report}"
    refused = [e for e in faulty.events[events:] if getattr(e, "code", None) == "no_context"]
    assert len(refused) > N_LAW // 5 and c.restarts > 20 and c.duplicated > 20, c


@pytest.mark.slow
def test_a_reference_read_wrong_or_a_lossy_method_fails_the_same_check(pump: Pump) -> None:
    """The check sees the context: an edge that names the whole held context instead
    of its first KEEP ids (the prompt then ends with another token) fails it, and so
    does a lossy method named rightly."""
    faulty = FaultyLink(pump, Faults(drop=0, duplicate=0, delay=0, restart=0), seed=7)
    law = _law(pump, HELD[:KEEP])
    wrong = _by_reference(faulty, "xcosd-e", N_CONTROL, 70_000, hold=1.0, keep=len(HELD))
    assert not check_law(wrong, law).ok
    lossy = _by_reference(faulty, "target-resample", N_CONTROL, 80_000, hold=1.0)
    assert not check_law(lossy, law).ok


# -- chat turns over ZeroMQ ---------------------------------------------------------------


def _up(edge: Any, kind: str) -> int:
    t = edge.meter.up.get(kind)
    return 0 if t is None else t.payload


async def test_a_chats_next_turn_sends_the_new_turn_only_and_renders_the_same_ids() -> None:
    draft, target = default_pair()
    system = {"role": "system", "content": "You answer in one short sentence. " * 40}
    chat = [system, {"role": "user", "content": "What does sorted() return?"}]
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as fresh:
        ids1 = await edge.chat_prompt(chat)
        first = _up(edge, "render")
        g1 = await edge.generate(ids1, max_new_tokens=8, seed=1)
        turns = []
        for k in range(3):
            chat += [{"role": "assistant", "content": g1.text},
                     {"role": "user", "content": f"And question {k}?"}]
            before = _up(edge, "render"), edge.meter.down["rendered"].payload, _up(edge, "open")
            ids = await edge.chat_prompt(chat)
            assert ids == target.chat_prompt(chat)  # the same ids as a whole render
            g = await edge.generate(ids, max_new_tokens=8, seed=2 + k)
            turns.append((_up(edge, "render") - before[0],
                          edge.meter.down["rendered"].payload - before[1],
                          _up(edge, "open") - before[2], len(ids)))
            # the same output from another node with the same seed: its first open
            # sends the whole prompt, its next ones name its own earlier prompt and
            # send the rest
            sent = _up(fresh, "open")
            assert g.token_ids == (await fresh.generate(ids, max_new_tokens=8,
                                                        seed=2 + k)).token_ids
            if k == 0:
                assert _up(fresh, "open") - sent > 4 * len(ids)
            else:
                assert _up(fresh, "open") - sent < 4 * len(ids) / 2
        for up, down, opened, n in turns:
            assert up < first / 4  # the history (a long system prompt) stays home
            assert down < 4 * 40  # the new turn's ids (int32), not the history's
            assert opened < 200 < 4 * n  # the open names the rendered ids
        # the cloud forgets (its bounds): the next turn is refused and sent whole
        for peer in cloud._peers.values():
            peer.conn.renders.clear()
            peer.conn.contexts.clear()
        chat += [{"role": "user", "content": "Again?"}]
        ids = await edge.chat_prompt(chat)
        assert ids == target.chat_prompt(chat)
        g = await edge.generate(ids, max_new_tokens=8, seed=9)
        assert g.token_ids == (await fresh.generate(ids, max_new_tokens=8, seed=9)).token_ids
        # refused: one node's render (the whole render it sends then holds the ids
        # again, which its open names) and the other's open, each sent again whole
        assert cloud.counters["errors_by_code"].get("no_context", 0) == 2


async def test_hostile_references_get_typed_errors_and_the_cloud_serves_on() -> None:
    draft, target = default_pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud:
        conn = await connect(cloud.endpoint, transport="zmq")

        async def ask(msg: Any) -> Any:
            await conn.send(pack(msg))
            return await reply(conn)

        try:
            fp = (await handshake(conn, draft)).fingerprint
            a = await ask(Render(1, chat=(("user", "hi"),), base="0" * 16, keep=1))
            assert isinstance(a, Error) and a.code == "no_context" and a.n == 1
            a = await ask(Render(2, chat=(("user", "hi"),)))
            assert isinstance(a, Rendered)
            key = render_key(None, (("user", "hi"),))
            a = await ask(Render(3, chat=(), base=key, keep=5))  # past its end
            assert isinstance(a, Error) and a.code == "bad_field" and a.n == 3
            a = await ask(Render(4, text="x", base=key, keep=1))  # another kind
            assert isinstance(a, Error) and a.code == "bad_field" and a.n == 4
            ids = target.chat_prompt([{"role": "user", "content": "hi"}])

            def opening(s: int, **kw: Any) -> Open:
                return Open(s, 1, fp, "ar", "f32", {}, 1.0, 0, 1.0, 1, "", 4, **kw)

            a = await ask(opening(1, prompt_ids=np.array([1]), base="f" * 16, keep=1))
            assert isinstance(a, Error) and a.code == "no_context" and a.s == 1
            a = await ask(opening(2, prompt_ids=np.array([1]), base=ids_key(ids),
                                          keep=len(ids) + 1))
            assert isinstance(a, Error) and a.code == "bad_field"
            a = await ask(opening(3, prompt_ids=np.array([], dtype=np.int64),
                                          base=ids_key(ids), keep=len(ids)))
            assert not isinstance(a, Error), a  # a good one is served
        finally:
            await conn.close()
