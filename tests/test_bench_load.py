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
import contextlib
import dataclasses
import io
import itertools
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from xcosd.bench.load import (
    SCHEMA_VERSION,
    LoadConfig,
    Schedule,
    analyse,
    arrival_offsets,
    concurrency_slots,
    draft_spec,
    format_report,
    generation_settings,
    ideal,
    merge_reports,
    pipe,
    read_prompts,
    run_devices,
    run_load,
    run_load_sync,
    window_of,
)
from xcosd.bench.load.analysis import goodput, sample_summaries
from xcosd.bench.load.config import percentile_key
from xcosd.cli import build_parser, main
from xcosd.commands.bench import load_config
from xcosd.config import GenerationConfig
from xcosd.models import SyntheticModel, load_model
from xcosd.nodes import CloudNode
from xcosd.transport import CurveServer, KeyPair

SUMMARIES = ("token_latency_ms", "round_latency_ms", "ttft_ms", "tpot_ms", "e2e_latency_ms",
             "queue_wait_ms", "per_device_tokens_per_s")


def check_consistent(rep: dict, *, measured: bool = True) -> None:
    """Invariants every load report keeps; ``measured``: it counted at least one round
    (always true in generations mode, where the window spans measured generations)."""
    if measured:
        assert rep["tokens"] > 0 and rep["rounds"] > 0
    else:
        assert (rep["tokens"] > 0) == (rep["rounds"] > 0)  # every round emits a token
    if rep.get("sources") is None:
        assert rep["tokens_per_s"] * rep["window_s"] == pytest.approx(rep["tokens"])
        assert rep["rounds_per_s"] * rep["window_s"] == pytest.approx(rep["rounds"])
    else:  # merged: the generators ran side by side, each over its own window
        assert rep["tokens_per_s"] == pytest.approx(sum(s["tokens_per_s"] for s in rep["sources"]))
    b = rep["bytes"]
    assert b["up_per_token"] * rep["tokens"] == pytest.approx(b["up_total"])
    assert b["down_per_token"] * rep["tokens"] == pytest.approx(b["down_total"])
    assert (b["up_total"] > 0 and b["down_total"] > 0) or not rep["rounds"]
    assert rep["schema_version"] == SCHEMA_VERSION
    for key in SUMMARIES:
        s = rep[key]
        if s is None:  # the queue of a cloud the run did not start
            assert key == "queue_wait_ms" and not rep["cloud_observed"]
            continue
        keys = [percentile_key(q) for q in sorted({50, 90, 99, *rep["percentiles"]})]
        assert list(s) == ["count", "mean", "min", *keys, "max"], key
        if s["count"]:
            vals = [s["min"], *(s[k] for k in keys), s["max"]]
            assert vals == sorted(vals), key
    assert rep["token_latency_ms"]["count"] == rep["tokens"]
    assert rep["round_latency_ms"]["count"] == rep["rounds"]
    # the summaries are those of the raw samples the report carries (what a merge reads)
    assert sample_summaries(rep["samples"], rep["percentiles"]) == {
        k: rep[k] for k in ("token_latency_ms", "round_latency_ms", "ttft_ms", "tpot_ms",
                            "e2e_latency_ms", "queue_wait_ms")}
    # one [ttft, tpot, e2e] per completed generation, the same e2e as its own sample
    times = rep["samples"]["generation_s"]
    assert times is not None and [t[2] for t in times] == rep["samples"]["e2e_s"]
    gp = rep["goodput"]
    if rep["config"].get("goodput") is None:
        assert gp is None
    else:
        assert gp["slo_ms"] == rep["config"]["goodput"]
        assert 0 <= gp["generations"] <= gp["completed"] == len(times)
        if rep.get("sources") is None:
            assert gp == goodput(times, gp["slo_ms"], rep["window_s"])
    if rep["cloud_observed"]:
        hist = rep["batch_size_histogram"]
        assert sum(hist.values()) == rep["batches"]
        assert sum(int(k) * v for k, v in hist.items()) == rep["batched_requests"]
        assert rep["queue_wait_ms"]["count"] in (0, rep["batched_requests"])
        assert 0.0 <= rep["cloud"]["busy_fraction"] <= 1.5
    else:  # nothing observed is reported as None, never as a zero
        assert rep["cloud"] is None and rep["batches"] is None and rep["ideal"] is None
        assert rep["batch_size_histogram"] is None and rep["mean_batch_size"] is None
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
    c = rep["cpu"]  # measured over the window: duration mode, not merged, Linux
    if rep["config"]["duration_s"] is None or rep.get("sources") is not None:
        assert c is None
    if c is not None:
        d = c["devices"]
        assert d["processes"] == max(1, rep["config"]["procs"]) and d["cores"] >= 0
        assert 0.0 <= d["loop_busy"] <= 1.5 and d["loop_busy"] <= d["cores"] / d["processes"] + 0.1
        assert (d["us_per_round"] is None) == (rep["rounds"] == 0)
        # the cloud's side: only for a cloud this run started outside the devices' process
        assert c["shared"] == (rep["cloud_observed"] and rep["config"]["procs"] == 0)
        assert (c["cloud"] is not None) == (rep["cloud_observed"] and not c["shared"])
    if rep["machine"] is not None:  # a merged report keeps each source's instead
        for k in ("nproc", "cpu_model", "python", "numpy"):
            assert k in rep["machine"]
    json.loads(json.dumps(rep, allow_nan=False))  # plain JSON: no NaN, no infinity


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
    assert rep["cpu"] is None or (rep["cpu"]["shared"] and rep["cpu"]["cloud"] is None)
    g = rep["generations"]
    assert g["started"] >= g["measured_completed"] + g["cut_at_end"]
    assert rep["ttft_ms"]["count"] <= g["started"]
    if rep["rounds"]:
        check_ideal(rep, batch=3)
    else:
        assert rep["ideal"] is None


