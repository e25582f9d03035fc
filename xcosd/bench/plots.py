"""PNG plots of bench reports (matplotlib, Agg backend: no display needed).

Every function takes a report dict (as the benches return and save it) and an
output path, so plots can be redrawn from saved JSON without rerunning anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .load.config import batching_mode


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    _plt().close(fig)
    return p


def load_plots(rep: dict[str, Any], out_dir: str | Path, prefix: str = "load") -> list[Path]:
    """Latency percentiles, the cloud's batch-size histogram and tokens/s per device."""
    plt = _plt()
    out = Path(out_dir)
    paths = []

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    # a load report of a cloud it did not start (or a merged one) has no queue wait
    names = [(n, k) for n, k in (("per token", "token_latency_ms"), ("round", "round_latency_ms"),
                                 ("first token", "ttft_ms"), ("queue wait", "queue_wait_ms"))
             if rep.get(k) is not None]
    qs = ["p50", "p90", "p99", "max"]
    width = 0.2
    for j, q in enumerate(qs):
        ax.bar([i + (j - 1.5) * width for i in range(len(names))],
               [rep[k][q] for _, k in names], width, label=q)
    ax.set_xticks(range(len(names)), [n for n, _ in names])
    ax.set_ylabel("ms")
    ax.set_title(f"latency, {rep['devices']} devices")
    ax.legend()
    paths.append(_save(fig, out / f"{prefix}_latency.png"))

    hist = rep["batch_size_histogram"]
    if hist is not None:  # None: the cloud was not observed
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        ax.bar([int(k) for k in hist], list(hist.values()), width=max(1, rep["devices"] // 64))
        ax.set_xlabel("batch size (sessions per target call)")
        ax.set_ylabel("batches")
        ax.set_title(f"cloud batch sizes, {rep['devices']} devices "
                     f"(mean {rep['mean_batch_size']:.1f})")
        paths.append(_save(fig, out / f"{prefix}_batches.png"))

    per = sorted(d["tokens_per_s"] for d in rep.get("per_device", []))
    if per:
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        ax.bar(range(len(per)), per, width=1.0)
        ax.set_xlabel("device (sorted)")
        ax.set_ylabel("tokens/s")
        ax.set_title("tokens/s per device")
        paths.append(_save(fig, out / f"{prefix}_per_device.png"))
    return paths


def scaling_plot(scaling: dict[str, Any], path: str | Path) -> Path:
    """Aggregate tokens/s against devices for each batching mode, with the cost
    model's ideal for batching on and off (dashed)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for mode, color in (("on", "C0"), ("no merge", "C2"), ("off", "C1")):
        pts = sorted((p for p in scaling["points"] if batching_mode(p["config"]) == mode),
                     key=lambda p: p["devices"])
        if not pts:
            continue
        xs = [p["devices"] for p in pts]
        label = f"batching {mode}" if mode != "no merge" else "batching on, no merge"
        ax.plot(xs, [p["tokens_per_s"] for p in pts], "o-", color=color, label=label)
        ideal = [(p.get("ideal") or {}).get("tokens_per_s") for p in pts]
        if mode != "no merge" and all(v is not None for v in ideal):
            ax.plot(xs, ideal, "--", color=color, alpha=0.6, label=f"{label}: ideal")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("scaling: measured vs the cost model's ideal")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def rate_plot(records: Sequence[dict[str, Any]], path: str | Path, *, pair: str, warper: str,
              codec_of: dict[str, str]) -> Path:
    """Modeled tokens/s against downlink rate, one line per method (its ``codec_of``
    codec), like the paper's throughput figure."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in records:
        if r["pair"] != pair or r["warper"] != warper or codec_of.get(r["method"]) != r["codec"]:
            continue
        rates = sorted(r["modeled_tokens_per_s"], key=float)
        ax.plot([float(x) for x in rates], [r["modeled_tokens_per_s"][x] for x in rates], "o-",
                label=f"{r['method']} ({r['codec']})")
    ax.set_xlabel("downlink rate (Mbps), 20 ms RTT")
    ax.set_ylabel("modeled tokens/s")
    ax.set_title(f"{pair}, {warper}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def bytes_plot(records: Sequence[dict[str, Any]], path: str | Path, *, pair: str,
               warper: str) -> Path:
    """Downlink bytes per token per method and codec, log scale."""
    plt = _plt()
    rows = [r for r in records if r["pair"] == pair and r["warper"] == warper]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    width = 0.8 / max(1, len(codecs))
    for j, c in enumerate(codecs):
        xs, ys = [], []
        for i, m in enumerate(methods):
            hit = [r for r in rows if r["method"] == m and r["codec"] == c]
            if hit and hit[0]["downlink_bytes_per_token"] > 0:
                xs.append(i + (j - (len(codecs) - 1) / 2) * width)
                ys.append(hit[0]["downlink_bytes_per_token"])
        if xs:
            ax.bar(xs, ys, width, label=c)
    ax.set_yscale("log")
    ax.set_xticks(range(len(methods)), methods, rotation=20, fontsize=8)
    ax.set_ylabel("downlink bytes per token (wire)")
    ax.set_title(f"downlink per token, {pair}, {warper}")
    ax.legend(fontsize=7, ncol=3)
    return _save(fig, path)
