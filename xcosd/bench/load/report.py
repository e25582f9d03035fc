"""The load report as text: the wrk-style summary of one run and the table of a
scaling sweep (the JSON is the report dict itself, see
:mod:`~xcosd.bench.load.analysis`)."""

from __future__ import annotations

import math
from typing import Any

from .config import DEFAULT_PERCENTILES, batching_mode, generation_settings, percentile_key
from .cpu import describe as describe_cpu


def _gain(p: dict[str, Any], other: dict[str, Any] | None) -> float | None:
    return p["tokens_per_s"] / other["tokens_per_s"] if other and other["tokens_per_s"] else None


def scaling_rows(scaling: dict[str, Any]) -> list[list[Any]]:
    """``[devices, batching, tokens/s, ideal, efficiency, mean batch, p50 ms, p99 ms,
    errors, gain vs off, gain vs no merge]`` per point (the gains of batching and of
    merging at equal devices; :data:`~xcosd.bench.load.config.BATCHING_MODES`)."""
    by = {(p["devices"], batching_mode(p["config"])): p for p in scaling["points"]}
    rows = []
    for p in scaling["points"]:
        idl = p.get("ideal") or {}
        mode = batching_mode(p["config"])
        n = p["devices"]
        rows.append([n, mode, p["tokens_per_s"], idl.get("tokens_per_s"), idl.get("efficiency"),
                     p["mean_batch_size"], p["token_latency_ms"]["p50"],
                     p["token_latency_ms"]["p99"], p["errors_total"],
                     _gain(p, by.get((n, "off"))) if mode != "off" else None,
                     _gain(p, by.get((n, "no merge"))) if mode == "on" else None])
    return rows


SCALING_HEADER = ["devices", "batching", "tokens/s", "ideal tokens/s", "efficiency",
                  "mean batch", "token p50 ms", "token p99 ms", "errors", "gain vs off",
                  "gain vs no merge"]