async def test_the_window_s_cpu_of_the_devices_and_of_the_cloud() -> None:
    """A device process and the cloud started here: each side's CPU over the window,
    per round and as its loop thread's busy share; the text report says it, and warns
    when the load generator itself was the limit."""
    from xcosd.bench.load import cpu

    cfg = LoadConfig(devices=4, target="synthetic:256:0.01:0.001", duration_s=1.5,
                     warmup_s=0.5, procs=1, generation=GenerationConfig(max_new_tokens=16))
    rep = await run_load(cfg, progress=False)
    check_consistent(rep)
    c = rep["cpu"]
    assert c is not None and not c["shared"] and c["window_s"] == pytest.approx(1.5, rel=0.2)
    for side in (c["devices"], c["cloud"]):
        assert side["processes"] == 1 and side["cores"] > 0 and side["us_per_round"] > 0
        assert side["us_per_round"] == pytest.approx(
            1e6 * side["cores"] * c["window_s"] / rep["rounds"])
    text = format_report(rep)
    assert "  cpu: devices " in text and "; cloud " in text
    assert ("load generator was saturated" in text) == (c["devices"]["loop_busy"] >= 0.9)
    # the warning is the busiest loop thread's, at cpu.SATURATED
    busy = {**c, "devices": {**c["devices"], "loop_busy": cpu.SATURATED}}
    assert "saturated (a device loop busy 90%" in cpu.describe(busy)
    idle = {**c, "devices": {**c["devices"], "loop_busy": 0.5}}
    assert "saturated" not in cpu.describe(idle)


def test_cpu_samples_a_thread_of_this_process() -> None:
    """``/proc`` read right: CPU spent in this thread shows in both its counters."""
    import os
    import threading

    from xcosd.bench.load import cpu

    me = (os.getpid(), threading.get_native_id())
    before = cpu.sample(*me)
    if before is None:
        pytest.skip("no /proc (not Linux)")
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    after = cpu.sample(*me)
    assert after is not None and after[0] - before[0] >= 0.15 and after[1] - before[1] >= 0.15
    assert cpu.sample(*me) is not None and cpu.sample(me[0], 1 << 30) is None  # no such thread
    side = cpu.side([before], [after], 0.2, 10)
    assert side is not None and side["loop_busy"] >= 0.75 and side["processes"] == 1
    assert cpu.side([before], [None], 0.2, 10) is None


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


# --------------------------------------------------------------- a cloud run elsewhere


@contextlib.asynccontextmanager
async def serving(spec: str = "synthetic:256:1:0.1", **kw: Any) -> AsyncIterator[CloudNode]:
    """A cloud the load test did not start (as `xcosd serve` would run it)."""
    async with CloudNode(load_model(spec), bind="tcp://127.0.0.1:0", **kw) as cloud:
        yield cloud


