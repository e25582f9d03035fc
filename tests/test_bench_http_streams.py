"""``xcosd bench http-streams`` at a small size, end to end: its cloud and client
processes, every stream checked against ``EdgeNode.generate``, the report and its
RESULTS section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xcosd.bench import http_streams

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_stream_completes_equal_to_generate(tmp_path: Path) -> None:
    out = tmp_path / "http_streams.json"
    proc = subprocess.run([sys.executable, "-m", "xcosd", "bench", "http-streams", "--streams",
                           "24", "--tokens", "6", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    # exit 1 is a goal missed; at 24 streams the memory goal is the whole process's
    # RSS growth (allocator arenas, pages) over few streams, so only the streams'
    # goals are judged here: the memory one is the 1,000-stream run's (RESULTS)
    assert proc.returncode in (0, 1) and out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["streams"] == 24 and rep["errors"] == 0 and rep["mismatched"] == 0
    assert proc.returncode == (0 if http_streams.met(rep) else 1)
    assert len(rep["per_stream"]) == 24
    assert all(s["tokens"] == 6 and s["ttft_ms"] > 0 for s in rep["per_stream"])
    assert rep["tokens"] == 24 * 6
    text = "\n".join(http_streams.section_lines(rep))
    assert text.startswith(http_streams.HEADING)
    assert (": met." in text) == http_streams.met(rep)
    # a mismatch or a failure misses the goal
    assert not http_streams.met({**rep, "mismatched": 1})
    assert not http_streams.met({**rep, "errors": 1})
    assert http_streams.section_lines(None) == []