def format_report(rep: dict[str, Any]) -> str:
    """A wrk-style text summary of one run (or of a merged one), at the report's
    percentiles."""
    c = rep["config"]
    g = generation_settings(c)
    qs = [percentile_key(q) for q in rep.get("percentiles") or DEFAULT_PERCENTILES]
    open_loop = c.get("request_rate") is not None
    b = float(c.get("burstiness", 1.0))
    loop = (f"open loop at {c['request_rate']:g} generations/s"
            + (f" (gamma gaps, burstiness {b:g})" if b != 1.0 else "")
            + (f", at most {c['max_concurrency']} in flight" if c.get("max_concurrency") else "")
            if open_loop else "closed loop")
    if c.get("connect"):
        where = f"the cloud at {c['connect']}" + (f" ({rep['target']})" if rep.get("target") else "")
    else:
        where = f"target {c['target']}"
    batching = ("" if c.get("connect") else ", batching "
                + (f"on (max {c['max_batch']})" if c["batching"] else "off"))
    lines = [
        f"{rep['devices']} devices x {loop}, {g['method']}/{g['codec']}, {where}, draft "
        f"{rep['draft']}{batching}, {c['transport']}, "
        f"{c['procs'] or 'in-process'} device process(es)",
        f"window {rep['window_s']:.2f} s: {rep['tokens']:,} tokens, {rep['rounds']:,} rounds, "
        f"{rep['tokens_per_s']:,.1f} tokens/s, {rep['rounds_per_s']:,.1f} rounds/s"
        + (f", {rep['generations_per_s']:,.2f} generations/s" if "generations_per_s" in rep
           else ""),
    ]
    arr = rep.get("arrivals")
    if arr:
        lines.append(f"  arrivals: {arr['in_window']} in the window ({arr['measured_rate']:.2f}/s "
                     f"of {arr['request_rate']:g}/s asked), {arr['scheduled']} scheduled in all")
    gp = rep.get("goodput")
    if gp:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in gp["slo_ms"].items())
        frac = "" if gp["fraction"] is None else f", {100 * gp['fraction']:.1f} % of them"
        lines.append(f"  goodput ({slos}): {gp['per_s']:,.2f} generations/s, "
                     f"{gp['generations']} of {gp['completed']} completed{frac}")
    if rep.get("sources"):
        lines.append(f"  merged from {len(rep['sources'])} load generators; their windows "
                     + (f"overlap {rep['overlap_s']:.2f} s" if rep["overlap_s"] >= 0
                        else f"DO NOT overlap ({-rep['overlap_s']:.2f} s apart): the summed "
                             "rates describe no single moment"))
    lines.append("  latency (ms)  " + "".join(f"{q:>9}" for q in [*qs, "max"]))
    for name, key in (("per token", "token_latency_ms"), ("round", "round_latency_ms"),
                      ("first token", "ttft_ms"), ("TPOT", "tpot_ms"),
                      ("end to end", "e2e_latency_ms"), ("queue wait", "queue_wait_ms")):
        s = rep.get(key)
        if s is None:  # not in older reports; the queue of a cloud not observed
            continue
        lines.append(f"  {name:<12}" + "".join(f"{s.get(q, math.nan):9.2f}" for q in [*qs, "max"])
                     + f"   (n={s['count']})")
    pd = rep["per_device_tokens_per_s"]
    lines += [
        f"  per device tokens/s: min {pd['min']:.1f}  p50 {pd['p50']:.1f}  max {pd['max']:.1f}",
        f"  acceptance rate {rep['acceptance_rate']:.3f}, mean acceptance length "
        f"{rep['mean_acceptance_length']:.2f}, tokens/round {rep['tokens_per_round']:.2f}",
        f"  bytes/token up {rep['bytes']['up_per_token']:.1f}, down "
        f"{rep['bytes']['down_per_token']:.1f}",
    ]
    if rep.get("cloud") is not None:
        hist = rep["batch_size_histogram"]
        lines.append(
            f"  cloud: {rep['batches']} batches, mean size {rep['mean_batch_size']:.1f}, busy "
            f"{100 * rep['cloud']['busy_fraction']:.0f}% of the window; sizes "
            + ", ".join(f"{k}x{v}" for k, v in list(hist.items())[:12])
            + (" ..." if len(hist) > 12 else ""))
    else:
        lines.append("  cloud: not observed (a cloud this run did not start)")
    if rep.get("cpu") is not None:
        lines.append(describe_cpu(rep["cpu"]))
    lines.append("  errors: " + ", ".join(f"{k} {v}" for k, v in rep["errors"].items())
                 + f" (total {rep['errors_total']})")
    if rep.get("resumed_generations"):
        lines.append(f"  resumed: {rep['resumed_generations']} generations survived a lost "
                     "connection (exact resume)")
    ex = rep.get("exact")
    if ex is not None:
        lines.append(f"  greedy check: {ex['equal']} of {ex['checked']} generations equal the "
                     f"target's greedy decode, {ex['mismatched']} differ")
    idl = rep.get("ideal")
    if idl:
        head = (f"  ideal (a={1e3 * idl['a_s']:g} ms, b={1e3 * idl['b_s']:g} ms/row, "
                f"B={idl['batch']}, {idl['rows_per_session']:.2f} rows, "
                f"{idl['tokens_per_round']:.2f} tokens/round): ")
        if idl["tokens_per_s"] is None:
            lines.append(head + "no bound (the target costs nothing per call)")
        else:
            lines.append(head + f"{idl['tokens_per_s']:,.1f} tokens/s -> efficiency "
                         f"{idl['efficiency']:.2f}")
    for m in rep.get("error_messages", []):
        lines.append(f"  ! {m}")
    return "\n".join(lines)


__all__ = ["SCALING_HEADER", "format_report", "scaling_rows"]
