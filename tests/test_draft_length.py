"""The draft-length policy: its ceiling rules, the stop after an unsure draft, and
that the settings reach a session from GenerationConfig and the CLI. That the policy
keeps the output law is tested in ``tests/test_law.py`` (with a control that stops
the wrong way)."""

from __future__ import annotations

from typing import Any

import pytest

from xcosd.cli import build_parser
from xcosd.commands.options import generation_config
from xcosd.config import GenerationConfig
from xcosd.nodes.pump import Pump
from xcosd.protocol import RoundVerified
from xcosd.protocol.draft_length import DraftLength
from xcosd.sampling import SamplingParams

from .session_pairs import pair


def test_the_ceiling_follows_acceptance_within_its_bounds() -> None:
    dl = DraftLength(start=4, cap=7)
    dl.settled(4, 4)
    assert dl.ceiling == 6
    dl.settled(6, 6)
    assert dl.ceiling == 7  # capped
    dl.settled(3, 3)  # a round cut short by the stop, all of it accepted: still up
    assert dl.ceiling == 7
    for _ in range(10):
        dl.settled(dl.ceiling, 0)
    assert dl.ceiling == 1  # never below one
    dl.settled(0, 0)  # a round that drafted nothing says nothing
    assert dl.ceiling == 1


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
                                          ({"confidence": -0.1}, "confidence")])
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
    assert greedy[:4] == [2, 4, 6, 6], greedy


def test_fixed_length_drafts_the_same_every_round(link: Pump) -> None:
    lengths = _lengths(link, draft_len=3, adaptive_draft=False)
    # the last rounds draft fewer only as the tokens left run out (40 = 29 x 4 + 3 + 1)
    assert lengths == [3] * 29 + [2, 1, 0]


def test_the_settings_reach_the_session_from_config_and_cli() -> None:
    cfg = GenerationConfig(adaptive_draft=False, draft_confidence=0.2, max_draft_len=9)
    assert GenerationConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="draft_confidence"):
        GenerationConfig(draft_confidence=1.0)
    with pytest.raises(ValueError, match="max_draft_len"):
        GenerationConfig(max_draft_len=0)
    args = build_parser().parse_args(["edge", "--fixed-draft-len", "--draft-confidence", "0.25",
                                      "--max-draft-len", "8"])
    got = generation_config(args)
    assert (got.adaptive_draft, got.draft_confidence, got.max_draft_len) == (False, 0.25, 8)
    default = generation_config(build_parser().parse_args(["edge"]))
    assert default.adaptive_draft and default.draft_confidence == 0.4
