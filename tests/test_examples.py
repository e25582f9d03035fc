"""The README's example is a script that runs: examples/quickstart.py, shown verbatim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.py"


def test_readme_shows_the_quickstart_code() -> None:
    source = QUICKSTART.read_text()
    code = source[source.index("import asyncio"):]
    assert f"```python\n{code}```" in (ROOT / "README.md").read_text()


@pytest.mark.slow
def test_quickstart_runs() -> None:
    # the embedded pair: seconds once trained (the first run in a fresh cache trains it)
    r = subprocess.run([sys.executable, str(QUICKSTART)], capture_output=True, text=True,
                       timeout=600, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    # the generated text may hold newlines of its own: find the stats line by its form
    stats = re.findall(r"^([0-9.e-]+) ([0-9]+) (stop|length)$", r.stdout, re.MULTILINE)
    assert len(stats) == 1 and r.stdout.rstrip("\n").splitlines()[-1], r.stdout
    rate, down, _ = stats[0]
    assert 0.0 <= float(rate) <= 1.0 and int(down) > 0