async def test_connect_loads_a_cloud_it_did_not_start() -> None:
    async with serving() as cloud:
        cfg = LoadConfig(devices=2, connect=cloud.endpoint, target="synthetic:256:1:0.1",
                         duration_s=None, generations=2, warmup_generations=1, procs=0,
                         generation=GenerationConfig(max_new_tokens=12))
        rep = await run_load(cfg, progress=False)
        # a generation's ``close`` goes out after its output is complete: the last
        # ones may still be on their way when the run returns
        deadline = time.monotonic() + 10
        while cloud.stats()["sessions_closed"] < 2 * 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        stats = cloud.stats()
    check_consistent(rep)
    assert rep["errors_total"] == 0 and not rep["cloud_observed"]
    assert rep["generations"]["started"] == 2 * 3
    # the cloud started here served every generation as a session of its own
    assert stats["sessions_opened"] == stats["sessions_closed"] == 2 * 3
    assert stats["emitted_tokens"] >= rep["tokens"] > 0
    assert rep["config"]["connect"] == cloud.endpoint and rep["target"] == "synthetic:256:1:0.1"
    assert "not observed" in format_report(rep)


async def test_connect_with_curve_from_a_device_process(tmp_path) -> None:
    """Devices in a device process reach a CURVE cloud with key files (those of
    `xcosd edge`); the cloud admits only the allowlisted device key."""
    server, device = KeyPair.generate(), KeyPair.generate()
    server_pub, _ = server.save(tmp_path / "server", "server")
    _, device_secret = device.save(tmp_path / "device", "device")
    assert device_secret is not None
    async with serving(curve=CurveServer(server, {device.public})) as cloud:
        cfg = LoadConfig(devices=2, connect=cloud.endpoint, target="synthetic:256:1:0.1",
                         curve_secret=str(device_secret), curve_server_key=str(server_pub),
                         duration_s=None, generations=1, warmup_generations=0, procs=1,
                         generation=GenerationConfig(max_new_tokens=8))
        rep = await run_load(cfg, progress=False)
        stats = cloud.stats()
    check_consistent(rep)
    assert rep["errors_total"] == 0
    assert stats["sessions_opened"] == rep["generations"]["started"] == 2


def test_connect_options_are_checked() -> None:
    with pytest.raises(ValueError, match="go together"):
        LoadConfig(connect="tcp://127.0.0.1:1", curve_secret="a.key_secret")
    with pytest.raises(ValueError, match="did not start"):
        LoadConfig(curve_secret="a.key_secret", curve_server_key="s.key")
    with pytest.raises(ValueError, match="not be a model object"):
        LoadConfig(connect="tcp://127.0.0.1:1", target=SyntheticModel(256))
    # with connect the target is unknown unless named: the default draft is then the
    # default pair's, whose target `xcosd serve` serves by default
    cfg = LoadConfig(connect="tcp://127.0.0.1:1")
    assert cfg.target is None and draft_spec(cfg) == "default-draft"
    assert LoadConfig().target == "synthetic:256:20:0.5"


# --------------------------------------------------------------- open loop


async def test_open_loop_starts_one_generation_per_poisson_arrival() -> None:
    cfg = LoadConfig(devices=2, target="synthetic:256:0:0", request_rate=20.0, duration_s=1.0,
                     warmup_s=0.5, procs=0, seed=3, generation=GenerationConfig(max_new_tokens=6))
    arrivals = arrival_offsets(cfg)
    # the arrival process is the seed's: repeatable, another seed another one
    assert arrivals == arrival_offsets(cfg)
    assert arrivals != arrival_offsets(dataclasses.replace(cfg, seed=4))
    assert all(0 < a < 1.5 for a in arrivals) and arrivals == sorted(arrivals)
    expected = 20.0 * 1.5
    assert abs(len(arrivals) - expected) <= 5 * math.sqrt(expected)  # a generous Poisson bound
    rep = await run_load(cfg, progress=False)
    check_consistent(rep, measured=False)
    assert rep["mode"] == "open" and rep["errors_total"] == 0
    # every arrival started a generation, busy device or not, and nothing else did
    assert rep["generations"]["started"] == rep["arrivals"]["scheduled"] == len(arrivals)
    # a generation's start is its arrival time (a late start still counts from there)
    assert rep["arrivals"]["in_window"] == sum(1 for a in arrivals if a >= 0.5)
    assert "open loop at 20 generations/s" in format_report(rep)


