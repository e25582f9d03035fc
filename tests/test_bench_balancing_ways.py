"""The balancer bench's report (xcosd/bench/balancing_ways.py): the drain and kill rows
render from the JSON, and each of issue 37's goals says met or not met from the
numbers (never typed). No process is started."""

from __future__ import annotations

import copy
from typing import Any

from xcosd.bench import balancing_ways


def _point(kind: str, n: int, tps: float, vs: float) -> dict[str, Any]:
    return {"kind": kind, "replicas": n, "devices": 128, "tokens": int(6 * tps),
            "tokens_per_s": tps, "errors": 0, "ttft_ms_p50": 150.0, "ttft_ms_p99": 220.0,
            "vs_control": vs}


def _kill(kind: str, n: int, worst: float) -> dict[str, Any]:
    return {**_point(kind, n, 2_000.0, 1.0), "fault": "kill", "affected": 128 // n,
            "recovered": 128 // n, "recovery_s_max": worst, "recovery_s_p50": worst / 2,
            "bound_s": 30.0, "within_bound": worst <= 30.0}


def _drain(kind: str, n: int) -> dict[str, Any]:
    return {**_point(kind, n, 1_600.0, 1.0), "fault": "drain", "devices_moved": 64,
            "generations": 400, "generations_exact": 400, "mismatched": 0, "failed": 0,
            "failures": [], "generations_resumed": 70, "tokens_expected": 25_600,
            "tokens_exact": 25_600, "tokens_lost": 0,
            "drained": {"sessions_at_start": 64, "finished": 30, "handed_off": 34,
                        "ended_otherwise": 0, "refused": 30, "peers_told": 64,
                        "deadline_s": 1.0, "took_s": 1.05},
            "drain_rc": 0, "drain_exit_s": 1.8, "drain_deadline_s": 1.0,
            "drain_exit_grace_s": 3.0, "exited_in_time": True, "sessions_counted": True,
            "lossless": True, "vs_undisturbed": 0.52}


def _report() -> dict[str, Any]:
    points = [_point(k, n, 3_000.0 * n / 2, vs) for n in (2, 4)
              for k, vs in (("broker", 0.9), ("haproxy", 0.99), ("no-balancer", 1.0))]
    return {"counts": [2, 4], "points": points,
            "kills": [_kill(k, n, 1.5 + n / 4) for n in (2, 4) for k in balancing_ways.KINDS],
            "drains": [_drain(k, n) for n in (2, 4) for k in balancing_ways.DRAIN_KINDS],
            "goal": 0.95, "meets_goal": True, "command": "xcosd bench scale --only-balancers",
            "machine": {"nproc": 2},
            "config": {"devices": 128, "method": "xcosd-e", "draft_len": 4,
                       "max_new_tokens": 64, "target": "synthetic:256:20:0.5",
                       "duration_s": 6.0, "warmup_s": 2.0}}


def test_the_section_has_kills_at_every_count_the_drains_and_the_goals_met() -> None:
    rep = _report()
    text = "\n".join(balancing_ways.section_lines(rep))
    assert "| HAProxy, N xcosd serve | 4 | 32 of 32 | 2.50 | 1.25 | 30 | 0 |" in text
    assert ("| HAProxy, N xcosd serve | 2 | 400 of 400 | 25,600 of 25,600 | 0 | 0 | "
            "64 = 30 + 34 + 0 | 30 | 1.05 | 1.80 | 1 | 1,600 | 0.52 |") in text
    assert "| N clouds, no balancer | 4 | 400 of 400 |" in text
    assert "`--drain-timeout 1`" in text
    assert ("* Through HAProxy at 2 and 4 replicas, tokens/s >= 0.95x the no-balancer "
            "control of the same run: 2 clouds 0.99x, 4 clouds 0.99x (**met**).") in text
    assert ("heartbeat timeout (30 s): 288 of 288 affected devices over 6 kills (every way "
            "at 2 and 4 clouds), the slowest 2.50 s (**met**).") in text
    assert ("* A drain loses no token and no session (counted): 4 drains: 1,600 of 1,600 "
            "generations equal to the target's greedy decode, 0 tokens lost, 0 device "
            "errors; the drained clouds' counts add up in 4 of 4 (256 sessions at the "
            "drains' start); the drained clouds exited 1.80 to 1.80 s after SIGTERM (4 of 4 "
            "within the 1 s deadline + 3 s) (**met**).") in text
    assert not balancing_ways.failed(rep)
    plain = balancing_ways.format_report(rep)
    assert "64 = 30 + 34 + 0" in plain and plain.count("(met)") == 3
    assert text.startswith(balancing_ways.HEADING) and "HAProxy, N xcosd serve" in plain


def test_each_goal_says_not_met_from_the_numbers() -> None:
    rep = copy.deepcopy(_report())
    rep["points"][1]["vs_control"] = 0.93  # HAProxy at 2 clouds
    rep["kills"][4] = _kill("haproxy", 4, 31.0)
    d = rep["drains"][2]
    d.update(tokens_exact=25_536, tokens_lost=64, generations_exact=399, mismatched=1,
             lossless=False)
    text = "\n".join(balancing_ways.section_lines(rep))
    goals = [ln for ln in text.splitlines() if ln.startswith("* ")]
    assert len(goals) == 3 and all(g.endswith("(**not met**).") for g in goals), goals
    assert "2 clouds 0.93x" in goals[0] and "the slowest 31.00 s" in goals[1]
    assert "1,599 of 1,600 generations" in goals[2] and "64 tokens lost" in goals[2]
    assert balancing_ways.failed(rep)
    # a drained cloud whose counts do not add up, or that printed none, fails it too
    rep = copy.deepcopy(_report())
    rep["drains"][0].update(drained=None, sessions_counted=False, lossless=False)
    assert "no drained: line" in "\n".join(balancing_ways.section_lines(rep))
    assert balancing_ways.failed(rep)


def test_drain_counts_compare_every_generation_with_the_greedy_decode() -> None:
    want = {"a": [1, 2, 3], "b": [4, 5]}
    drained = {"rc": 0, "exit_s": 1.5,
               "drained": {"sessions_at_start": 3, "finished": 1, "handed_off": 2,
                           "ended_otherwise": 0, "refused": 1, "took_s": 1.0}}
    ok = balancing_ways._drain_counts([("a", [1, 2, 3], 0, None), ("b", [4, 5], 1, None)],
                                 want, drained)
    assert ok["tokens_expected"] == ok["tokens_exact"] == 5 and ok["lossless"]
    assert ok["generations_resumed"] == 1 and ok["exited_in_time"]
    bad = balancing_ways._drain_counts([("a", [1, 2, 9], 0, None), ("b", None, 0, "TimeoutError: x")],
                                  want, {**drained, "drained": {**drained["drained"],
                                                                "finished": 0}})
    assert bad["tokens_lost"] == 5 and bad["mismatched"] == 1 and bad["failed"] == 1
    assert not bad["sessions_counted"] and not bad["lossless"]
