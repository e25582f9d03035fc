"""The nodes' public observation points, which the load benchmark relies on instead
of subclassing the nodes: ``EdgeNode(on_round=...)`` sees every round, and the
rounds add up to the generation's stats; an exception the hook raises ends the
generation between rounds with its session closed; ``CloudNode.batch_stats`` has
one queue wait per batched request."""

from __future__ import annotations

import itertools

import pytest

import xcosd
from xcosd.nodes import RoundObserved

from .session_pairs import closed_sessions_settle, pair


async def test_on_round_sees_every_round_and_batch_stats_every_request() -> None:
    target, draft = pair()
    seen: list[RoundObserved] = []
    cloud = xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", keep_queue_waits=True)
    assert cloud.batch_stats is None  # no scheduler before start
    async with cloud, xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, method="xcosd-e",
                                     on_round=seen.append) as edge:
        res = await edge.generate("ab", max_new_tokens=30, seed=3)
        bs = cloud.batch_stats
        assert bs is not None
        waits, requests = list(bs.queue_waits), bs.requests
    st = res.stats
    assert len(seen) == st.rounds > 1
    assert len({r.session for r in seen}) == 1
    assert sum(r.tokens for r in seen) == st.tokens == len(res.token_ids)
    assert sum(r.drafted for r in seen) == st.drafted
    assert sum(r.accepted for r in seen) == st.accepted
    # the open and close messages belong to no round
    assert 0 < sum(r.uplink_bytes for r in seen) < st.uplink_bytes
    assert 0 < sum(r.downlink_bytes for r in seen) <= st.downlink_bytes
    assert all(r.start <= r.end for r in seen)
    assert all(a.end <= b.start for a, b in itertools.pairwise(seen))
    assert len(waits) == requests >= st.rounds
    assert all(w >= 0 for w in waits)


async def test_a_cloud_keeps_totals_not_one_sample_per_round_unless_asked() -> None:
    """A server runs for weeks: per-round samples would grow its memory for as long
    (they did, one float per request, found by the soak). Only a benchmark's cloud
    asks for them (``keep_queue_waits``); the totals are counted either way."""
    target, draft = pair()
    cloud = xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0")
    async with cloud, xcosd.EdgeNode(draft=draft, connect=cloud.endpoint,
                                     method="xcosd-e") as edge:
        res = await edge.generate("ab", max_new_tokens=30, seed=3)
        bs = cloud.batch_stats
        assert bs is not None
        assert bs.requests >= res.stats.rounds > 1 and bs.batches >= 1
        assert bs.queue_wait_s >= 0 and bs.queue_waits == []
        assert not hasattr(bs, "compute_times")


class _Stop(Exception):
    pass


async def test_an_exception_from_on_round_ends_the_generation_between_rounds() -> None:
    target, draft = pair()
    seen: list[RoundObserved] = []

    def stop_after_two(r: RoundObserved) -> None:
        seen.append(r)
        if len(seen) == 2:
            raise _Stop

    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, draft_len=2,
                           on_round=stop_after_two) as edge:
        with pytest.raises(_Stop):
            await edge.generate("ab", max_new_tokens=40, seed=1)
        assert len(seen) == 2
        stats = await closed_sessions_settle(cloud)  # the session was closed
        assert stats["sessions_active"] == 0
        edge.on_round = None  # the node still works, unobserved
        res = await edge.generate("ab", max_new_tokens=8, seed=1)
        assert len(res.token_ids) == 8
    assert len(seen) == 2
