"""From the devices' records and the cloud's batches to the load report: the
measured window, throughput, latency percentiles, bytes, errors, the batch-size
histogram and queue waits, and the cost model's ideal.

Pure functions of their inputs (the records, timestamped batches, queue waits and
the cloud's counters), so a test can feed them records with set times. The report
is a plain dict of JSON types; :mod:`~xcosd.bench.load.report` prints it.
"""

from __future__ import annotations

import math
from typing import Any

from ..report import machine, summary
from .config import LoadConfig, draft_spec
from .devices import ERROR_CLASSES

#: a batch the cloud ran: (start, end, sessions, rows), monotonic clock
Batch = tuple[float, float, int, int]


def window_of(cfg: LoadConfig, records: list[dict[str, Any]], go: float) -> tuple[float, float]:
    """The measured window ``(start, end)``, as :mod:`xcosd.bench.load` defines it."""
    if cfg.duration_s is not None:
        return go + cfg.warmup_s, go + cfg.warmup_s + cfg.duration_s
    by_dev: dict[int, list[dict[str, Any]]] = {}
    for g in records:
        by_dev.setdefault(g["device"], []).append(g)
    w0 = max((max((g["end"] for g in gs if g["warmup"]), default=go) for gs in by_dev.values()),
             default=go)
    w1 = min((max(g["end"] for g in gs) for gs in by_dev.values()), default=go)
    if w1 <= w0:  # too few generations for a common steady state: use all measured ones
        measured = [g for g in records if not g["warmup"]]
        w0 = min((g["start"] for g in measured), default=go)
        w1 = max((g["end"] for g in measured), default=go)
    return w0, w1


def analyse(cfg: LoadConfig, records: list[dict[str, Any]],
            calls: list[Batch], queue_waits: list[float] | None,
            cloud_stats: dict[str, Any], go: float,
            costs: tuple[float, float] | None) -> dict[str, Any]:
    """Cut the window and compute the report (pure: a test can feed it records)."""
    w0, w1 = window_of(cfg, records, go)
    span = max(w1 - w0, 1e-9)
    rounds = [(g["device"], r) for g in records for r in g["rounds"] if w0 <= r[1] <= w1]
    tokens = sum(r[2] for _, r in rounds)
    up = sum(r[3] for _, r in rounds)
    down = sum(r[4] for _, r in rounds)
    drafted = sum(r[5] for _, r in rounds)
    accepted = sum(r[6] for _, r in rounds)

    per_dev: dict[int, dict[str, Any]] = {
        i: {"device": i, "tokens": 0, "rounds": 0} for i in range(cfg.devices)}
    tok_lat: list[float] = []
    for dev, r in rounds:
        per_dev[dev]["tokens"] += r[2]
        per_dev[dev]["rounds"] += 1
        if r[2] > 0:
            tok_lat.extend([(r[1] - r[0]) / r[2]] * r[2])
    for d in per_dev.values():
        d["tokens_per_s"] = d["tokens"] / span
        d["rounds_per_s"] = d["rounds"] / span

    in_window = [g for g in records if g["start"] >= w0 and not g.get("warmup")]
    ttft = [g["first"] - g["start"] for g in in_window if g["first"] is not None and g["first"] <= w1]
    done = [g for g in in_window if g["end"] <= w1 and not g["error"] and not g["cut"]]
    tpot = [(g["end"] - g["first"]) / (g["tokens"] - 1) for g in done
            if g["first"] is not None and g["tokens"] > 1]

    errors = dict.fromkeys(ERROR_CLASSES, 0)
    messages: list[str] = []
    for g in records:
        if g["error"]:
            errors[g["error"]] += 1
            if len(messages) < 5:
                messages.append(f"{g['error']}: {g['message']}")
    busy_retries = sum(g["busy_retries"] for g in records)
    errors["busy"] += busy_retries

    batches = [c for c in calls if w0 <= c[1] <= w1]
    hist: dict[str, int] = {}
    for c in batches:
        hist[str(c[2])] = hist.get(str(c[2]), 0) + 1
    hist = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
    batch_compute = sum(c[1] - c[0] for c in batches)
    waits: list[float] = []
    if queue_waits is not None and len(calls) and sum(c[2] for c in calls) == len(queue_waits):
        pos = 0
        for c in calls:  # the scheduler records its waits batch by batch, in order
            if w0 <= c[1] <= w1:
                waits.extend(queue_waits[pos:pos + c[2]])
            pos += c[2]

    n_rounds = len(rounds)
    report: dict[str, Any] = {
        "kind": "load",
        "config": cfg.to_dict(),
        "draft": draft_spec(cfg),
        "window_s": span,
        "devices": cfg.devices,
        "tokens": tokens,
        "rounds": n_rounds,
        "tokens_per_s": tokens / span,
        "rounds_per_s": n_rounds / span,
        "per_device": [per_dev[i] for i in sorted(per_dev)],
        "per_device_tokens_per_s": summary(d["tokens_per_s"] for d in per_dev.values()),
        "token_latency_ms": summary(tok_lat, 1e3),
        "round_latency_ms": summary((r[1] - r[0] for _, r in rounds), 1e3),
        "ttft_ms": summary(ttft, 1e3),
        "tpot_ms": summary(tpot, 1e3),
        "generations": {"started": len(records), "measured_completed": len(done),
                        "cut_at_end": sum(1 for g in records if g["cut"]),
                        "warmup": sum(1 for g in records if g.get("warmup"))},
        "bytes": {"up_total": up, "down_total": down,
                  "up_per_token": up / tokens if tokens else 0.0,
                  "down_per_token": down / tokens if tokens else 0.0},
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1.0 + accepted / n_rounds if n_rounds else 0.0,
        "tokens_per_round": tokens / n_rounds if n_rounds else 0.0,
        "batches": len(batches),
        "batched_requests": sum(c[2] for c in batches),
        "batch_size_histogram": hist,
        "mean_batch_size": (sum(c[2] for c in batches) / len(batches)) if batches else 0.0,
        "queue_wait_ms": summary(waits, 1e3),
        "cloud": {"compute_s": batch_compute, "busy_fraction": batch_compute / span,
                  "mean_batch_compute_ms": 1e3 * batch_compute / len(batches) if batches else 0.0,
                  "errors_by_code": cloud_stats.get("errors_by_code", {}),
                  "sessions_opened": cloud_stats.get("sessions_opened", 0),
                  "dropped": cloud_stats.get("dropped", 0)},
        "errors": errors,
        "errors_total": sum(errors.values()),
        "error_messages": messages,
        "machine": machine(),
    }
    report["ideal"] = ideal(cfg, costs, report)
    return report


def ideal(cfg: LoadConfig, costs: tuple[float, float] | None,
          report: dict[str, Any]) -> dict[str, Any] | None:
    """The cost model's best throughput for this run's batch size (synthetic targets)."""
    if costs is None or not report["rounds"]:
        return None
    a, b = costs
    rows = 1.0 + report["drafted"] / report["rounds"]  # d + 1 rows per session
    per_round = report["tokens_per_round"]
    batch = cfg.effective_batch
    t = a + b * batch * rows
    best = batch * per_round / t if t > 0 else math.inf
    return {"a_s": a, "b_s": b, "batch": batch, "rows_per_session": rows,
            "tokens_per_round": per_round, "batch_time_s": t, "tokens_per_s": best,
            "efficiency": report["tokens_per_s"] / best if best and math.isfinite(best) else None}


__all__ = ["Batch", "analyse", "ideal", "window_of"]
