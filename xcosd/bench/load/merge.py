"""One report from the reports of several load generators that loaded the same
cloud at the same time (``xcosd bench load --merge a.json b.json ...``).

Each generator's report carries its raw samples (round latencies, TTFT, TPOT,
end-to-end latencies); the merged summaries are computed from the concatenated
samples by the same code as a single run's, so its percentiles are those of the
whole run, exactly, not averages of per-generator percentiles. Counts and totals
add up; rates add up too, since the generators ran side by side (each input's
window is dated in wall-clock time, and ``overlap_s`` says how long all of them
overlapped: negative when some did not run together at all).

The cloud's side (batches, queue waits, the cost model's ideal) is left out of a
merged report: several generators against one cloud started none of them, and
generators that each started their own measured different clouds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .analysis import SCHEMA_VERSION, finish
from .config import check_percentiles, generation_settings
from .devices import ERROR_CLASSES


def _burstiness(rep: Mapping[str, Any]) -> float:
    """A report's arrival burstiness (1, Poisson, in a report written before the
    option, and in a closed loop's)."""
    return float(rep["config"].get("burstiness", 1.0))


def merge_reports(reports: Sequence[Mapping[str, Any]], *,
                  percentiles: Sequence[float] | None = None) -> dict[str, Any]:
    """The merged report (the fields of a single run's, see docs/LOAD.md, plus
    ``sources`` and ``overlap_s``). ``percentiles``: default, the first input's.

    Raises ValueError for inputs that cannot be merged exactly: not load reports
    of this schema (older ones carry no samples), different generation settings
    (their bytes and acceptance would mix), or closed and open loops together."""
    if not reports:
        raise ValueError("nothing to merge")
    for i, rep in enumerate(reports):
        what = f"report {i + 1} ({rep.get('command') or rep.get('host') or 'no command'})"
        if rep.get("kind") != "load":
            raise ValueError(f"{what} is not a single load run (kind {rep.get('kind')!r})")
        if rep.get("schema_version") != SCHEMA_VERSION or "samples" not in rep:
            raise ValueError(f"{what} has schema_version {rep.get('schema_version', 1)} "
                             f"without raw samples; merging needs version {SCHEMA_VERSION}: "
                             "rerun it with this version")
    first = reports[0]
    gen = generation_settings(first["config"])
    for i, rep in enumerate(reports[1:], 2):
        if generation_settings(rep["config"]) != gen:
            raise ValueError(f"report {i} generated with other settings than report 1 "
                             f"({generation_settings(rep['config'])} vs {gen})")
        if rep["mode"] != first["mode"]:
            raise ValueError(f"report {i} ran the {rep['mode']} loop, report 1 the "
                             f"{first['mode']} loop")
        if rep["config"].get("goodput") != first["config"].get("goodput"):
            raise ValueError(f"report {i} counts goodput against {rep['config'].get('goodput')}, "
                             f"report 1 against {first['config'].get('goodput')}")
        if _burstiness(rep) != _burstiness(first):
            raise ValueError(f"report {i}'s arrivals have burstiness {_burstiness(rep):g}, "
                             f"report 1's {_burstiness(first):g}: together they are neither")
    qs = check_percentiles(first["percentiles"] if percentiles is None else percentiles)

    def total(key: str) -> Any:
        return sum(rep[key] for rep in reports)

    per_device: list[dict[str, Any]] = []
    base = 0
    for rep in reports:
        per_device += [{**d, "device": base + d["device"]} for d in rep["per_device"]]
        base += rep["devices"]
    samples: dict[str, Any] = {k: [v for rep in reports for v in rep["samples"][k]]
                               for k in ("round_s", "round_tokens", "ttft_s", "tpot_s", "e2e_s")}
    samples["queue_wait_s"] = None
    kept = [rep["samples"].get("generation_s") for rep in reports]
    samples["generation_s"] = None if None in kept else [t for ts in kept for t in ts]
    errors = {k: sum(rep["errors"].get(k, 0) for rep in reports) for k in ERROR_CLASSES}
    starts = [rep["window_unix"][0] for rep in reports]
    ends = [rep["window_unix"][1] for rep in reports]
    tokens, up, down = total("tokens"), 0, 0
    for rep in reports:
        up += rep["bytes"]["up_total"]
        down += rep["bytes"]["down_total"]
    config = dict(first["config"])
    caps = [rep["config"].get("max_concurrency") for rep in reports]
    config.update(devices=total("devices"), procs=sum(rep["config"]["procs"] for rep in reports),
                  percentiles=list(qs), max_concurrency=None if None in caps else sum(caps))
    arrivals = None
    if first["mode"] == "open":
        scheduled = [rep["arrivals"]["scheduled"] for rep in reports]
        arrivals = {"request_rate": sum(rep["arrivals"]["request_rate"] for rep in reports),
                    "burstiness": _burstiness(first),
                    "scheduled": None if None in scheduled else sum(scheduled),
                    "in_window": sum(rep["arrivals"]["in_window"] for rep in reports),
                    "measured_rate": sum(rep["arrivals"]["measured_rate"] for rep in reports)}
        config["request_rate"] = arrivals["request_rate"]
    merged: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": "load",
        "mode": first["mode"],
        "config": config,
        "target": first["target"],
        "draft": first["draft"],
        "models_given_as_objects": sorted({m for rep in reports
                                           for m in rep["models_given_as_objects"]}),
        "percentiles": list(qs),
        "host": None,
        "window_s": max(rep["window_s"] for rep in reports),
        "window_unix": [min(starts), max(ends)],
        "overlap_s": min(ends) - max(starts),
        "devices": total("devices"),
        "tokens": tokens,
        "rounds": total("rounds"),
        "tokens_per_s": total("tokens_per_s"),
        "rounds_per_s": total("rounds_per_s"),
        "generations_per_s": total("generations_per_s"),
        "arrivals": arrivals,
        "per_device": per_device,
        "generations": {k: sum(rep["generations"][k] for rep in reports)
                        for k in first["generations"]},
        "bytes": {"up_total": up, "down_total": down,
                  "up_per_token": up / tokens if tokens else 0.0,
                  "down_per_token": down / tokens if tokens else 0.0},
        "drafted": total("drafted"),
        "accepted": total("accepted"),
        "cloud_observed": False,
        "batches": None, "batched_requests": None, "batch_size_histogram": None,
        "mean_batch_size": None, "cloud": None, "cpu": None,
        "errors": errors,
        "errors_total": sum(errors.values()),
        "error_messages": [m for rep in reports for m in rep["error_messages"]][:5],
        "resumed_generations": sum(rep.get("resumed_generations") or 0 for rep in reports),
        "exact": None if any(rep.get("exact") is None for rep in reports) else {
            k: sum(rep["exact"][k] for rep in reports)
            for k in ("checked", "equal", "mismatched")},
        "machine": None,
        # a merged input contributes its own sources: the list names every generator
        "sources": [src for rep in reports for src in rep.get("sources") or [
            {"host": rep["host"], "command": rep.get("command"),
             "window_unix": rep["window_unix"], "devices": rep["devices"],
             "tokens_per_s": rep["tokens_per_s"], "config": rep["config"],
             "machine": rep["machine"]}]],
    }
    finish(merged, samples, qs)
    merged["goodput"] = _merged_goodput(reports)
    merged["ideal"] = None
    return merged


def _merged_goodput(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The inputs' goodput added up (their objectives agree): the counts, and the
    rate as the sum of theirs, as ``generations_per_s`` is."""
    parts = [p for rep in reports if (p := rep.get("goodput")) is not None]
    if len(parts) < len(reports):
        return None
    good = sum(p["generations"] for p in parts)
    done = sum(p["completed"] for p in parts)
    return {"slo_ms": dict(parts[0]["slo_ms"]), "generations": good,
            "completed": done, "fraction": good / done if done else None,
            "per_s": sum(p["per_s"] for p in parts)}


__all__ = ["merge_reports"]