def test_burstiness_shapes_the_gaps_between_arrivals_not_their_rate() -> None:
    """Gamma gaps of shape B and mean 1/R (``vllm bench serve``'s ``--burstiness``):
    the coefficient of variation of the gaps is 1/sqrt(B), so B = 1 is the Poisson
    process (and draws exactly the exponential gaps it always drew), B = 0.25 comes
    in bursts (CV 2) and B = 4 nearly evenly (CV 0.5), all at the same rate."""
    base = LoadConfig(devices=1, request_rate=1000.0, duration_s=30.0, warmup_s=0.0, seed=7)
    rng = np.random.default_rng([7, 0x0A11])
    poisson = np.cumsum(rng.exponential(1e-3, 40_000))
    assert arrival_offsets(base) == [float(t) for t in poisson[poisson < 30.0]]
    for b, cv in ((0.25, 2.0), (1.0, 1.0), (4.0, 0.5)):
        gaps = np.diff([0.0, *arrival_offsets(dataclasses.replace(base, burstiness=b))])
        # 30,000 gaps: the mean within 3 %, the CV within 5 % (many sigmas either way)
        assert gaps.mean() == pytest.approx(1e-3, rel=0.03), b
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05), b
    # a closed loop has no arrivals to shape; the shape must be a positive number
    with pytest.raises(ValueError, match="request_rate"):
        LoadConfig(burstiness=0.5)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="burstiness"):
            LoadConfig(request_rate=10.0, burstiness=bad)
    p = build_parser()
    args = p.parse_args(["bench", "load", "--request-rate", "5", "--burstiness", "0.5"])
    assert load_config(args).burstiness == 0.5
    with pytest.raises(SystemExit):
        main(["bench", "load", "--burstiness", "0.5"])  # refused before anything loads


def test_goodput_counts_the_generations_that_met_every_objective() -> None:
    # [ttft, tpot, e2e] in seconds; a single token has no time per token after it
    times = [[0.1, 0.02, 1.0], [0.3, 0.02, 1.0], [0.1, 0.06, 2.0], [0.1, None, 0.1]]
    g = goodput(times, {"ttft": 200.0, "tpot": 50.0}, 2.0)
    assert g == {"slo_ms": {"ttft": 200.0, "tpot": 50.0}, "generations": 2, "completed": 4,
                 "fraction": 0.5, "per_s": 1.0}
    assert goodput(times, {"e2e": 1000.0}, 2.0)["generations"] == 3  # a bound is inclusive
    assert goodput(times, None, 2.0) is None and goodput(None, {"e2e": 1.0}, 2.0) is None
    assert goodput([], {"e2e": 1.0}, 2.0)["fraction"] is None
    # analyse keeps the times of the completed generations and counts them
    cfg = LoadConfig(devices=1, duration_s=2.0, warmup_s=1.0, procs=0,
                     goodput={"ttft": 300, "e2e": 600})
    recs = [_rec(0, 0, 101.0, 101.5, [(101.0, 101.2, 2, 1, 1, 1, 1), (101.2, 101.5, 2, 1, 1, 1, 1)]),
            _rec(0, 1, 101.5, 102.5, [(101.5, 102.0, 2, 1, 1, 1, 1), (102.0, 102.5, 2, 1, 1, 1, 1)])]
    rep = analyse(cfg, recs, None, None, None, 100.0, None)
    assert rep["samples"]["generation_s"] == [pytest.approx([0.2, 0.1, 0.5]),
                                              pytest.approx([0.5, 0.5 / 3, 1.0])]
    assert rep["goodput"]["generations"] == 1 and rep["goodput"]["per_s"] == 0.5
    assert "goodput (ttft <= 300 ms, e2e <= 600 ms): 0.50 generations/s" in format_report(rep)
    # objectives: known metrics, milliseconds > 0
    for bad in ({}, {"itl": 5.0}, {"ttft": 0}, {"e2e": math.inf}, {"tpot": True}):
        with pytest.raises(ValueError, match="goodput"):
            LoadConfig(goodput=bad)
    p = build_parser()
    args = p.parse_args(["bench", "load", "--goodput", "ttft:500", "e2e:4000"])
    assert load_config(args).goodput == {"ttft": 500.0, "e2e": 4000.0}
    for bad_arg in ("ttft", "ttft:0", "latency:5", "tpot:x"):
        with pytest.raises(SystemExit):
            p.parse_args(["bench", "load", "--goodput", bad_arg])


async def test_a_run_with_objectives_reports_its_goodput() -> None:
    """A real run: the goodput counts the run's own completed generations, so a
    generous objective takes all of them and one no generation can meet none."""
    def cfg(slos: dict[str, float]) -> LoadConfig:
        return LoadConfig(devices=2, target="synthetic:256:1:0.1", duration_s=None,
                          generations=2, warmup_generations=0, procs=0, goodput=slos,
                          generation=GenerationConfig(max_new_tokens=8))

    easy = await run_load(cfg({"e2e": 60_000.0, "ttft": 60_000.0}), progress=False)
    check_consistent(easy)
    assert easy["goodput"]["generations"] == easy["goodput"]["completed"] >= 1
    assert easy["goodput"]["fraction"] == 1.0
    hard = await run_load(cfg({"ttft": 1e-6}), progress=False)
    check_consistent(hard)
    assert hard["goodput"]["generations"] == 0 < hard["goodput"]["completed"]


