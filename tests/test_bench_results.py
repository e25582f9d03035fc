"""docs/RESULTS.md sections render from their benches' JSON, with the sentences that
compare numbers computed from them (never typed), and a missing file is said so."""

from __future__ import annotations

from typing import Any

from xcosd.bench import http_api, streaming
from xcosd.bench.results import (
    section_model_layer,
    section_overlap,
    section_rounds,
    section_sampling,
)


def test_rounds_section_reports_the_ratio_to_the_echo() -> None:
    passes = [{"rounds_per_s": r, "tokens_per_s": 4 * r, "ratio": r / 10_000}
              for r in (1_500.0, 1_700.0, 1_600.0)]
    rep = {"devices": 64, "target": "synthetic:256:0.01:0.001", "window": 64, "duration_s": 4.0,
           "warmup_s": 1.5, "repeats": 3, "loop": "asyncio", "machine": {"nproc": 2},
           "results": {"xcosd-e zmq": {"rounds_per_s": 1_600.0, "echo_msgs_per_s": 10_000.0,
                                       "ratio": 0.16, "passes": passes}}}
    text = "\n".join(section_rounds(rep))
    assert "| xcosd-e zmq | 64 | 1,600 | 6,400 | 10,000 | 0.16 | 0.15 0.17 0.16 | n/a | n/a |" in text
    assert "0.16x the bare echo's message rate (goal: 0.3x)" in text
    assert "devices in the one device process" not in text  # no many-device point
    assert "event loop ran" not in text  # no CPU measured
    for p, busy in zip(passes, (0.95, 0.97, 0.93), strict=True):
        p.update(devices_us_per_round=620.0, devices_loop_busy=busy, cloud_us_per_round=120.0,
                 cloud_loop_busy=0.6)
    text = "\n".join(section_rounds(rep))
    assert "| 0.15 0.17 0.16 | n/a | n/a | 620 | 0.95 | 120 | 0.60 |" in text
    # the layout echo, where the passes measured it
    for p, lay in zip(passes, (5_000.0, 4_000.0, 6_000.0), strict=True):
        p["layout_echo_msgs_per_s"] = lay
    rep["results"]["xcosd-e zmq"]["layout_ratio"] = 0.32
    text = "\n".join(section_rounds(rep))
    assert "| 0.15 0.17 0.16 | 5,000 | 0.32 | 620 |" in text
    assert ("Against the layout echo (64 DEALERs, one message in flight each) the same "
            "rounds run 0.32x: that layout alone echoes 0.50 of the one-socket echo's "
            "rate") in text
    assert ("The devices' event loop ran 95% of the window, so the devices' process is the "
            "limit: it spends 594 µs on a round (the process 620 µs of CPU, its ZeroMQ thread "
            "included), where 0.3x of this echo is one round every 333 µs.") in text
    assert section_rounds(None)[2] == "bench/out/rounds.json is missing."
    # the many-device point: its own row, and a sentence that counts its errors
    many = [{**p, "errors": e} for p, e in zip(passes, (0, 2, 1), strict=True)]
    rep["many_devices"] = 2000
    rep["results"]["xcosd-e zmq, 2000 devices"] = {
        "devices": 2000, "rounds_per_s": 1_200.0, "echo_msgs_per_s": 10_000.0,
        "ratio": 0.12, "passes": many}
    text = "\n".join(section_rounds(rep))
    assert "| xcosd-e zmq, 2000 devices | 2,000 | 1,200 |" in text
    assert ("With 2,000 devices in the one device process the same round runs 1,200 "
            "rounds/s, 0.12x the echo and 0.75 of the rate at 64 devices, with 3 errors") in text


def test_model_layer_section_judges_the_slower_model() -> None:
    def model(ratios: list[float]) -> dict[str, Any]:
        passes = [{"generate_tok_s": 10.0, "layer_tok_s": 10.0 * r, "ratio": r} for r in ratios]
        return {"passes": passes, "generate_tok_s": 10.0, "layer_tok_s": 10.0 * ratios[1],
                "ratio": sorted(ratios)[1]}

    models = {"big": model([1.1, 1.2, 1.3]), "small": model([0.9, 0.93, 1.0])}
    rep = {"prompts": 3, "tokens_per_prompt": 32, "passes": 3, "torch_threads": 1, "goal": 0.95,
           "models": models}
    text = "\n".join(section_model_layer(rep))
    assert "at 0.93x its own `generate`" in text and "not met" in text
    models["small"] = model([0.95, 0.96, 1.0])
    assert "; met)" in "\n".join(section_model_layer(rep))
    assert section_model_layer(None) == []


