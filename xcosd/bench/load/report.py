"""The load report as text: the wrk-style summary of one run and the table of a
scaling sweep (the JSON is the report dict itself, see
:mod:`~xcosd.bench.load.analysis`)."""

from __future__ import annotations

from typing import Any

from .config import generation_settings


def scaling_rows(scaling: dict[str, Any]) -> list[list[Any]]:
    """``[devices, batching, tokens/s, ideal, efficiency, mean batch, p50 ms, p99 ms,
    errors]`` per point, and the gain of batching at equal devices."""
    by = {(p["devices"], p["config"]["batching"]): p for p in scaling["points"]}
    rows = []
    for p in scaling["points"]:
        idl = p.get("ideal") or {}
        off = by.get((p["devices"], False))
        gain = (p["tokens_per_s"] / off["tokens_per_s"]
                if p["config"]["batching"] and off and off["tokens_per_s"] else None)
        rows.append([p["devices"], "on" if p["config"]["batching"] else "off",
                     p["tokens_per_s"], idl.get("tokens_per_s"), idl.get("efficiency"),
                     p["mean_batch_size"], p["token_latency_ms"]["p50"],
                     p["token_latency_ms"]["p99"], p["errors_total"], gain])
    return rows


SCALING_HEADER = ["devices", "batching", "tokens/s", "ideal tokens/s", "efficiency",
                  "mean batch", "token p50 ms", "token p99 ms", "errors", "gain vs off"]


def format_report(rep: dict[str, Any]) -> str:
    """A wrk-style text summary of one run."""
    c = rep["config"]
    g = generation_settings(c)
    lines = [
        f"{rep['devices']} devices x closed loop, {g['method']}/{g['codec']}, target "
        f"{c['target']}, draft {rep['draft']}, batching "
        f"{'on (max ' + str(c['max_batch']) + ')' if c['batching'] else 'off'}, "
        f"{c['transport']}, {c['procs'] or 'in-process'} device process(es)",
        f"window {rep['window_s']:.2f} s: {rep['tokens']:,} tokens, {rep['rounds']:,} rounds, "
        f"{rep['tokens_per_s']:,.1f} tokens/s, {rep['rounds_per_s']:,.1f} rounds/s",
        "  latency (ms)      p50      p90      p99      max",
    ]
    for name, key in (("per token", "token_latency_ms"), ("round", "round_latency_ms"),
                      ("first token", "ttft_ms"), ("TPOT", "tpot_ms"),
                      ("queue wait", "queue_wait_ms")):
        s = rep[key]
        lines.append(f"  {name:<13} {s['p50']:8.2f} {s['p90']:8.2f} {s['p99']:8.2f} {s['max']:8.2f}"
                     f"   (n={s['count']})")
    pd = rep["per_device_tokens_per_s"]
    lines += [
        f"  per device tokens/s: min {pd['min']:.1f}  p50 {pd['p50']:.1f}  max {pd['max']:.1f}",
        f"  acceptance rate {rep['acceptance_rate']:.3f}, mean acceptance length "
        f"{rep['mean_acceptance_length']:.2f}, tokens/round {rep['tokens_per_round']:.2f}",
        f"  bytes/token up {rep['bytes']['up_per_token']:.1f}, down "
        f"{rep['bytes']['down_per_token']:.1f}",
        f"  cloud: {rep['batches']} batches, mean size {rep['mean_batch_size']:.1f}, busy "
        f"{100 * rep['cloud']['busy_fraction']:.0f}% of the window; sizes "
        + ", ".join(f"{k}x{v}" for k, v in list(rep["batch_size_histogram"].items())[:12])
        + (" ..." if len(rep["batch_size_histogram"]) > 12 else ""),
        "  errors: " + ", ".join(f"{k} {v}" for k, v in rep["errors"].items())
        + f" (total {rep['errors_total']})",
    ]
    idl = rep.get("ideal")
    if idl:
        lines.append(
            f"  ideal (a={1e3 * idl['a_s']:g} ms, b={1e3 * idl['b_s']:g} ms/row, B={idl['batch']}, "
            f"{idl['rows_per_session']:.2f} rows, {idl['tokens_per_round']:.2f} tokens/round): "
            f"{idl['tokens_per_s']:,.1f} tokens/s -> efficiency {idl['efficiency']:.2f}")
    for m in rep.get("error_messages", []):
        lines.append(f"  ! {m}")
    return "\n".join(lines)


__all__ = ["SCALING_HEADER", "format_report", "scaling_rows"]