def test_the_concurrency_cap_splits_exactly_over_device_processes() -> None:
    for cap, devices, procs in ((1, 1, 1), (3, 8, 3), (8, 8, 3), (20, 8, 3), (5, 5, 5)):
        cfg = LoadConfig(devices=devices, request_rate=10.0, max_concurrency=cap, procs=procs)
        ids = list(range(devices))
        parts = [ids[i::procs] for i in range(procs)]  # how the runner splits the devices
        shares = [concurrency_slots(cfg, part) for part in parts]
        assert sum(shares) == cap and min(shares) >= 1, (cap, devices, procs, shares)
    assert concurrency_slots(LoadConfig(request_rate=1.0), [0, 1]) is None
    with pytest.raises(ValueError, match="closed loop"):
        LoadConfig(max_concurrency=4)
    with pytest.raises(ValueError, match="at least procs"):
        LoadConfig(devices=8, request_rate=1.0, max_concurrency=2, procs=3)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_concurrency"):
            LoadConfig(request_rate=1.0, max_concurrency=bad)  # type: ignore[arg-type]
    p = build_parser()
    args = p.parse_args(["bench", "load", "--request-rate", "5", "--max-concurrency", "3"])
    assert load_config(args).max_concurrency == 3
    with pytest.raises(SystemExit):
        main(["bench", "load", "--max-concurrency", "3"])  # refused before anything loads


@pytest.mark.parametrize("cap", [None, 1])
async def test_an_arrival_past_the_cap_waits_for_a_slot_timed_from_its_arrival(
        cap: int | None) -> None:
    """Arrivals far faster than a generation takes: without a cap they run at once,
    several in flight on the one device; with a cap of 1 they run one after another,
    and the wait for the slot is in their latency (their start is the arrival)."""
    cfg = LoadConfig(devices=1, target="synthetic:256:2:0.1", request_rate=400.0,
                     duration_s=None, generations=6, warmup_generations=0, procs=0,
                     max_concurrency=cap, generation=GenerationConfig(max_new_tokens=8))

    async def go() -> Schedule:
        return Schedule(time.monotonic(), None)

    async with serving() as cloud:
        records = await run_devices(cfg, cloud.endpoint, [0], go)
    assert len(records) == 6 and not any(g["error"] or g["cut"] for g in records)
    spans = sorted((g["rounds"][0][0], g["end"], g["start"]) for g in records)
    overlaps = sum(1 for a, b in itertools.pairwise(spans) if b[0] < a[1])
    if cap is None:
        assert overlaps > 0  # the test can tell: uncapped, generations run side by side
    else:
        assert overlaps == 0
        # the last arrival came while the generation before it still ran and started
        # only after it ended: its latency counts that wait, from its arrival
        last, before = spans[-1], spans[-2]
        assert last[2] < before[1] <= last[0]


async def test_concurrent_generations_on_one_device_keep_their_own_rounds() -> None:
    """An open loop runs several generations on one EdgeNode at once; each round goes
    to the log of its own generation (one ``on_round`` hook per node)."""
    cfg = LoadConfig(devices=1, target="synthetic:256:1:0.1", request_rate=500.0, rtt_ms=30.0,
                     duration_s=None, generations=5, warmup_generations=0, procs=0,
                     generation=GenerationConfig(max_new_tokens=10))

    async def go() -> Schedule:
        return Schedule(time.monotonic(), None)

    async with serving() as cloud:
        records = await run_devices(cfg, cloud.endpoint, [0], go)
    assert len(records) == 5
    for g in records:
        assert not g["error"] and not g["cut"]
        # the rounds logged for a generation add up to exactly what it returned
        assert sum(r[2] for r in g["rounds"]) == g["tokens"] == 10
        assert all(g["start"] <= r[0] <= r[1] <= g["end"] for r in g["rounds"])


def test_request_rate_inf_is_the_closed_loop() -> None:
    assert LoadConfig(request_rate=math.inf).request_rate is None
    assert LoadConfig().mode == "closed" and LoadConfig(request_rate=2).mode == "open"
    with pytest.raises(ValueError, match="request_rate"):
        LoadConfig(request_rate=0.0)
    p = build_parser()
    assert load_config(p.parse_args(["bench", "load", "--request-rate", "inf"])).request_rate is None
    assert load_config(p.parse_args(["bench", "load", "--request-rate", "2.5"])).request_rate == 2.5


