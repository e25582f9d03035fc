"""From the devices' records and the cloud's batches to the load report: the
measured window, throughput, latency percentiles, bytes, errors, the batch-size
histogram and queue waits, and the cost model's ideal.

Pure functions of their inputs (the records, timestamped batches, queue waits and
the cloud's counters), so a test can feed them records with set times. The report
is a plain dict of JSON types; :mod:`~xcosd.bench.load.report` prints it and
docs/LOAD.md lists its fields.

Every latency summary is computed from raw samples the report also carries
(``"samples"``), so that the reports of several load generators can be merged
(:mod:`~xcosd.bench.load.merge`) into exact percentiles of the whole run: a
percentile of percentiles is not one.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..report import machine
from .config import SLO_METRICS, LoadConfig, draft_spec, model_name, percentile_key
from .devices import ERROR_CLASSES

#: the version of the report's layout (docs/LOAD.md); reports without the key are
#: version 1 (no raw samples, fixed percentiles)
SCHEMA_VERSION = 2

#: a batch the cloud ran: (start, end, sessions, rows), monotonic clock
Batch = tuple[float, float, int, int]

#: the summary percentiles every report carries whatever was asked for, since the
#: text report, the plots and docs/RESULTS.md read them
BASE_PERCENTILES = (50.0, 90.0, 99.0)

#: the latency summaries and the sample lists each is computed from, scaled to ms
LATENCY_SUMMARIES = (("ttft_ms", "ttft_s"), ("tpot_ms", "tpot_s"), ("e2e_latency_ms", "e2e_s"),
                     ("queue_wait_ms", "queue_wait_s"))


def summarize(values: Iterable[float], percentiles: Sequence[float],
              scale: float = 1.0) -> dict[str, float | int]:
    """``count``, ``mean``, ``min``, ``pQ`` for p50, p90, p99 and each of
    ``percentiles``, and ``max`` of ``values`` times ``scale``. Percentiles use
    linear interpolation (numpy's default), so they are ordered and never exceed
    the maximum. An empty input gives zeros."""
    qs = sorted(set(BASE_PERCENTILES) | {float(q) for q in percentiles})
    a = np.asarray(list(values), dtype=np.float64) * scale
    out: dict[str, float | int] = {"count": int(a.size),
                                   "mean": float(a.mean()) if a.size else 0.0,
                                   "min": float(a.min()) if a.size else 0.0}
    vals = np.percentile(a, qs) if a.size else np.zeros(len(qs))
    for q, v in zip(qs, vals, strict=True):
        out[percentile_key(q)] = float(v)
    out["max"] = float(a.max()) if a.size else 0.0
    return out


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


def sample_summaries(samples: Mapping[str, Any], percentiles: Sequence[float]) -> dict[str, Any]:
    """The report's latency summaries from its raw ``samples`` (one function for a
    run and for a merge, so both give the same numbers for the same samples)."""
    rs, rt = samples["round_s"], samples["round_tokens"]
    # one sample per token: a round's wall time over the tokens it committed
    tok = [s / n for s, n in zip(rs, rt, strict=True) for _ in range(n)]
    out: dict[str, Any] = {"token_latency_ms": summarize(tok, percentiles, 1e3),
                           "round_latency_ms": summarize(rs, percentiles, 1e3)}
    for key, name in LATENCY_SUMMARIES:
        vals = samples.get(name)
        out[key] = None if vals is None else summarize(vals, percentiles, 1e3)
    return out


def analyse(cfg: LoadConfig, records: list[dict[str, Any]],
            calls: list[Batch] | None, queue_waits: list[float] | None,
            cloud_stats: dict[str, Any] | None, go: float,
            costs: tuple[float, float] | None, *, scheduled: int | None = None,
            clock_offset: float | None = None) -> dict[str, Any]:
    """Cut the window and compute the report (pure but for ``machine`` and the host
    name: a test can feed it records).

    ``calls`` / ``cloud_stats`` ``None``: the cloud was not observed (a cloud this
    run did not start), and the cloud's fields are ``None``. ``scheduled``: the
    arrivals an open loop scheduled. ``clock_offset``: wall clock minus monotonic
    clock (now's, by default), to date the window for a merge."""
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
    for dev, r in rounds:
        per_dev[dev]["tokens"] += r[2]
        per_dev[dev]["rounds"] += 1
    for d in per_dev.values():
        d["tokens_per_s"] = d["tokens"] / span
        d["rounds_per_s"] = d["rounds"] / span

    in_window = [g for g in records if w0 <= g["start"] <= w1 and not g.get("warmup")]
    done = [g for g in in_window if g["end"] <= w1 and not g["error"] and not g["cut"]]
    observed = calls is not None and cloud_stats is not None
    # each completed generation's [ttft, tpot, e2e] together (what goodput asks); the
    # per-token and end-to-end summaries read their columns
    times = [_generation_times(g) for g in done]
    samples: dict[str, Any] = {
        "round_s": [r[1] - r[0] for _, r in rounds],
        "round_tokens": [r[2] for _, r in rounds],
        "ttft_s": [g["first"] - g["start"] for g in in_window
                   if g["first"] is not None and g["first"] <= w1],
        "tpot_s": [t[1] for t in times if t[1] is not None],
        "e2e_s": [t[2] for t in times],
        "queue_wait_s": None,
        "generation_s": times,
    }

    errors = dict.fromkeys(ERROR_CLASSES, 0)
    messages: list[str] = []
    for g in records:
        if g["error"]:
            errors[g["error"]] += 1
            if len(messages) < 5:
                messages.append(f"{g['error']}: {g['message']}")
    busy_retries = sum(g["busy_retries"] for g in records)
    errors["busy"] += busy_retries

    n_rounds = len(rounds)
    offset = time.time() - time.monotonic() if clock_offset is None else clock_offset
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": "load",
        "mode": cfg.mode,
        "config": cfg.to_dict(),
        "target": model_name(cfg.target),
        "draft": draft_spec(cfg),
        "models_given_as_objects": [n for n, m in (("target", cfg.target), ("draft", cfg.draft))
                                    if m is not None and not isinstance(m, str)],
        "percentiles": list(cfg.percentiles),
        "host": socket.gethostname(),
        "window_s": span,
        "window_unix": [w0 + offset, w1 + offset],
        "devices": cfg.devices,
        "tokens": tokens,
        "rounds": n_rounds,
        "tokens_per_s": tokens / span,
        "rounds_per_s": n_rounds / span,
        "generations_per_s": len(done) / span,
        "arrivals": None if cfg.request_rate is None else {
            "request_rate": cfg.request_rate, "burstiness": cfg.burstiness,
            "scheduled": scheduled,
            "in_window": len(in_window), "measured_rate": len(in_window) / span},
        "per_device": [per_dev[i] for i in sorted(per_dev)],
        "generations": {"started": len(records), "measured_completed": len(done),
                        "cut_at_end": sum(1 for g in records if g["cut"]),
                        "warmup": sum(1 for g in records if g.get("warmup"))},
        "bytes": {"up_total": up, "down_total": down,
                  "up_per_token": up / tokens if tokens else 0.0,
                  "down_per_token": down / tokens if tokens else 0.0},
        "drafted": drafted,
        "accepted": accepted,
        "cloud_observed": observed,
        "cpu": None,  # the runner measures it over the window (xcosd/bench/load/cpu.py)
        "errors": errors,
        "errors_total": sum(errors.values()),
        "error_messages": messages,
        # over the whole run (warm-up included): faults survived, and the greedy check
        "resumed_generations": sum(1 for g in records if g.get("resumes")),
        "exact": None if not cfg.check_greedy else {
            "checked": sum(1 for g in records if g.get("exact") is not None),
            "equal": sum(1 for g in records if g.get("exact") is True),
            "mismatched": sum(1 for g in records if g.get("exact") is False)},
        "machine": machine(),
    }
    if observed:
        assert calls is not None and cloud_stats is not None
        _cloud_fields(report, calls, queue_waits, cloud_stats, w0, w1, span, samples)
    else:
        report.update(batches=None, batched_requests=None, batch_size_histogram=None,
                      mean_batch_size=None, cloud=None)
    finish(report, samples, cfg.percentiles)
    report["goodput"] = goodput(samples["generation_s"], cfg.goodput, span)
    report["ideal"] = ideal(cfg, costs, report) if observed else None
    return report