def test_sampling_section_reports_the_flat_row_and_the_batch_trend() -> None:
    warp = {kind: {"top-p 0.95": {"ms": ms, "kept": 10}, "top-k 50": {"ms": 0.2, "kept": 50},
                   "T=0.7": {"ms": 0.7, "kept": 262_144}}
            for kind, ms in (("flat", 0.9), ("zipf", 1.1))}
    batch = {w: {str(n): {"ms_per_batch": n * ms, "ms_per_session": ms, "ms_per_row": ms / 5}
                  for n, ms in ((1, base), (64, 2 * base))}
             for w, base in (("T=1", 0.5), ("top-p 0.95", 2.5))}
    text = "\n".join(section_sampling({"vocab": 262_144, "warp": warp, "batch": batch}))
    assert "On the flat row top-p 0.95 takes 0.90 ms and top-k 50 0.20 ms" in text
    assert "over the 2 row shapes at most 1.10 and 0.20 ms" in text
    assert "| 1 session | 64 sessions |" in text
    assert "T=1 0.50 -> 1.00, top-p 0.95 2.50 -> 5.00 ms" in text
    assert "One call or row by row" not in text  # a report from before that measurement
    vector = {"top-k 50": {"1": {"row_by_row_ms": 0.4, "one_call_ms": 0.3},
                           "64": {"row_by_row_ms": 0.5, "one_call_ms": 0.6}}}
    text = "\n".join(section_sampling({"vocab": 262_144, "warp": warp, "batch": batch,
                                       "vector": vector}))
    assert "| warper | 1 row | 64 rows |" in text and "| top-k 50 | 0.400 / 0.300 |" in text
    assert "At 64 rows one call costs, per row, top-k 50 1.20x what" in text
    assert "top-k 50 0.40 -> 0.50 row by row, 0.30 -> 0.60 in one call" in text
    assert section_sampling(None) == []


def test_overlap_section_reports_the_ratio_and_the_share_sent() -> None:
    def setting(tok_s: float, speculated: int, used: int) -> dict[str, Any]:
        return {"tok_s": tok_s, "tokens": 256, "rounds": 64, "drafted": 200, "accepted": 150,
                "speculated": speculated, "speculated_used": used, "modeled_tok_s": 2 * tok_s}

    warpers = {"T=1": {"ratio": 1.12, "on": setting(112.0, 200, 50), "off": setting(100.0, 0, 0)},
               "greedy": {"ratio": 1.3, "on": setting(130.0, 0, 0), "off": setting(100.0, 0, 0)}}
    rep = {"target_call_s": 0.02, "draft_step_s": 0.003, "prompts": 4, "tokens_per_prompt": 64,
           "passes": 3, "warpers": warpers}
    text = "\n".join(section_overlap(rep))
    assert "sleeps 20 ms a call" in text and "sleeps 3 ms a step" in text
    assert "T=1 1.12x (25% of the speculated tokens sent as drafts)" in text
    assert "greedy 1.30x (none of the speculated" in text
    assert "| T=1 | on | 112.0 | 1.12x | 0.25 | 3.12 | 200 | 25% | 224.0 |" in text
    assert section_overlap(None) == []



def test_http_api_section_judges_each_pair_by_both_goals() -> None:
    def row(pair: str, streams: int, ratio: float, delta: float) -> dict[str, Any]:
        r = {"pair": pair, "streams": streams, "inproc_tok_s": 100.0,
             "http_tok_s": 100.0 * ratio, "inproc_ttft_ms": 10.0,
             "http_ttft_ms": 10.0 + delta, "ratio": ratio, "ttft_delta_ms": delta,
             "send_ms": 0.5 * streams, "ttft_delta_sent_ms": delta - 0.5 * streams,
             "client_cpu_share": 0.05 * streams ** 0.25}
        if streams > 1:
            r |= {"unheld_ttft_ms": 40.0, "unheld_delta_ms": 30.0, "open_bound_ms": 21.25,
                  "first_send_ms": 11.0}
        return r

    rep = {"tokens_per_stream": 64, "passes": 3, "goals": {"ratio": 0.9, "ttft_delta_ms": 5.0},
           "rows": [row("ngram", 1, 0.78, 8.0), row("ngram", 16, 0.93, 20.0),
                    row("remote", 1, 0.99, 1.5), row("remote", 16, 0.97, 4.0)]}
    text = "\n".join(http_api.section_lines(rep))
    assert "| remote | 1 | 100.0 | 99.0 | 0.99x | 10.0 | 11.5 | +1.5 | 0.5 | +1.0 |  | 5% |" in text
    assert "| remote | 16 | 100.0 | 97.0 | 0.97x | 10.0 | 14.0 | +4.0 | 8.0 | -4.0 | +30.0 | 10% |" \
        in text
    # the burst's difference split into the client's send and the rest, beside unheld opens
    assert ("`remote` +4.0 ms, of which the client's send 8.0 ms (once sent -4.0 ms; opens "
            "unheld +30.0 ms)") in text
    assert "(21.2 ms on `ngram`, 21.2 ms on `remote` at the end of the run)" in text
    assert "(the first body was written 11.0 ms on `ngram`, 11.0 ms on `remote` after" in text
    # the CPU-bound pair's ratio beside what its client alone took of the two cores
    assert ("used 5% of a core at 1 stream (ratio 0.78x) and 10% of a core at 16 streams "
            "(ratio 0.93x)") in text
    assert "met with the cloud's compute elsewhere (`remote`), not met when it shares" in text
    assert ("Counted from each request's sending, the difference is within 5 ms in 2 of 4 "
            "rows (`remote` 1, `remote` 16).") in text
    rep["rows"][3] = row("remote", 16, 0.97, 6.0)  # TTFT past the goal: not met
    assert "not met with the cloud's compute elsewhere" in "\n".join(http_api.section_lines(rep))
    assert http_api.section_lines(None) == []


