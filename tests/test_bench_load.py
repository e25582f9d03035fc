"""``xcosd bench load``: the report's fields exist and agree with each other.

Small runs (a few devices, a few generations) against a cheap synthetic target;
speed itself is measured by `make bench`, never asserted here. Neither is what happens
inside a wall-clock window: a loaded machine may finish no generation (or no
round) in a one-second window, so what the window counts is checked on records
with set times (``analyse``), and the live duration run checks only what holds
however slow the machine is.
"""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from xcosd.bench.load import (
    LoadConfig,
    analyse,
    format_report,
    generation_settings,
    ideal,
    pipe,
    run_load,
    window_of,
)
from xcosd.cli import main
from xcosd.config import GenerationConfig

SUMMARIES = ("token_latency_ms", "round_latency_ms", "ttft_ms", "tpot_ms", "queue_wait_ms",
             "per_device_tokens_per_s")


def check_consistent(rep: dict, *, measured: bool = True) -> None:
    """Invariants every load report keeps; ``measured``: it counted at least one round
    (always true in generations mode, where the window spans measured generations)."""
    if measured:
        assert rep["tokens"] > 0 and rep["rounds"] > 0
    else:
        assert (rep["tokens"] > 0) == (rep["rounds"] > 0)  # every round emits a token
    assert rep["tokens_per_s"] * rep["window_s"] == pytest.approx(rep["tokens"])
    assert rep["rounds_per_s"] * rep["window_s"] == pytest.approx(rep["rounds"])
    b = rep["bytes"]
    assert b["up_per_token"] * rep["tokens"] == pytest.approx(b["up_total"])
    assert b["down_per_token"] * rep["tokens"] == pytest.approx(b["down_total"])
    assert (b["up_total"] > 0 and b["down_total"] > 0) or not rep["rounds"]
    for key in SUMMARIES:
        s = rep[key]
        if s["count"]:
            assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], key
    assert rep["token_latency_ms"]["count"] == rep["tokens"]
    assert rep["round_latency_ms"]["count"] == rep["rounds"]
    hist = rep["batch_size_histogram"]
    assert sum(hist.values()) == rep["batches"]
    assert sum(int(k) * v for k, v in hist.items()) == rep["batched_requests"]
    assert rep["queue_wait_ms"]["count"] in (0, rep["batched_requests"])
    per = rep["per_device"]
    assert len(per) == rep["devices"]
    assert sum(d["tokens"] for d in per) == rep["tokens"]
    assert sum(d["rounds"] for d in per) == rep["rounds"]
    assert 0.0 <= rep["acceptance_rate"] <= 1.0
    assert rep["accepted"] <= rep["drafted"]
    assert rep["mean_acceptance_length"] == pytest.approx(
        1 + rep["accepted"] / rep["rounds"] if rep["rounds"] else 0.0)
    assert set(rep["errors"]) == {"timeout", "busy", "protocol", "transport", "other"}
    assert rep["errors_total"] == sum(rep["errors"].values())
    assert 0.0 <= rep["cloud"]["busy_fraction"] <= 1.5
    for k in ("nproc", "cpu_model", "python", "numpy"):
        assert k in rep["machine"]


def check_ideal(rep: dict, batch: int) -> None:
    """The ideal of a ``synthetic:256:L:0.1`` target (a = 2 ms, b = 0.1 ms per row)."""
    idl = rep["ideal"]
    assert idl["batch"] == batch and idl["a_s"] == pytest.approx(0.002)
    assert idl["tokens_per_s"] == pytest.approx(
        batch * idl["tokens_per_round"] / (0.002 + 0.0001 * batch * idl["rows_per_session"]))
    assert idl["efficiency"] == pytest.approx(rep["tokens_per_s"] / idl["tokens_per_s"])


async def test_duration_run_in_process() -> None:
    cfg = LoadConfig(devices=3, target="synthetic:256:2:0.1", duration_s=1.0, warmup_s=0.3,
                     procs=0, generation=GenerationConfig(max_new_tokens=16))
    rep = await run_load(cfg, progress=False)
    # how much lands in the window depends on this machine's speed: not asserted
    check_consistent(rep, measured=False)
    assert rep["errors_total"] == 0  # generations cut at the window's end are no errors
    assert rep["window_s"] == pytest.approx(1.0)
    g = rep["generations"]
    assert g["started"] >= g["measured_completed"] + g["cut_at_end"]
    assert rep["ttft_ms"]["count"] <= g["started"]
    if rep["rounds"]:
        check_ideal(rep, batch=3)
    else:
        assert rep["ideal"] is None