def _generation_times(g: Mapping[str, Any]) -> list[float | None]:
    """A completed generation's times in :data:`~xcosd.bench.load.config.SLO_METRICS`
    order, ``[ttft, tpot, e2e]``, in seconds (``None`` where it
    has none: no token, or a single one, has no time per token after the first)."""
    first = g["first"]
    return [None if first is None else first - g["start"],
            (g["end"] - first) / (g["tokens"] - 1) if first is not None and g["tokens"] > 1
            else None,
            g["end"] - g["start"]]


def goodput(times: Sequence[Sequence[float | None]] | None, slo_ms: Mapping[str, float] | None,
            span: float) -> dict[str, Any] | None:
    """The completed generations that met every objective in ``slo_ms`` (ms, per
    :data:`~xcosd.bench.load.config.SLO_METRICS`) and their rate over ``span``
    seconds, as ``vllm bench serve --goodput`` counts them: a generation without a
    time for a bounded metric (one token has no time per token after the first)
    meets that bound. ``None`` without objectives, or without the times (a report
    written before they were kept)."""
    if slo_ms is None or times is None:
        return None
    bounds = [(SLO_METRICS.index(k), v / 1e3) for k, v in slo_ms.items()]  # times' order

    def met(t: Sequence[float | None]) -> bool:
        return all((x := t[i]) is None or x <= b for i, b in bounds)

    good = sum(map(met, times))
    return {"slo_ms": dict(slo_ms), "generations": good, "completed": len(times),
            "fraction": good / len(times) if times else None,
            "per_s": good / max(span, 1e-9)}


