"""The README's examples are scripts that run: examples/quickstart.py and
examples/openai_client.py, shown verbatim; the second against the commands the
README starts it with (``xcosd serve`` and ``xcosd edge serve --http``)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.py"
OPENAI_CLIENT = ROOT / "examples" / "openai_client.py"


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


def test_readme_shows_the_openai_client_code() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{OPENAI_CLIENT.read_text()}```" in readme
    assert "xcosd edge serve --connect tcp://127.0.0.1:5555 --http 127.0.0.1:8000 &" in readme
    assert "export XCOSD_API_KEY=sk-local-example" in readme


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_openai_client_example_runs_against_the_commands() -> None:
    zmq_port, http_port = _free_port(), _free_port()
    xcosd = [sys.executable, "-m", "xcosd"]
    procs = [subprocess.Popen([*xcosd, "serve", "--bind", f"tcp://127.0.0.1:{zmq_port}"],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)]
    try:
        key = "sk-local-example"  # as the README exports it
        procs.append(subprocess.Popen(
            [*xcosd, "edge", "serve", "--connect", f"tcp://127.0.0.1:{zmq_port}",
             "--http", f"127.0.0.1:{http_port}"], cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, env={**os.environ, "XCOSD_API_KEY": key}))
        deadline = time.monotonic() + 300
        while True:  # the edge answers /health once it is connected to the cloud
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert all(p.poll() is None for p in procs), [p.stderr.read() for p in procs
                                                          if p.stderr is not None]
            assert time.monotonic() < deadline, "the edge never became healthy"
            time.sleep(0.2)
        env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{http_port}/v1",
               "OPENAI_API_KEY": key}
        r = subprocess.run([sys.executable, str(OPENAI_CLIENT)], capture_output=True, text=True,
                           timeout=300, cwd=ROOT, env=env, check=False)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip()
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                assert p.wait(timeout=60) == 0  # SIGTERM: a clean exit
            finally:
                if p.poll() is None:
                    p.kill()
