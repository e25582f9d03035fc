"""``bench/gpu_check.py`` on the CPU device, small sizes: the accelerator check runs in
CI too (every section, the first-token law over ZeroMQ included), so it cannot rot
between the runs on a lent GPU (``make gpu-check``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--dtype", "float32",
         "--pair", "tiny", "--quick", "--law-n", "300", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert set(report["section_s"]) == {"pair", "generate", "verify", "law", "load"}
    assert sum(report["section_s"].values()) <= report["wall_s"]
    assert report["generate"]["transformers_generate"]["tokens"] > 0
    assert report["generate"]["ar"]["tokens"] > 0
    assert set(report["verify"]) >= {"1", "4"}
    assert report["law"]["xcosd-e"]["ok"] and report["law"]["xcosd"]["ok"]
    for method in ("ar", "xcosd-e"):
        assert report["load"][method]["device"]["tokens"] > 0
        assert report["load"][method]["host"]["tokens"] > 0
