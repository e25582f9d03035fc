"""The merge policy (``xcosd/nodes/merging.py``) without a scheduler: the fitted
fixed cost, the fill time, when a partial batch is held and for how long."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from xcosd.nodes.merging import MAX_PEERS, MIN_CALLS, PROBE_EVERY, REOPEN_MIN, MergePolicy


@dataclass(eq=False)
class S:
    """A session as the policy sees one."""

    closed: bool = False


def _calls(policy: MergePolicy, sizes: list[int], a: float = 0.02, b: float = 0.0005) -> None:
    for rows in sizes:
        policy.record_call(rows, a + b * rows)


def _batch(policy: MergePolicy, now: float, back_after: float | None, n: int = 3) -> list[S]:
    """Answer ``n`` sessions at ``now``; all back ``back_after`` later (None: not yet)."""
    sessions = [S() for _ in range(n)]
    policy.answered(sessions, now)
    if back_after is not None:
        for i, s in enumerate(sessions):
            policy.returned(s, now + back_after * (i + 1) / n)
    return sessions


def test_the_fixed_cost_is_the_intercept_of_the_calls() -> None:
    p = MergePolicy()
    assert p.fixed_cost() is None
    _calls(p, [10, 40, 20, 80, 15, 60, 30, 25])
    assert p.fixed_cost() == pytest.approx(0.02, abs=1e-9)
    # sizes too alike to separate a from b: the last fit stays
    _calls(p, [40] * 64, a=0.5)
    assert p.fixed_cost() == pytest.approx(0.02, abs=1e-9)
    # a fresh policy with only alike sizes has no fit
    q = MergePolicy()
    _calls(q, [40] * MIN_CALLS)
    assert q.fixed_cost() is None
    # never negative, never above the fastest call
    r = MergePolicy()
    _calls(r, [10, 80] * 4, a=-0.002)
    assert r.fixed_cost() == 0.0


def test_the_fill_time_waits_for_the_last_session_and_counts_stragglers() -> None:
    p = MergePolicy()
    for k in range(4):
        _batch(p, 10.0 * k, 0.004)
    assert p.fill_time() == pytest.approx(0.004)
    # batches not all back before the next verdicts count as never filled
    for k in range(5):
        _batch(p, 100.0 + k, None)
    _batch(p, 200.0, 0.004)
    assert p.fill_time() == math.inf


def test_a_partial_batch_is_held_only_when_merging_pays() -> None:
    p = MergePolicy()
    _calls(p, [10, 40, 20, 80, 15, 60, 30, 25])  # a = 20 ms
    for k in range(4):
        _batch(p, float(k), 0.004)  # back within 4 ms
    pending = _batch(p, 10.0, None)
    assert p.hold_until(10.001) == pytest.approx(10.02)  # at most a after the verdicts
    p.returned(pending[0], 10.002)
    pending[1].closed = True  # a session that ended is not waited for
    assert p.hold_until(10.003) == pytest.approx(10.02)
    p.returned(pending[2], 10.004)
    assert not p.pending(10.004) and p.hold_until(10.004) is None  # everyone is back
    # sessions slower than the call's fixed cost: the turns are kept
    slow = MergePolicy()
    _calls(slow, [10, 40, 20, 80, 15, 60, 30, 25])
    for k in range(4):
        _batch(slow, float(k), 0.05)
    _batch(slow, 10.0, None)
    assert slow.hold_until(10.001) is None


def test_without_a_fit_one_batch_in_a_while_is_held_to_get_one() -> None:
    """Groups taking turns in equal batches give the fit one size only; a probe now
    and then (bounded by a median call) makes the larger batch that separates a."""
    p2 = MergePolicy()
    _calls(p2, [40] * MIN_CALLS)
    decisions = []
    for k in range(2 * PROBE_EVERY + 1):
        sessions = _batch(p2, float(k), None)
        decisions.append(p2.hold_until(k + 0.0005))
        for s in sessions:
            p2.returned(s, k + 0.001)
    holds = [k for k, d in enumerate(decisions) if d is not None]
    assert holds and all(d is None or d == pytest.approx(k + 0.04)
                         for k, d in enumerate(decisions))
    assert len(holds) <= 2 and holds[0] >= PROBE_EVERY - 1


def _primed() -> MergePolicy:
    """A policy that holds: a = 20 ms, answered sessions back within 4 ms."""
    p = MergePolicy()
    _calls(p, [10, 40, 20, 80, 15, 60, 30, 25])
    for k in range(4):
        _batch(p, float(k), 0.004)
    return p


def test_a_peer_that_reopens_at_once_keeps_its_ended_sessions_places() -> None:
    """A closed-loop peer opens its next session as soon as one ends; once it has
    done so REOPEN_MIN times, an ended session of it keeps its place for the next
    one, and the batch waits for that (never past the hold's bound)."""
    p = _primed()
    t = 10.0
    for _ in range(REOPEN_MIN):  # learning: each ended session followed by a new one
        assert not p.reopener("dev")
        old = _batch(p, t, None, n=1)[0]
        p.forget(old, t + 0.001, "dev")
        assert not p.pending(t + 0.001)  # not a reopener yet: nobody waited for
        p.returned(S(), t + 0.002, "dev", new=True)
        t += 1.0
    assert p.reopener("dev")
    old, other = _batch(p, t, None, n=2)
    assert p.hold_until(t + 0.0005) == pytest.approx(t + 0.02)
    p.returned(other, t + 0.001)
    p.forget(old, t + 0.002, "dev")  # its peer closed it: its place is kept
    assert p.pending(t + 0.002) and p.expected(t + 0.002) == 1 and p.vacancies() == 1
    p.returned(S(), t + 0.003, "someone else", new=True)  # not that peer's
    assert p.vacancies() == 1
    p.returned(S(), t + 0.004, "dev", new=True)  # the place taken
    assert not p.pending(t + 0.004) and p.vacancies() == 0
    assert p.to_dict()["reopeners"] == 1


def test_a_peer_that_goes_quiet_is_not_waited_for() -> None:
    """A device that ends a generation and opens none before the next verdicts is
    no reopener: its ended sessions free their places at once. A reopener that
    stops reopening loses the standing after a couple of misses."""
    p = _primed()
    t = 10.0
    for _ in range(2 * REOPEN_MIN):
        old = _batch(p, t, None, n=1)[0]
        p.forget(old, t + 0.001, "quiet")
        assert not p.pending(t + 0.001)
        t += 1.0
    assert not p.reopener("quiet")
    for _ in range(REOPEN_MIN):
        p.forget(_batch(p, t, None, n=1)[0], t + 0.001, "dev")
        p.returned(S(), t + 0.002, "dev", new=True)
        t += 1.0
    misses = 0
    while True:
        ended = _batch(p, t, None, n=1)[0]  # these verdicts count the last miss
        if not p.reopener("dev"):
            break
        p.forget(ended, t + 0.001, "dev")
        assert p.pending(t + 0.001)  # kept: it was a reopener until now
        t += 1.0
        misses += 1
    assert 1 <= misses <= 2
    # an ended session whose end its peer did not ask for (a timeout, a dropped
    # connection: no peer given) keeps no place
    p.returned(S(), t + 0.5, "dev", new=True)
    ended = _batch(p, t + 1, None, n=1)[0]
    p.forget(ended, t + 1.001)
    assert not p.pending(t + 1.001)


def test_the_peer_records_are_bounded() -> None:
    p = MergePolicy()
    for k in range(MAX_PEERS + 10):
        s = S()
        p.answered([s], float(k))
        p.forget(s, k + 0.001, k)
    p.answered([], MAX_PEERS + 11.0)
    assert len(p._reopens) == MAX_PEERS and 0 not in p._reopens


def test_no_place_is_kept_where_holding_does_not_pay() -> None:
    """Against a target whose calls cost next to nothing (or devices slower than a
    call's fixed cost) no batch is held, and a reopener's ended session keeps no
    place either: it would only keep the next batch from forming."""
    p = MergePolicy()
    _calls(p, [10, 40, 20, 80, 15, 60, 30, 25], a=0.0001)
    for k in range(4):
        _batch(p, float(k), 0.004)  # back within 4 ms, far above a = 0.1 ms
    t = 10.0
    for _ in range(REOPEN_MIN):
        p.forget(_batch(p, t, None, n=1)[0], t + 0.001, "dev")
        p.returned(S(), t + 0.002, "dev", new=True)
        t += 1.0
    assert p.reopener("dev")
    p.forget(_batch(p, t, None, n=1)[0], t + 0.001, "dev")
    assert p.vacancies() == 0 and not p.pending(t + 0.001)