def _cloud_fields(report: dict[str, Any], calls: list[Batch], queue_waits: list[float] | None,
                  cloud_stats: Mapping[str, Any], w0: float, w1: float, span: float,
                  samples: dict[str, Any]) -> None:
    """The batches, queue waits and counters of the cloud this run started."""
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
    samples["queue_wait_s"] = waits
    report.update(
        batches=len(batches), batched_requests=sum(c[2] for c in batches),
        batch_size_histogram=hist,
        mean_batch_size=(sum(c[2] for c in batches) / len(batches)) if batches else 0.0,
        cloud={"compute_s": batch_compute, "busy_fraction": batch_compute / span,
               "mean_batch_compute_ms": 1e3 * batch_compute / len(batches) if batches else 0.0,
               "errors_by_code": cloud_stats.get("errors_by_code", {}),
               "sessions_opened": cloud_stats.get("sessions_opened", 0),
               "dropped": cloud_stats.get("dropped", 0)})


def finish(report: dict[str, Any], samples: dict[str, Any],
           percentiles: Sequence[float]) -> None:
    """The fields derived from the counts, the per-device list and the samples (a
    run's report and a merged one alike): ratios, summaries, the samples themselves."""
    tokens, n_rounds = report["tokens"], report["rounds"]
    drafted, accepted = report["drafted"], report["accepted"]
    report["per_device_tokens_per_s"] = summarize(
        (d["tokens_per_s"] for d in report["per_device"]), percentiles)
    report.update(sample_summaries(samples, percentiles))
    report["acceptance_rate"] = accepted / drafted if drafted else 0.0
    report["mean_acceptance_length"] = 1.0 + accepted / n_rounds if n_rounds else 0.0
    report["tokens_per_round"] = tokens / n_rounds if n_rounds else 0.0
    report["samples"] = samples


def ideal(cfg: LoadConfig, costs: tuple[float, float] | None,
          report: dict[str, Any]) -> dict[str, Any] | None:
    """The cost model's best throughput for this run's batch size (synthetic targets).

    A target that costs nothing (``a = b = 0``) sets no bound: ``tokens_per_s`` and
    ``efficiency`` are then ``None`` (JSON has no infinity)."""
    if costs is None or not report["rounds"]:
        return None
    a, b = costs
    rows = 1.0 + report["drafted"] / report["rounds"]  # d + 1 rows per session
    per_round = report["tokens_per_round"]
    batch = cfg.effective_batch
    t = a + b * batch * rows
    best = batch * per_round / t if t > 0 else math.inf
    bounded = math.isfinite(best) and best > 0
    return {"a_s": a, "b_s": b, "batch": batch, "rows_per_session": rows,
            "tokens_per_round": per_round, "batch_time_s": t,
            "tokens_per_s": best if bounded else None,
            "efficiency": report["tokens_per_s"] / best if bounded else None}


__all__ = ["BASE_PERCENTILES", "SCHEMA_VERSION", "Batch", "analyse", "finish", "goodput", "ideal",
           "sample_summaries", "summarize", "window_of"]