async def test_generations_run_in_process_with_batching() -> None:
    cfg = LoadConfig(devices=3, target="synthetic:256:2:0.1", duration_s=None, generations=2,
                     warmup_generations=1, procs=0,
                     generation=GenerationConfig(max_new_tokens=16))
    rep = await run_load(cfg, progress=False)
    check_consistent(rep)
    assert rep["errors_total"] == 0
    assert rep["generations"]["started"] == 3 * 3 and rep["generations"]["warmup"] == 3
    check_ideal(rep, batch=3)


async def test_generations_run_in_a_device_process_without_batching() -> None:
    cfg = LoadConfig(devices=2, target="synthetic:256:1:0.1", duration_s=None, generations=2,
                     warmup_generations=1, procs=1, batching=False,
                     generation=GenerationConfig(method="xcosd", codec="q8", max_new_tokens=12))
    rep = await run_load(cfg, progress=False)
    check_consistent(rep)
    assert rep["errors_total"] == 0
    assert rep["generations"]["started"] == 2 * 3
    assert rep["generations"]["warmup"] == 2
    assert set(rep["batch_size_histogram"]) == {"1"}  # batching off: one session per call
    assert rep["ideal"]["batch"] == 1
    # the generation settings reached the device process and the report, nested
    assert GenerationConfig.from_dict(rep["config"]["generation"]) == cfg.generation
    assert "xcosd/q8" in format_report(rep)


def _rec(dev, k, start, end, rounds, *, error=None, warmup=False):
    return {"device": dev, "k": k, "warmup": warmup, "start": start, "end": end,
            "first": next((r[1] for r in rounds if r[2] > 0), None),
            "tokens": sum(r[2] for r in rounds), "error": error, "message": "x" if error else None,
            "cut": False, "busy_retries": 0, "resumes": 0, "up_bytes": 0, "down_bytes": 0,
            "rounds": rounds}


def test_analyse_cuts_the_window_exactly() -> None:
    cfg = LoadConfig(devices=2, duration_s=2.0, warmup_s=1.0, procs=0)
    go = 100.0
    recs = [
        # warm-up round (ends before 101) is excluded; the two others count
        _rec(0, 0, 100.0, 101.6, [(100.0, 100.5, 3, 30, 60, 4, 2), (100.5, 101.2, 5, 40, 50, 4, 4),
                                  (101.2, 101.6, 2, 20, 10, 4, 1)]),
        # starts inside the window: its TTFT and TPOT count
        _rec(1, 0, 101.5, 102.5, [(101.5, 101.9, 4, 10, 20, 4, 3), (101.9, 102.5, 3, 10, 20, 4, 2)]),
        # ends after the window: only its rounds inside count; an error counts
        _rec(1, 1, 102.5, 103.5, [(102.5, 102.9, 1, 5, 5, 4, 0), (102.9, 103.4, 4, 5, 5, 4, 3)],
             error="protocol"),
    ]
    calls = [(100.0, 100.5, 2, 10), (101.0, 101.2, 1, 5), (101.5, 101.9, 2, 10),
             (102.0, 103.5, 1, 5)]
    waits = [0.01, 0.02, 0.03, 0.04, 0.05, 0.06]
    rep = analyse(cfg, recs, calls, waits, {}, go, (0.01, 0.001))
    assert window_of(cfg, recs, go) == (101.0, 103.0)
    # device 1's first generation starts and ends inside the window: the one completed;
    # its second runs past the end (and failed), device 0's started in the warm-up
    assert rep["generations"]["measured_completed"] == 1
    assert rep["generations"]["started"] == 3
    assert rep["tokens"] == 5 + 2 + 4 + 3 + 1
    assert rep["rounds"] == 5
    assert rep["bytes"]["up_total"] == 40 + 20 + 10 + 10 + 5
    assert rep["drafted"] == 20 and rep["accepted"] == 4 + 1 + 3 + 2 + 0
    assert rep["ttft_ms"]["count"] == 2  # both generations that started in the window
    assert rep["ttft_ms"]["min"] == pytest.approx(400.0)
    assert rep["tpot_ms"]["count"] == 1
    assert rep["tpot_ms"]["p50"] == pytest.approx(1000 * (102.5 - 101.9) / 6)
    assert rep["batch_size_histogram"] == {"1": 1, "2": 1}
    assert rep["queue_wait_ms"]["count"] == 3
    assert rep["queue_wait_ms"]["mean"] == pytest.approx(1000 * (0.03 + 0.04 + 0.05) / 3)
    assert rep["errors"]["protocol"] == 1 and rep["errors_total"] == 1
    check_consistent(rep)
    # the ideal: B = 2 devices, rows = 1 + drafted / rounds = 5
    idl = ideal(cfg, (0.01, 0.001), rep)
    assert idl is not None
    assert idl["tokens_per_s"] == pytest.approx(2 * (15 / 5) / (0.01 + 0.001 * 2 * 5))