# --------------------------------------------------------------- merging load generators


async def test_reports_of_two_generators_merge_into_exact_percentiles(tmp_path, capsys) -> None:
    """Two load generators against one cloud at the same time; the merged report
    counts both, and its percentiles are those of their samples together."""
    async with serving() as cloud:
        def cfg(devices: int, seed: int) -> LoadConfig:
            return LoadConfig(devices=devices, connect=cloud.endpoint, seed=seed,
                              target="synthetic:256:1:0.1", duration_s=None, generations=2,
                              warmup_generations=1, procs=0,
                              generation=GenerationConfig(max_new_tokens=10))

        a, b = await asyncio.gather(run_load(cfg(2, 1), progress=False),
                                    run_load(cfg(1, 2), progress=False))
    paths = []
    for name, rep in (("a", a), ("b", b)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(rep))
    out = tmp_path / "merged.json"
    assert main(["bench", "load-merge", *map(str, paths), "--percentiles", "50,95",
                 "--json", str(out)]) == 0
    m = json.loads(out.read_text())
    a, b = (json.loads(p.read_text()) for p in paths)  # as the merge read them
    check_consistent(m)
    assert m["devices"] == 3 and len(m["per_device"]) == 3 and len(m["sources"]) == 2
    assert [d["device"] for d in m["per_device"]] == [0, 1, 2]
    for k in ("tokens", "rounds", "drafted", "accepted", "errors_total"):
        assert m[k] == a[k] + b[k], k
    assert m["generations"]["started"] == a["generations"]["started"] + b["generations"]["started"]
    assert m["tokens_per_s"] == pytest.approx(a["tokens_per_s"] + b["tokens_per_s"])
    for key, name in (("round_latency_ms", "round_s"), ("ttft_ms", "ttft_s"),
                      ("tpot_ms", "tpot_s"), ("e2e_latency_ms", "e2e_s")):
        both = a["samples"][name] + b["samples"][name]
        assert m["samples"][name] == both
        assert m[key]["count"] == a[key]["count"] + b[key]["count"] == len(both)
        if both:
            for q in (50, 95, 99):
                assert m[key][f"p{q}"] == float(np.percentile(np.asarray(both) * 1e3, q)), key
    tok = [s / n for s, n in zip(m["samples"]["round_s"], m["samples"]["round_tokens"],
                                 strict=True) for _ in range(n)]
    assert m["token_latency_ms"]["p95"] == float(np.percentile(np.asarray(tok) * 1e3, 95))
    assert m["queue_wait_ms"] is None and m["cloud"] is None  # no cloud observed
    text = capsys.readouterr().out
    assert "merged from 2 load generators" in text and "p95" in text


def test_merge_refuses_what_it_cannot_merge_exactly() -> None:
    cfg = LoadConfig(devices=1, duration_s=2.0, warmup_s=1.0, procs=0)
    recs = [_rec(0, 0, 101.0, 102.0, [(101.0, 101.5, 3, 30, 60, 4, 2)])]
    rep = analyse(cfg, recs, [], None, {}, 100.0, None)
    old = {k: v for k, v in rep.items() if k not in ("samples", "schema_version")}
    with pytest.raises(ValueError, match="without raw samples"):
        merge_reports([rep, old])
    other = analyse(dataclasses.replace(cfg, generation=GenerationConfig(codec="q8")), recs, [],
                    None, {}, 100.0, None)
    with pytest.raises(ValueError, match="other settings"):
        merge_reports([rep, other])
    with pytest.raises(ValueError, match="nothing to merge"):
        merge_reports([])
    # open loops with differently shaped arrivals: their union is neither process
    ocfg = dataclasses.replace(cfg, request_rate=5.0)
    opens = [analyse(dataclasses.replace(ocfg, burstiness=b), recs, [], None, {}, 100.0, None,
                     scheduled=12)
             for b in (1.0, 0.5, 0.5)]
    with pytest.raises(ValueError, match="burstiness"):
        merge_reports(opens[:2])
    both = merge_reports(opens[1:])
    assert both["arrivals"]["burstiness"] == 0.5 and both["arrivals"]["request_rate"] == 10.0
    assert "burstiness 0.5" in format_report(both)
    capped = [analyse(dataclasses.replace(ocfg, max_concurrency=c), recs, [], None, {}, 100.0,
                      None, scheduled=12) for c in (2, 3)]
    assert merge_reports(capped)["config"]["max_concurrency"] == 5
    assert merge_reports([capped[0], opens[0]])["config"]["max_concurrency"] is None
    assert "at most 2 in flight" in format_report(capped[0])
    # goodput adds up over generators that counted it against the same objectives
    gcfg = dataclasses.replace(cfg, goodput={"e2e": 800.0})
    slo = analyse(gcfg, recs, [], None, {}, 100.0, None)
    two = merge_reports([slo, slo])
    assert two["goodput"]["generations"] == 2 * slo["goodput"]["generations"]
    assert two["goodput"]["per_s"] == 2 * slo["goodput"]["per_s"]
    assert two["samples"]["generation_s"] == 2 * slo["samples"]["generation_s"]
    with pytest.raises(ValueError, match="goodput"):
        merge_reports([rep, slo])
    # a merged report merges again, its sources flattened
    twice = merge_reports([merge_reports([rep, rep]), rep])
    assert twice["tokens"] == 3 * rep["tokens"] and len(twice["sources"]) == 3