def test_streaming_section_reports_the_ratio_and_the_efficiencies() -> None:
    def setting(rounds: float) -> dict[str, Any]:
        return {"rounds_per_s": rounds, "tokens_per_s": 4 * rounds, "mean_batch_size": 12.0,
                "efficiency": rounds / 240.0, "errors": 0}

    rep = {"target": "synthetic:131072:20:0.5", "devices": 48, "max_batch": 12,
           "draft_len": 4, "top_k": 50, "passes": 2, "duration_s": 6.0, "warmup_s": 3.0,
           "ideal_rounds_per_s": 240.0, "ratio": 1.18,
           "settings": {"stream": setting(228.0), "no stream": setting(192.0)}}
    text = "\n".join(streaming.section_lines(rep))
    assert "| stream | 228.0 | 912.0 | 240.0 | 0.95 | 12.0 | 1.18x | 0 |" in text
    assert "| no stream | 192.0 | 768.0 | 240.0 | 0.80 | 12.0 | 1.00x | 0 |" in text
    assert "Streaming runs 1.18x the rounds/s of verifying in the worker (228.0 against " \
           "192.0; efficiency 0.95 against 0.80" in text
    assert streaming.section_lines(None) == []
    assert streaming.ideal_rounds_per_s(12) == 12 / 0.05  # 20 ms + 0.5 ms x 60 rows


def test_only_rewrites_one_section_and_keeps_the_rest(tmp_path: Any, monkeypatch: Any) -> None:
    """``--only NAME`` replaces that section of the current RESULTS.md from its JSON
    (here a missing one, which the section says) and leaves every other line."""
    from xcosd.bench import results

    doc = tmp_path / "RESULTS.md"
    doc.write_text("# r\n\n## Load test: 64 devices\n\nold numbers\n\n## Scaling\n\nkept\n")
    monkeypatch.setattr(results, "DOC", doc)
    monkeypatch.setattr(results, "OUT", tmp_path / "out")
    assert results.main(["--only", "load"]) == 0
    text = doc.read_text()
    assert "old numbers" not in text and "bench/out/load.json is missing." in text
    assert text.index("## Load test") < text.index("## Scaling") and "kept" in text