def test_cli_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "load.json"
    rc = main(["bench", "load", "-n", "2", "--target", "synthetic:256:1:0.1", "--generations",
               "1", "--warmup-generations", "1", "--procs", "0", "--max-new-tokens", "8",
               "--json", str(out), "--plots", str(tmp_path), "--no-progress"])
    assert rc == 0
    rep = json.loads(out.read_text())
    check_consistent(rep)
    assert rep["command"].startswith("xcosd ")
    assert rep["config"]["generation"]["max_new_tokens"] == 8
    assert rep["config"]["generation"]["seed"] is None and rep["config"]["seed"] == 0
    assert "tokens/s" in capsys.readouterr().out
    assert (tmp_path / "load_batches.png").stat().st_size > 1000


async def test_pipe_frames_are_the_same_both_ways() -> None:
    """The device process writes with the blocking half, the parent reads with the
    asyncio half (and the other way round): one framing, so either reads the other."""
    msg = ("done", [{"device": 1, "rounds": [(0.5, 1.0, 3, 10, 20, 4, 2)]}])
    buf = io.BytesIO()
    pipe.write(buf, msg)
    reader = asyncio.StreamReader()
    reader.feed_data(buf.getvalue())
    reader.feed_eof()
    assert await pipe.recv(reader) == msg
    with pytest.raises(asyncio.IncompleteReadError):  # the other side closed
        await pipe.recv(reader)
    assert pipe.read(io.BytesIO(pipe.frame(msg))) == msg
    with pytest.raises(EOFError):  # closed mid-frame
        pipe.read(io.BytesIO(pipe.frame(msg)[:-1]))


def test_config_travels_as_a_dict_with_its_generation_config() -> None:
    """What a device process receives (``to_dict`` through the pipe) is the config the
    parent built, its GenerationConfig included."""
    cfg = LoadConfig(devices=5, duration_s=None, generations=3, seed=11, batching=False,
                     generation=GenerationConfig(method="xcosd-e", codec="topk:64+zstd",
                                                 draft_len=6, do_sample=False, max_new_tokens=9,
                                                 stop_strings=("END",), K=5))
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["generation"] == cfg.generation.to_dict()
    assert LoadConfig.from_dict(d) == cfg
    assert pipe.read(io.BytesIO(pipe.frame(cfg.to_dict()))) == cfg.to_dict()
    # a scaling sweep's points keep the base's generation settings
    assert LoadConfig.from_dict({**d, "devices": 2}).generation == cfg.generation


def test_generation_seed_is_refused_the_run_seeds_each_generation() -> None:
    """One seed for every generation would make every device generate the same text;
    LoadConfig.seed (from which each generation's seed derives) is the run's seed."""
    with pytest.raises(ValueError, match=r"generation\.seed must be None"):
        LoadConfig(generation=GenerationConfig(seed=3))
    with pytest.raises(ValueError, match="top_p"):
        LoadConfig.from_dict({"generation": {"top_p": 0.0}})


def test_reports_from_before_the_nested_generation_still_read() -> None:
    """Reports written when the generation fields sat at the top of ``"config"`` are
    still read (by format_report, docs/RESULTS.md's writer, LoadConfig.from_dict)."""
    old = {**LoadConfig(devices=2).to_dict(), "method": "xcosd", "codec": "q8",
           "max_new_tokens": 12, "temperature": 0.0}
    del old["generation"]
    assert generation_settings(old) == {"method": "xcosd", "codec": "q8",
                                        "max_new_tokens": 12, "temperature": 0.0}
    g = LoadConfig.from_dict(old).generation
    assert (g.method, g.codec, g.max_new_tokens, g.greedy) == ("xcosd", "q8", 12, True)
    new = LoadConfig(devices=2, generation=g).to_dict()
    assert generation_settings(new) == g.to_dict()
