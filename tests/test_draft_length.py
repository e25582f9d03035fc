"""The draft-length policy: its ceiling rules, the stop after an unsure draft, and
that the settings reach a session from GenerationConfig and the CLI. That the policy
keeps the output law is tested in ``tests/test_law.py`` (with a control that stops
the wrong way)."""

from __future__ import annotations

from typing import Any

import pytest

import xcosd
from xcosd.cli import build_parser
from xcosd.commands.options import generation_config
from xcosd.config import GenerationConfig
from xcosd.models import SyntheticModel
from xcosd.nodes.pump import Pump
from xcosd.policies.draft_length import MAX_PROBE, PROBE, STEP, DraftLength, best_length
from xcosd.protocol import RoundVerified
from xcosd.sampling import SamplingParams

from .session_pairs import pair


def test_best_length_is_the_throughput_optimum() -> None:
    def brute(rate: float, cost: float, cap: int) -> int:
        def value(k: int) -> float:
            return sum(rate ** i for i in range(k + 1)) / (1 + k * cost)
        return max(range(1, cap + 1), key=lambda k: (value(k), -k))

    for rate in (0.0, 0.2, 0.5, 0.7, 0.9, 0.99):
        for cost in (0.0, 0.02, 0.1, 0.5, 2.0):
            assert best_length(rate, cost, 16) == brute(rate, cost, 16), (rate, cost)
    assert best_length(0.9, 0.1, 16) == 10 and best_length(0.3, 0.1, 16) == 1
    assert best_length(1.0, 0.0, 5) == 5  # free drafts that are always accepted: the cap


def test_drafting_stops_where_it_does_not_pay_and_probes() -> None:
    assert best_length(0.3, 0.5, 16, lo=0) == 0  # (1 + 0.3) / 1.5 < 1: draft nothing
    assert best_length(0.6, 0.5, 16, lo=0) == 1
    assert best_length(0.0, 0.0, 16, lo=0) == 0  # a tie goes to the shorter
    dl = DraftLength(start=2, cost=2.0)
    dl.settled(2, 0)
    assert dl.ceiling == 0
    for _ in range(PROBE - 1):
        dl.settled(0, 0)
    assert dl.ceiling == 0
    dl.settled(0, 0)
    assert dl.ceiling == 1  # one round in PROBE drafts a token
    dl.settled(1, 1)  # accepted, but a step still costs twice a round: back to none
    assert dl.ceiling == 0
    # and the next probe waits twice as long, up to MAX_PROBE rounds
    gaps = []
    for _ in range(5):
        n = 0
        while dl.ceiling == 0:
            dl.settled(0, 0)
            n += 1
        gaps.append(n)
        dl.settled(1, 0)
    assert gaps == [2 * PROBE, 4 * PROBE, MAX_PROBE, MAX_PROBE, MAX_PROBE]


def test_a_measuring_policy_starts_from_the_last_ones_costs() -> None:
    old = DraftLength(start=4, measure=True)
    old.observe(0.030, 0.060)
    old.settled(4, 1)
    new = DraftLength(start=4, measure=True)
    new.adopt(old)
    assert (new.cost, new.rate, new.ceiling) == (old.cost, old.rate, 0)
    # the rounds since the last probe carry over: short generations still probe
    for _ in range(PROBE - 1):
        new.settled(0, 0)
    newer = DraftLength(start=4, measure=True)
    newer.adopt(new)
    newer.settled(0, 0)
    assert newer.ceiling == 1
    fixed = DraftLength(start=4)
    fixed.adopt(old)  # a set cost learns nothing from other generations
    assert (fixed.cost, fixed.rate, fixed.ceiling) == (0.05, 0.5, 4)


def test_a_fixed_length_measures_the_times_speculation_needs_and_keeps_its_length() -> None:
    """A fixed length that measures (an unseeded generation) records the step and
    round times the node sizes its speculation by, and drafts its length however
    they come out; an adaptive policy that adopts from it takes the costs, not its
    (never updated) acceptance estimate."""
    fixed = DraftLength(start=3, adaptive=False, cap=16, measure=True)
    fixed.observe(0.030, 0.060)
    fixed.settled(3, 0)
    assert (fixed.step_s, fixed.fixed_s, fixed.ceiling) == (0.030, 0.060, 3)
    assert fixed.most_next == 3  # speculation's horizon: its next block, not the cap
    later = DraftLength(start=3, adaptive=False, measure=True)
    later.adopt(fixed)
    assert (later.step_s, later.fixed_s, later.ceiling) == (0.030, 0.060, 3)
    adaptive = DraftLength(start=4, cap=16, measure=True)
    adaptive.rate = 0.9
    adaptive.adopt(fixed)
    assert adaptive.cost == pytest.approx(0.5) and adaptive.rate == 0.9
    assert adaptive.most_next == 16
    unmeasured = DraftLength(start=3, adaptive=False)  # seeded: nothing timing-dependent
    unmeasured.observe(0.030, 0.060)
    assert unmeasured.step_s is None and unmeasured.fixed_s is None


