"""``xcosd bench trees`` on the embedded pair, small: the records' counts add up, a
chain and a tree run the same round, the policy's pick is run and named, and the
RESULTS section is computed from the JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from xcosd.bench.trees import TreesConfig, format_report, run_trees, section_lines


def test_config_refuses_unknown_shapes_and_warpers() -> None:
    with pytest.raises(ValueError):
        TreesConfig(shapes=["3x0"])
    with pytest.raises(ValueError):
        TreesConfig(warpers=["T=2"])


def test_small_run_adds_up(tmp_path) -> None:
    cfg = TreesConfig(shapes=["chain:2", "3x1"], prompts=2, tokens=12)
    rep = run_trees(cfg, progress=False)
    rows = {r["shape"]: r for r in rep["records"]}
    assert {"ar", "chain:2", "3x1"} <= set(rows)
    for r in rep["records"]:
        t = r["tally"]
        assert t["tokens"] >= 2 * 12 and t["trips"] >= t["rounds"] > 0
        assert r["trips_per_token"] == pytest.approx(t["trips"] / t["tokens"])
        assert r["calls_per_token"] <= r["trips_per_token"]
    assert rows["ar"]["trips_per_token"] == 1.0
    # a chain's rounds test one child per depth: rank 1 only
    assert sum(rows["chain:2"]["tally"]["rank_tested"][1:]) == 0
    assert sum(rows["3x1"]["tally"]["rank_tested"][1:]) > 0
    pol = rep["policies"][0]
    assert sum(r["policy"] for r in rep["records"]) == 1
    assert any(r["shape"] == pol["pick"] for r in rep["records"])
    text = "\n".join(section_lines(rep))
    assert "## Draft trees" in text and f"`{pol['pick']}`" in text
    assert "3x1" in format_report(rep)


@pytest.mark.slow
def test_cli_writes_the_json(tmp_path) -> None:
    out = tmp_path / "trees.json"
    subprocess.run([sys.executable, "-m", "xcosd", "bench", "trees", "--shapes", "chain:1,2",
                    "--prompts", "1", "--tokens", "6", "--json", str(out)], check=True,
                   capture_output=True, timeout=300)
    rep = json.loads(out.read_text())
    assert rep["command"].startswith("xcosd bench trees")
    assert {r["shape"] for r in rep["records"]} >= {"ar", "chain:1", "2"}
