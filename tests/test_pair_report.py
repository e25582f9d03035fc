"""``xcosd pair``: the report a user runs before deploying a pair, on the embedded
n-gram pair: its facts add up, its prediction is checked against the protocol's own
seeded runs, its pieces against closed forms."""

from __future__ import annotations

import json

import numpy as np
import pytest

from xcosd.bench import pair_report as pr
from xcosd.cli import main
from xcosd.vocab import VocabMap


@pytest.fixture(scope="module")
def report() -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["pair", "default-draft", "default-target", "--prompts", "3",
                     "--tokens", "16", "--rtt-ms", "20,50", "--measure", "--json"]) == 0
    return json.loads(out.getvalue())


def test_the_report_says_where_the_mass_is_and_what_it_predicts(report: dict) -> None:
    m = report["mass"]
    assert m["v_c"] > 0.5
    total = (m["v_c"] + m["duplicate_not_in_v_c"] + m["v_o_draft_one_token"]
             + m["v_o_draft_two_tokens"] + m["v_o_draft_three_or_more"]
             + m["v_o_draft_cannot_spell"])
    assert total == pytest.approx(1.0, abs=1e-3)
    assert set(report["warpers"]) == set(pr.WARPERS) == set(report["measured"])
    for name, w in report["warpers"].items():
        assert 0.0 < w["mean_ceiling"] <= w["bytes_ceiling"] + 1e-9 <= 1.0 + 1e-9
        assert 0.0 < w["trips_per_token"] <= 1.0 and 0.0 < w["tree"]["trips_per_token"] <= 1.0
        assert set(w["modeled"]) == {"20", "50"}
        sp = w["modeled"]["50"]
        assert sp["speedup"] == pytest.approx(sp["xcosd_tok_s"] / sp["ar_tok_s"])
        measured = report["measured"][name]["trips_per_token"]
        # the prediction is of the same order as the protocol's own runs (the bench
        # in docs/RESULTS.md states how close, per warper, on the real pair)
        assert 0.5 * measured < w["trips_per_token"] < 1.5 * measured, (name, measured, w)
    assert report["draft_step_ms"] > 0


def test_the_table_prints(capsys) -> None:
    assert main(["pair", "default-draft", "default-target", "--prompts", "1",
                 "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "ceiling" in out and "|V_C|" in out and "x ar @50ms" in out


def test_chain_trips_is_the_rounds_of_a_chain() -> None:
    # every draft accepted: ceil(n / (k + 1)) rounds; none: n rounds
    assert pr.chain_trips(np.ones(10), 4) == pytest.approx(2.0)
    assert pr.chain_trips(np.zeros(10), 4) == pytest.approx(10.0)
    assert pr.chain_trips(np.full(3, 0.5), 0) == 3.0
    # one draft a round at acceptance a: a round emits 2 tokens w.p. a
    a = 0.3
    got = pr.chain_trips(np.full(200, a), 1) / 200
    assert got == pytest.approx(1 / (1 + a), rel=0.01)
    rng = np.random.default_rng(0)
    # the policy's walk agrees with the fixed length where the policy sits there
    assert pr.policy_trips(np.ones(40), step_cost=0.05, cap=16, runs=5, rng=rng) < 8


def test_draft_spelling_of_the_target_ids() -> None:
    from xcosd.models import default_pair

    draft, target = default_pair()
    vmap = VocabMap(draft.vocab, target.vocab)
    ids = target.tokenize("The default value of the")
    spelled = [vmap.draft_spelling(t) for t in ids]
    assert draft.vocab.decode([d for ds in spelled for d in ds]) == target.vocab.decode(ids)