def test_edge_runtime_section_judges_its_goals_and_where_drafting_pays() -> None:
    from xcosd.bench import edge_runtime

    def step(model: str, own: float, llama: float, torch: float) -> dict[str, Any]:
        return {"model": model, "own_ms": own, "llama_ms": llama, "torch_ms": torch,
                "vs_own": llama / own, "vs_torch": llama / torch}

    def e2e(tok_s: float, calls: int, edge_s: float) -> dict[str, Any]:
        modeled = {str(x): 32 / (edge_s + calls * 0.004 + calls * x / 1000) for x in (5, 100)}
        return {"tok_s": tok_s, "tok_s_passes": [tok_s], "tokens": 32, "rounds": calls,
                "round_trips": calls, "target_calls": calls, "drafted": 16, "accepted": 8,
                "up_bytes": 1600, "down_bytes": 1600, "edge_compute_s": edge_s,
                "cloud_compute_s": 1.0, "modeled_tok_s": modeled}

    rows = {"ar": {**e2e(20.0, 32, 0.0), "drafted": 0, "vs_own": 1.3},
            "xcosd-e": e2e(20.0, 32, 0.05), "xcosd-e seeded": e2e(10.0, 12, 0.6),
            "llama.cpp own": {"tok_s": 15.0, "tok_s_passes": [15.0]}}
    rep = {"draft": "smollm2-135m", "target": "gemma3-270m", "prompts": 3,
           "tokens_per_prompt": 32, "passes": 1, "pinned": True, "gpu_call_s": 0.004,
           "link_bps": 100e6, "rtts_ms": [5, 100],
           "steps": [step("smollm2-135m", 20.0, 18.0, 80.0), step("gemma3-270m", 100.0, 120.0, 200.0)],
           "end_to_end": {"llama.cpp": rows}}
    text = "\n".join(edge_runtime.section_lines(rep))
    assert "| smollm2-135m | 20.0 | 18.0 | 80.0 | 0.90x | 0.23x |" in text
    assert "0.90x llama.cpp's own loop (goal <= 1.1x: met)" in text
    assert "(goal for the draft <= 1/3: met)" in text
    assert "1.20x llama.cpp's own loop (goal <= 1.1x: not met)" in text  # the target
    assert "gemma3-270m" in text and text.count("goal for the draft") == 1
    assert "1.30x llama.cpp's own generation of as many tokens (goal >= 0.95x: met)" in text
    # seeded: 0.6 s of edge compute for 12 round trips instead of 32: pays at 100 ms only
    assert "modeled xcosd-e seeded / ar: RTT 5 ms" in text
    assert "drafting pays from RTT 100 ms." in text
    assert edge_runtime.section_lines(None) == []


def test_slots_section_compares_each_short_row_with_the_one_that_holds_every_session() -> None:
    from xcosd.bench import slots

    def row(n: int, fed: float, ms: float, tps: float) -> dict[str, Any]:
        return {"slots": n, "evictions": 0 if n >= 12 else 40, "fed_per_token": fed,
                "over_floor": fed / 17, "mean_batch": 12.0, "round_fed": fed * 12 - 60,
                "round_ms": ms, "tokens_per_s": tps, "kv_bytes_per_cell": 18432}

    rep = {"model": "gemma3-270m@llama.cpp", "threads": 1, "sessions": 12, "prompt_tokens": 96,
           "tokens": 6, "context": 118, "rows": [row(4, 100.0, 11000.0, 1.0),
                                                 row(16, 6.0, 220.0, 6.0)]}
    text = "\n".join(slots.section_lines(rep))
    assert "| 4 | 40 | 100.0 | 5.88 | 12.0 | 1140 | 11000 | 1.00 | 50.0x | 0.17x |" in text
    assert "- 4 slots for 12 sessions: about 11 sessions evaluated again each round" in text
    assert "(1140 tokens fed a round against 12), a round 50x as long" in text
    assert "16 slots for" not in text and "(18 KiB a position" in text


def test_chat_section_reads_the_goal_and_the_shared_prompt_from_the_report() -> None:
    from xcosd.bench import chat_turns

    def turn(k: int, ttft: float, computed: int) -> dict[str, Any]:
        return {"turn": k, "prompt_tokens": 400 + 160 * k, "ttft_s": ttft, "total_s": ttft + 1,
                "cloud_computed": computed, "edge_computed": computed + 3,
                "prompt_up_bytes": 900, "up_bytes": 1500, "answer_chars": 40}

    def shared(computed: int, reused: int) -> dict[str, Any]:
        return {"devices": 16, "system_tokens": 400, "cloud_computed": computed,
                "cloud_reused": reused, "ttft_median_s": 2.0}

    on = [turn(k, 1.0 + 0.05 * k, 170) for k in range(1, 9)]
    off = [turn(k, 2.0 * k, 400 + 160 * k) for k in range(1, 9)]
    rep = {"draft": "smollm2-135m", "target": "gemma3-270m", "backend": "llama.cpp",
           "threads_per_side": 1, "turns": 8, "devices": 16, "system_tokens": 400,
           "turn_tokens": 150, "max_tokens": 16,
           "arms": {"reuse": {"turns": on, "shared": shared(1100, 6000)},
                    "no reuse": {"turns": off, "shared": shared(7000, 0)}},
           "goal": {"turn": 8, "ratio_reuse": on[7]["ttft_s"] / on[0]["ttft_s"],
                    "ratio_no_reuse": 8.0, "ttft_speedup_at_turn": 11.4, "target": 1.5,
                    "met": True}}
    text = "\n".join(chat_turns.section_lines(rep))
    assert text.startswith(chat_turns.HEADING)
    assert "Turn 8's first token against turn 1's: 1.33x with reuse, 8.00x without" in text
    assert "(goal at most 1.5x: met)" in text
    assert "the cloud computed 1100 positions, 700 beyond one system prompt" in text
    assert "against turn 1 without reuse (the first turn of a cold process" in text
    assert chat_turns.section_lines(None) == []