def test_a_measured_cost_follows_the_node_and_a_set_one_does_not() -> None:
    set_, measured = DraftLength(start=4, cost=0.05), DraftLength(start=4, measure=True)
    for dl in (set_, measured):
        dl.observe(0.030, 0.060)  # a draft step half a round
        dl.observe(None, 0.060)  # a round that drafted nothing: the round time only
    assert set_.cost == 0.05
    assert measured.cost == pytest.approx(0.5)
    for dl in (set_, measured):
        dl.settled(4, 1)
    assert set_.ceiling > 0 and measured.ceiling == 0


def test_the_ceiling_follows_acceptance_within_its_bounds() -> None:
    dl = DraftLength(start=4, cap=7)
    assert dl.ceiling == 4 and dl.rate == 0.5  # the first round: start, and the prior
    for _ in range(5):
        dl.settled(dl.ceiling, dl.ceiling)
    assert dl.rate > 0.9 and dl.ceiling == 7  # capped
    for _ in range(10):  # every first draft rejected: down, one step at a time
        dl.settled(dl.ceiling, 0)
    assert dl.rate < 0.25 and dl.ceiling == 1
    before = dl.rate
    dl.settled(0, 0)  # a round that drafted nothing says nothing of acceptance
    assert (dl.ceiling, dl.rate) == (1, before)
    # drafts after the first rejection were never tested: 2 accepted of 5 is two
    # ones and one zero, not three zeros
    fresh, want = DraftLength(start=5), 0.5
    fresh.settled(5, 2)
    for x in (1.0, 1.0, 0.0):
        want += STEP * (x - want)
    assert fresh.rate == want


def test_a_costlier_draft_drafts_less() -> None:
    lengths = []
    for cost in (0.02, 0.1, 0.5):
        dl = DraftLength(start=4, cost=cost)
        for _ in range(20):
            dl.settled(4, 3)  # three of four accepted, every round
        lengths.append(dl.ceiling)
    assert lengths[0] > lengths[1] > lengths[2] >= 1, lengths


def test_fixed_length_never_moves_nor_stops() -> None:
    dl = DraftLength(start=4, adaptive=False, cap=2)
    dl.settled(4, 0)
    dl.settled(4, 4)
    assert dl.ceiling == 4 and dl.stop_below == 0.0
    assert DraftLength(start=0).ceiling == 0  # 0 drafts nothing, adaptive or not
    assert DraftLength(start=9, cap=5).ceiling == 5


@pytest.mark.parametrize(("kw", "says"), [({"start": -1}, "draft length"),
                                          ({"cap": 0}, "cap"),
                                          ({"confidence": 1.0}, "confidence"),
                                          ({"confidence": -0.1}, "confidence"),
                                          ({"cost": -1.0}, "cost")])
