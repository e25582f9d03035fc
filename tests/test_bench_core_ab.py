"""The core's A/B bench (xcosd/bench/core_ab.py): both checkouts run the same pass in
processes of their own, pair by pair, and the report gives each side and the ratios."""

from __future__ import annotations

from pathlib import Path

from xcosd.bench import core_ab

ROOT = Path(__file__).resolve().parents[1]


def test_a_checkout_against_itself_gives_pairs_and_ratios() -> None:
    rep = core_ab.compare(["xcosd-e"], ROOT, pairs=2, generations=2, log=False)
    [row] = rep["rows"]
    assert row["method"] == "xcosd-e" and len(row["pairs"]) == 2
    for pair in row["pairs"]:
        for side in ("this", "src"):
            p = pair[side]
            assert p["rounds"] > 0 and p["cloud_us_per_round"] > 0, p
            assert p["model_us_per_round"] > 0 and p["edge_us_per_round"] > 0, p
    for side in ("cloud", "edge"):
        s = row[side]
        ratios = sorted(p["this"][f"{side}_us_per_round"] / p["src"][f"{side}_us_per_round"]
                        for p in row["pairs"])
        assert s["ratio_q1"] <= s["ratio_median"] <= s["ratio_q3"]
        assert ratios[0] <= s["ratio_median"] <= ratios[-1]
    assert rep["this"]["path"] == rep["src"]["path"] == str(ROOT)
    text = "\n".join(core_ab.lines(rep))
    assert "2 pairs of passes of 2 generations, thread CPU time" in text
    assert "xcosd-e" in text and "cloud" in text and "edge" in text


def test_a_pass_runs_the_other_checkouts_code(tmp_path: Path) -> None:
    """``--src`` is what the pass imports: a directory without xcosd fails the pass
    (no xcosd to import, or an installed one from elsewhere) rather than measuring
    some other code."""
    import subprocess

    import pytest

    with pytest.raises((RuntimeError, subprocess.CalledProcessError)):
        core_ab.one_pass("ar", tmp_path, generations=1)
