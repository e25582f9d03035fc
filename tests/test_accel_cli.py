"""Placing models on a device from the command line and from ``load_model``, and a
real ``xcosd serve`` that verifies next to its target's rows (``--verify device``)
serving a real ``xcosd edge``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from xcosd.cli import main
from xcosd.errors import ModelError
from xcosd.models import load_model
from xcosd.models.on_device import OnDevice, torch_device


def test_a_missing_device_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--target", "synthetic:256", "--device", "cuda:99"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--device" in err and "cuda:99" in err and ("no CUDA" in err or "device(s)" in err)
    with pytest.raises(SystemExit):
        main(["edge", "--draft-device", "tpu", "hello"])
    assert "--draft-device" in capsys.readouterr().err
    with pytest.raises(ModelError, match="cuda:99"):
        torch_device("cuda:99")


def test_load_model_places_any_model() -> None:
    m = load_model("synthetic:256", device="cpu")
    assert isinstance(m, OnDevice) and m.device.type == "cpu"
    s = m.start([1, 2])
    [rows] = m.score_tensors([(s, [3])])
    assert tuple(rows.shape) == (2, 256) and rows.device.type == "cpu"
    with pytest.raises(ModelError, match="dtype"):
        load_model("synthetic:256", dtype="bfloat16")


def test_serve_verifies_on_the_device_for_a_real_edge() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    serve = subprocess.Popen(
        [sys.executable, "-m", "xcosd", "serve", "--target", "synthetic:256", "--device", "cpu",
         "--verify", "device", "--bind", "tcp://127.0.0.1:0"],
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert serve.stderr is not None
        endpoint = None
        deadline = time.monotonic() + 60
        while endpoint is None and time.monotonic() < deadline:
            line = serve.stderr.readline()
            got = re.search(r"on (tcp://127\.0\.0\.1:\d+)", line)
            endpoint = got.group(1) if got else None
        assert endpoint, "xcosd serve did not start"
        edge = subprocess.run(
            [sys.executable, "-m", "xcosd", "edge", "--connect", endpoint, "--draft",
             "synthetic:256", "--method", "xcosd-e", "--max-new-tokens", "12", "--seed", "3",
             "--json", "abc"], capture_output=True, text=True, env=env, timeout=120)
        assert edge.returncode == 0, edge.stderr
        out = json.loads(edge.stdout.strip().splitlines()[-1])
        assert len(out["token_ids"]) == 12
    finally:
        serve.send_signal(signal.SIGINT)
        _, err = serve.communicate(timeout=60)
    stats = json.loads(err[err.index("{"):])
    assert stats["verify"] == "device"
    assert stats["rounds"] > 0 and stats["errors_by_code"] == {}