def test_bad_settings_are_refused(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        DraftLength(**kw)


@pytest.fixture(scope="module")
def link() -> Pump:
    return Pump(*pair())


def _lengths(link: Pump, **kw: Any) -> list[int]:
    link.events.clear()
    link.generate("xcosd-e", prompt="ab", max_new_tokens=40, seed=5, **kw)
    return [ev.drafted for ev in link.events if isinstance(ev, RoundVerified)]


def test_an_unsure_draft_ends_the_round_after_itself(link: Pump) -> None:
    # no bigram row is that sure: every round keeps its first draft and stops there
    # (the last round drafts nothing: one token is left, the cloud's to draw)
    assert set(_lengths(link, draft_len=4, draft_confidence=0.999)[:-1]) == {1}
    # greedy drafts are sure (probability 1): the ceiling alone bounds them; with
    # the target as its own draft every round is accepted and the ceiling climbs
    target, _ = pair()
    greedy = _lengths(Pump(target, target), draft_len=2, max_draft_len=6,
                      params=SamplingParams(temperature=0.0))
    assert greedy[0] == 2 and greedy[1:4] == sorted(greedy[1:4]) and greedy[3] == 6, greedy


def test_fixed_length_drafts_the_same_every_round(link: Pump) -> None:
    link.events.clear()
    link.generate("xcosd-e", prompt="ab", max_new_tokens=40, seed=5, draft_len=3,
                  adaptive_draft=False)
    rounds = [ev for ev in link.events if isinstance(ev, RoundVerified)]
    # every round drafts 3, fewer only as the tokens left run out (a round commits
    # its accepted drafts and one token more, and drafts at most what is left - 1)
    left = 40
    for ev in rounds:
        assert ev.drafted == min(3, left - 1), [e.drafted for e in rounds]
        left -= ev.accepted + 1
    assert left == 0 and sum(ev.drafted == 3 for ev in rounds) >= len(rounds) - 3


def test_the_settings_reach_the_session_from_config_and_cli() -> None:
    cfg = GenerationConfig(adaptive_draft=False, draft_confidence=0.2, max_draft_len=9,
                           draft_cost=0.3)
    assert GenerationConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="draft_confidence"):
        GenerationConfig(draft_confidence=1.0)
    with pytest.raises(ValueError, match="max_draft_len"):
        GenerationConfig(max_draft_len=0)
    with pytest.raises(ValueError, match="draft_cost"):
        GenerationConfig(draft_cost=-0.5)
    with pytest.raises(ValueError, match="draft_cost"):
        GenerationConfig(draft_cost="measure")  # type: ignore[arg-type]
    assert GenerationConfig(draft_cost="auto").draft_cost == "auto"
    auto = generation_config(build_parser().parse_args(["edge", "--draft-cost", "auto"]))
    assert auto.draft_cost == "auto"
    args = build_parser().parse_args(["edge", "--fixed-draft-len", "--draft-confidence", "0.25",
                                      "--max-draft-len", "8", "--draft-cost", "0.5"])
    got = generation_config(args)
    assert (got.adaptive_draft, got.draft_confidence, got.max_draft_len, got.draft_cost) == (
        False, 0.25, 8, 0.5)
    default = generation_config(build_parser().parse_args(["edge"]))
    assert default.adaptive_draft and default.draft_confidence == 0.0
    # unset: measured, unless seeded (a seeded output must not depend on timing)
    assert default.draft_cost is None and default.resolved_draft_cost() == "auto"
    assert default.replace(seed=3).resolved_draft_cost() == 0.05
    assert default.replace(seed=3, draft_cost=0.2).resolved_draft_cost() == 0.2


async def test_a_measured_cost_drafts_only_where_drafting_pays() -> None:
    """Over ZeroMQ: a draft step that costs 20 ms against a near-free target is not
    worth it (the rounds draft nothing but the probes); a 4 ms step against a target
    call of 60 ms is (most rounds draft). Both far from the break-even, so a loaded
    machine, which stretches every measured time, cannot tip either."""
    drafted = {}
    for name, target_s, draft_s in (("slow draft", 0.0, 0.020), ("slow target", 0.060, 0.004)):
        target = SyntheticModel(64, a=target_s)
        draft = SyntheticModel(target.vocab, a=draft_s, skew=1.5, name="d")
        async with (xcosd.CloudNode(target, bind="tcp://127.0.0.1:0") as cloud,
                    xcosd.EdgeNode(draft, cloud.endpoint, draft_cost="auto") as edge):
            r = await edge.generate([1, 2], max_new_tokens=40, seed=1)
            again = await edge.generate([1, 2], max_new_tokens=40, seed=2)
        drafted[name] = (r.stats.drafted, r.stats.rounds, again.stats.drafted)
    slow_draft, slow_target = drafted["slow draft"], drafted["slow target"]
    assert slow_draft[0] <= 4 + slow_draft[1] // PROBE, drafted  # the first round, probes
    # the next generation starts from the measured costs: no first round of 4
    assert slow_draft[2] <= 40 // (2 * PROBE) + 1, drafted
    assert slow_target[0] >= slow_target[1] and slow_target[2] >= slow_target[1], drafted


def test_a_round_s_share_per_verified_token_is_fit_and_counted_in_the_cost() -> None:
    """A round's wait, fit as a fixed part plus a share per token sent: a cloud
    that verifies on a CPU (here 30 ms a token over a 100 ms round) makes a draft
    cost its step and that share, and drafting pays later than the step alone
    says; where every round sends the same count the share cannot be told apart
    and the step alone counts, as before."""
    dl = DraftLength(measure=True)
    for i in range(40):
        k = (0, 1, 3, 4)[i % 4]
        dl.observe(0.020 if k else None, 0.100 + 0.030 * k, k)
    assert dl.verify_s == pytest.approx(0.030, rel=1e-6)
    assert dl.cost == pytest.approx((0.020 + 0.030) / 0.100, rel=1e-6)
    flat = DraftLength(measure=True)
    for _ in range(40):
        flat.observe(0.020, 0.160, 2)
    assert flat.verify_s == 0.0 and flat.cost == pytest.approx(0.020 / 0.160)
    # the share moves the length: 0.6 acceptance, a 20 ms step
    assert best_length(0.6, flat.cost, 16, lo=0) > best_length(0.6, dl.cost, 16, lo=0)
    later = DraftLength(measure=True)
    later.adopt(dl)
    assert later.verify_s == dl.verify_s and later.cost == dl.cost
