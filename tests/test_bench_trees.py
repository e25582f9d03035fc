"""``xcosd bench trees`` on the embedded pair, small: every row runs through the pump
(the protocol's state machines, wire bytes), the policies and fixed shapes side by
side; the records' counts add up and agree with what the rows are; the measured
costs and the RESULTS section are computed from the JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from xcosd.bench.trees import (
    MEASURED,
    TreesConfig,
    format_report,
    run_trees,
    section_lines,
)


def test_config_refuses_unknown_shapes_warpers_and_pairs() -> None:
    with pytest.raises(ValueError):
        TreesConfig(shapes=["3x0"])
    with pytest.raises(ValueError):
        TreesConfig(shapes=["tree"])
    with pytest.raises(ValueError):
        TreesConfig(warpers=["T=2"])
    with pytest.raises(ValueError):
        TreesConfig(pairs=["nope"])


@pytest.fixture(scope="module")
def rep() -> dict:
    cfg = TreesConfig(shapes=["chain", "auto", "chain:2", "3x1"], prompts=2, tokens=12)
    return run_trees(cfg, progress=False)


def test_every_row_runs_and_adds_up(rep: dict) -> None:
    rows = {r["shape"]: r for r in rep["records"]}
    assert list(rows) == ["ar", "chain", "auto", "chain:2", "3x1", *MEASURED]
    for r in rep["records"]:
        assert r["generations"] == 2 and 0 < r["tokens"] <= 24
        assert r["trips"] == r["target_calls"] + r["extra_round_trips"]
        assert r["trips_per_token"] == pytest.approx(r["trips"] / r["tokens"])
        assert r["tokens_per_trip"] == pytest.approx(r["tokens"] / r["trips"])
        assert r["calls_per_token"] <= r["trips_per_token"]
        assert r["rounds"] == r["target_calls"]  # the pump: one target call a round
        assert r["up_per_round"] == pytest.approx(r["uplink_bytes"] / r["rounds"])
        assert r["down_per_token"] == pytest.approx(r["downlink_bytes"] / r["tokens"])
        assert sum(r["rank_accepted"]) <= sum(r["rank_tested"])
        assert r["accepted"] <= r["drafted"]
        assert set(r["modeled_tok_s"]) == {f"{a:g}@{b:g}" for a in (100, 200, 300)
                                           for b in (5, 20, 50, 100)}
        # the same messages on a longer round trip take longer
        assert r["modeled_tok_s"]["100@5"] > r["modeled_tok_s"]["100@100"] > 0
        assert r["gpu_tok_s"] > 0
    ar = rows["ar"]
    assert ar["trips_per_token"] == 1.0 and ar["drafted"] == 0 and ar["node_counts"] == [0]
    # a fixed chain drafts at most its length and tests rank 1 only
    assert set(rows["chain:2"]["node_counts"]) <= {0, 1, 2}
    assert sum(rows["chain:2"]["rank_tested"][1:]) == 0
    # the tree: 6 nodes (fewer only where pruned to what is left), later ranks tested,
    # its committed row on the uplink, its verdict no bigger than a chain's
    tree = rows["3x1"]
    assert max(tree["node_counts"]) == 6 and sum(tree["rank_tested"][1:]) > 0
    assert tree["up_per_round"] > rows["chain:2"]["up_per_round"] + 100
    assert tree["accepted"] == sum(tree["rank_accepted"])


def test_measured_costs_and_the_section(rep: dict) -> None:
    [c] = rep["costs"]
    assert c["rounds"] > 0 and c["step_s"] > 0 and c["node_s"] >= 0
    assert c["step"] == pytest.approx(c["step_s"] / c["fixed_s"])
    assert c["fixed_s"] == pytest.approx(0.054)
    assert c["row_bytes"] > 50  # a head:64 row
    assert len(c["rates"]) >= 2 and all(0 <= b <= 1 for b in c["rates"])
    text = "\n".join(section_lines(rep))
    assert text.startswith("## Draft trees")
    assert "at most 0.20 round trips per token" in text
    assert ("**met**" in text) or ("**not met**" in text)
    assert "auto:measured" in format_report(rep)
    assert section_lines(None)[0] == "## Draft trees"


@pytest.mark.slow
def test_cli_writes_the_json(tmp_path) -> None:
    out = tmp_path / "trees.json"
    subprocess.run([sys.executable, "-m", "xcosd", "bench", "trees", "--shapes", "auto,2",
                    "--prompts", "1", "--tokens", "6", "--json", str(out)], check=True,
                   capture_output=True, timeout=300)
    rep = json.loads(out.read_text())
    assert rep["command"].startswith("xcosd bench trees")
    assert [r["shape"] for r in rep["records"]] == ["ar", "auto", "2", *MEASURED]