# --------------------------------------------------------------- prompts, percentiles, fixes


def test_prompts_file_plain_or_json_lines(tmp_path) -> None:
    plain = tmp_path / "p.txt"
    plain.write_text("first prompt\n\n{not json\nthird\n")
    assert read_prompts(plain) == ("first prompt", "{not json", "third")
    jl = tmp_path / "p.data"  # JSON Lines told by its first line, whatever the name
    jl.write_text(json.dumps({"prompt": "a\nb", "id": 1}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    assert read_prompts(jl) == ("a\nb", "c")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"text": "y"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_prompts(bad)
    with pytest.raises(SystemExit):  # the CLI says so before anything runs
        main(["bench", "load", "--prompts-file", str(bad)])


def test_cli_free_target_prompts_file_and_percentiles(tmp_path, capsys) -> None:
    """A target that costs nothing (``synthetic:256:0:0``) has no ideal throughput:
    the report says so instead of failing to format it."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("one", "two\nlines")))
    out = tmp_path / "load.json"
    rc = main(["bench", "load", "-n", "2", "--target", "synthetic:256:0:0", "--generations", "1",
               "--warmup-generations", "1", "--procs", "0", "--max-new-tokens", "8",
               "--prompts-file", str(prompts), "--percentiles", "99.9,50,95",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    rep = json.loads(out.read_text())
    check_consistent(rep)
    assert rep["percentiles"] == [50.0, 95.0, 99.9]
    assert rep["config"]["prompts"] == ["one", "two\nlines"]
    for key in ("token_latency_ms", "round_latency_ms", "ttft_ms", "e2e_latency_ms"):
        assert {"p50", "p90", "p95", "p99", "p99.9"} <= set(rep[key])
    assert rep["ideal"]["tokens_per_s"] is None and rep["ideal"]["efficiency"] is None
    text = capsys.readouterr().out
    assert "p99.9" in text and "no bound" in text


def test_cli_connect_options_map_to_the_config(tmp_path) -> None:
    key, sec = tmp_path / "s.key", tmp_path / "d.key_secret"
    key.write_text("x")
    sec.write_text("x")
    p = build_parser()
    args = p.parse_args(["bench", "load", "--connect", "tcp://10.0.0.1:5555", "--curve-secret",
                         str(sec), "--curve-server-key", str(key), "--connect-timeout", "5"])
    cfg = load_config(args)
    assert (cfg.connect, cfg.curve_secret, cfg.curve_server_key, cfg.connect_timeout_s) == (
        "tcp://10.0.0.1:5555", str(sec), str(key), 5.0)
    assert cfg.target is None and cfg.percentiles == (50.0, 90.0, 99.0)
    for argv, msg in ((["--curve-secret", str(sec)], "go together"),
                      (["--curve-secret", str(sec), "--curve-server-key", str(key)], "--connect"),
                      (["--connect", "tcp://127.0.0.1:1", "--scaling", "1,2"], "--scaling"),
                      (["--percentiles", "50,101"], "percentiles")):
        with pytest.raises(SystemExit) as e:
            main(["bench", "load", *argv])
        assert e.value.code == 2, (argv, msg)


# --------------------------------------------------------------- the Python API


async def test_model_objects_run_in_process_and_sync_wrappers_refuse_a_running_loop() -> None:
    target = SyntheticModel(256, a=0.001, b=0.0001, name="my-target")
    draft = SyntheticModel(target.vocab, skew=0.9, name="my-draft")
    cfg = LoadConfig(devices=2, target=target, draft=draft, duration_s=None, generations=1,
                     warmup_generations=1, generation=GenerationConfig(max_new_tokens=8))
    assert cfg.procs == 0  # the draft object drafts here: the devices run in this loop
    rep = await run_load(cfg, progress=False)
    check_consistent(rep)
    assert rep["errors_total"] == 0
    assert rep["models_given_as_objects"] == ["target", "draft"]
    assert (rep["target"], rep["draft"]) == ("my-target", "my-draft")
    assert rep["config"]["target"] == "my-target"
    assert rep["ideal"]["a_s"] == pytest.approx(0.001)  # the object's own cost model
    with pytest.raises(ValueError, match="loads its draft by name"):
        LoadConfig(target=target, draft=draft, procs=1)
    with pytest.raises(ValueError, match="target object's vocabulary"):
        LoadConfig(target=target, procs=1)  # the synthetic default draft needs it
    with pytest.raises(RuntimeError, match=r"await run_load"):
        run_load_sync(cfg)


async def test_target_object_with_a_named_draft_in_a_device_process() -> None:
    """A target object is served here; the device process loads the draft by name
    and fetches the target's vocabulary from the cloud."""
    cfg = LoadConfig(devices=2, target=SyntheticModel(256, a=0.001, name="obj"),
                     draft="synthetic:256:0:0", duration_s=None, generations=1,
                     warmup_generations=0, generation=GenerationConfig(max_new_tokens=8))
    assert cfg.procs == 1
    rep = await run_load(cfg, progress=False)
    check_consistent(rep)
    assert rep["errors_total"] == 0 and rep["models_given_as_objects"] == ["target"]


async def test_rounds_bench_reports_rounds_against_the_bare_echo() -> None:
    """``python -m xcosd.bench.transport --rounds``, shrunk: every method and
    transport asked for has its rounds/s, the bare echo of its passes and their
    ratio (rounds over the mean of the echo before and after each load run); the
    text report names them. Speed is not asserted."""
    from xcosd.bench.transport import format_rounds, run_rounds

    res = await run_rounds(True, 1, ["ar"], ["zmq", "tcp"], devices=2, many=3,
                           duration_s=0.3, warmup_s=0.1, n_echo=200)
    assert res["devices"] == 2 and res["many_devices"] == 3
    assert set(res["results"]) == {"ar zmq", "ar tcp", "xcosd-e zmq, 3 devices"}
    assert [r["devices"] for r in res["results"].values()] == [2, 2, 3]
    for r in res["results"].values():
        [p] = r["passes"]
        assert p["echo_msgs_per_s"] > 0 and p["errors"] == 0
        assert p["devices_us_per_round"] is None or p["devices_us_per_round"] > 0
        assert p["cloud_us_per_round"] is None or p["cloud_us_per_round"] > 0
        assert p["ratio"] == pytest.approx(p["rounds_per_s"] / p["echo_msgs_per_s"])
        assert r["ratio"] == p["ratio"]
        # the second yardstick: the same sockets as the devices, one message each
        assert p["layout_echo_msgs_per_s"] > 0
        assert p["layout_ratio"] == pytest.approx(p["rounds_per_s"] / p["layout_echo_msgs_per_s"])
        assert r["layout_ratio"] == p["layout_ratio"]
    assert "ar zmq" in format_rounds(res) and "layout ratio" in format_rounds(res)


def test_a_scaling_sweep_reports_the_gains_of_batching_and_of_merging() -> None:
    """Each point's batching mode comes from its config (a report from before the
    merge policy batched without it); the gains compare points at equal devices."""
    from xcosd.bench.load import BATCHING_MODES, batching_mode, scaling_rows

    def point(n: int, mode: str, tps: float) -> dict[str, Any]:
        cfg = LoadConfig(devices=n, batching=mode != "off",
                         merge_batches=mode == "on").to_dict()
        return {"devices": n, "config": cfg, "tokens_per_s": tps, "mean_batch_size": 1.0,
                "token_latency_ms": {"p50": 1.0, "p99": 2.0}, "errors_total": 0}

    pts = [point(8, "on", 300.0), point(8, "no merge", 200.0), point(8, "off", 100.0)]
    assert [batching_mode(p["config"]) for p in pts] == list(BATCHING_MODES)
    old = dict(pts[0]["config"])
    del old["merge_batches"]
    assert batching_mode(old) == "no merge"
    rows = scaling_rows({"points": pts})
    assert [(r[1], r[9], r[10]) for r in rows] == [("on", 3.0, 1.5), ("no merge", 2.0, None),
                                                   ("off", None, None)]
