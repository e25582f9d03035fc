"""The draft context computed in the wait of rounds that draft nothing.

Where drafting does not pay, the length policy drafts nothing most rounds and
probes one token now and then. The tokens those rounds emit reach the draft model's
context only at the next round that drafts, which used to pay for all of them
before its one draft step (and measured that as its step). The edge now computes
them while the verdict of a round that drafted nothing is in flight
(``GenerationRun._catch_up``). Over real ZeroMQ sockets: the same seeds give the same
tokens with the catch-up and without it (the draft model saw the same context, so
it proposed the same drafts), and the catch-up did run. The draft runs in the
edge's draft thread, as a real model's does (a small table model would draft on the
event loop, where there is no wait to use).
"""

from __future__ import annotations

import asyncio

import pytest

import xcosd
from xcosd.nodes.edge_generation import GenerationRun

from .session_pairs import closed_sessions_settle, pair

N = 24
TOKENS = 24


async def _run(catch_up: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], int]]:
    if not catch_up:
        monkeypatch.setattr(GenerationRun, "_catch_up", lambda self: None)
    target, draft = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud:
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, draft_thread=True) as edge:
            out = []
            for i in range(N):  # one at a time: the catch-up runs beside no other
                r = await edge.generate("c", max_new_tokens=TOKENS, seed=700 + i,
                                        method="xcosd-e", draft_cost=100.0)
                out.append((r.token_ids, r.stats.caught_up))
        await closed_sessions_settle(cloud)
    monkeypatch.undo()
    return out


async def test_the_same_tokens_with_the_context_computed_in_the_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with_it = await _run(True, monkeypatch)
    without = await _run(False, monkeypatch)
    assert [t for t, _ in with_it] == [t for t, _ in without]
    assert sum(c for _, c in with_it) > N * TOKENS // 2
    assert all(c == 0 for _, c in without)


async def test_no_catch_up_beside_another_generation() -> None:
    target, draft = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud:
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, draft_thread=True) as edge:
            results = await asyncio.gather(*[
                edge.generate("c", max_new_tokens=TOKENS, seed=800 + i, method="xcosd-e",
                              draft_cost=100.0) for i in range(4)])
        await closed_sessions_settle(cloud)
    # the four ran side by side in one draft thread: none computed context early
    # while another was open (the last one, alone at its end, may have)
    assert sum(r.stats.caught_up == 0 for r in results) >= 3


async def test_a_long_prompt_is_computed_beside_the_opens_round_trip() -> None:
    """A draft prompt past ``PREFILL_OVERLAP`` uncached tokens: round 0 drafts
    nothing (the cloud's first token needs no draft) and the draft thread computes
    the prompt meanwhile; round 1 drafts from the computed context. A short prompt
    drafts from round 0 as before."""
    from xcosd.nodes import RoundObserved
    from xcosd.nodes.edge import PREFILL_OVERLAP

    target, draft = pair()
    long_prompt = "abcd" * PREFILL_OVERLAP
    rounds: list[RoundObserved] = []
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud:
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, draft_thread=True,
                                  on_round=rounds.append) as edge:
            r = await edge.generate(long_prompt, max_new_tokens=TOKENS, seed=5, method="xcosd-e",
                                    adaptive_draft=False, draft_len=3)
            assert r.stats.prefilled_beside >= PREFILL_OVERLAP
            assert rounds[0].drafted == 0 and rounds[1].drafted == 3
            rounds.clear()
            r = await edge.generate("ab", max_new_tokens=TOKENS, seed=5, method="xcosd-e",
                                    adaptive_draft=False, draft_len=3)
            assert r.stats.prefilled_beside == 0 and rounds[0].drafted == 3
        await closed_sessions_settle(cloud)
