"""Verdicts streamed from the loop against a batch verified in the worker, in one run.

    .venv/bin/python -m xcosd.bench.streaming [--devices 48] [--passes 2] [--duration 6]

A cloud in this process serves a sleeping synthetic target over a vocabulary of
:data:`VOCAB` ids (a call costs ``a + b * rows``, as a GPU's would, while each
session's verification warps its rows on the CPU: top-k over 131k entries is
about a millisecond a row). More closed-loop devices than one batch holds keep a
batch always queued, so how soon the next call can start decides throughput.

* ``stream`` (the default, ``CloudNode(stream_verdicts=True)``): the worker
  thread only scores; the loop verifies each session and sends its verdict at
  once, while the thread already runs the next call.
* ``no stream`` (``stream_verdicts=False``): the worker thread scores the batch,
  then verifies every session in it, and only then is it free for the next call.

The two alternate within each pass (which goes first alternates too); each ratio
is the median over passes of the ratio within a pass. The ideal is the cost
model's: full batches of ``max_batch`` sessions of ``draft_len + 1`` rows back to
back. Prints and writes ``bench/out/streaming.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path
from typing import Any

from xcosd.bench.report import OUT_DIR, machine, table, write_json

OUT = OUT_DIR / "streaming.json"
VOCAB = 131072
#: the target's fixed and per-row cost in ms (the scale bench's)
A_MS, B_MS = 20.0, 0.5
DRAFT_LEN = 4
TOP_K = 50
SETTINGS = ("stream", "no stream")


def target_spec() -> str:
    return f"synthetic:{VOCAB}:{A_MS:g}:{B_MS:g}"


def ideal_rounds_per_s(max_batch: int) -> float:
    """Full batches back to back: ``max_batch`` rounds per call."""
    rows = max_batch * (DRAFT_LEN + 1)
    return max_batch / ((A_MS + B_MS * rows) / 1e3)


async def _point(stream: bool, devices: int, max_batch: int, duration_s: float,
                 warmup_s: float) -> dict[str, Any]:
    from xcosd.bench.load import LoadConfig, run_load
    from xcosd.config import GenerationConfig

    # no speculation: the devices share one process (see xcosd/bench/scale.py)
    gen = GenerationConfig(method="xcosd-e", draft_len=DRAFT_LEN, adaptive_draft=False,
                           speculate=False, top_k=TOP_K)
    cfg = LoadConfig(devices=devices, target=target_spec(), generation=gen,
                     duration_s=duration_s, warmup_s=warmup_s, max_batch=max_batch,
                     stream_verdicts=stream, procs=1)
    rep = await run_load(cfg, progress=False)
    return {"tokens_per_s": float(rep["tokens_per_s"]), "rounds_per_s": float(rep["rounds_per_s"]),
            "mean_batch_size": rep.get("mean_batch_size"), "errors": int(rep["errors_total"])}


async def _run(devices: int, max_batch: int, passes: int, duration_s: float,
               warmup_s: float) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
    for p in range(passes):
        for name in (SETTINGS if p % 2 == 0 else SETTINGS[::-1]):
            r = await _point(name == "stream", devices, max_batch, duration_s, warmup_s)
            runs[name].append(r)
            print(f"  pass {p + 1} {name}: {r['rounds_per_s']:.1f} rounds/s, "
                  f"mean batch {r['mean_batch_size'] or 0:.1f}", flush=True)
    return runs


def run(devices: int = 48, max_batch: int = 12, passes: int = 2, duration_s: float = 6.0,
        warmup_s: float = 3.0) -> dict[str, Any]:
    runs = asyncio.run(_run(devices, max_batch, passes, duration_s, warmup_s))
    ideal = ideal_rounds_per_s(max_batch)
    settings = {}
    for name, rs in runs.items():
        rounds = statistics.median(r["rounds_per_s"] for r in rs)
        settings[name] = {"rounds_per_s": rounds,
                          "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                          "mean_batch_size": statistics.median(r["mean_batch_size"] or 0.0
                                                               for r in rs),
                          "efficiency": rounds / ideal, "errors": sum(r["errors"] for r in rs)}
    ratio = statistics.median(a["rounds_per_s"] / b["rounds_per_s"]
                              for a, b in zip(runs["stream"], runs["no stream"], strict=True))
    return {"schema_version": 1, "kind": "streaming", "target": target_spec(),
            "devices": devices, "max_batch": max_batch, "draft_len": DRAFT_LEN, "top_k": TOP_K,
            "passes": passes, "duration_s": duration_s, "warmup_s": warmup_s,
            "ideal_rounds_per_s": ideal, "ratio": ratio, "settings": settings, "runs": runs,
            "machine": machine()}


HEADERS = ["verification", "rounds/s", "tokens/s", "ideal rounds/s", "efficiency",
           "mean batch", "vs no stream", "errors"]


def rows(rep: dict[str, Any]) -> list[list[Any]]:
    out = []
    for name in SETTINGS:
        s = rep["settings"][name]
        out.append([name, f"{s['rounds_per_s']:.1f}", f"{s['tokens_per_s']:.1f}",
                    f"{rep['ideal_rounds_per_s']:.1f}", f"{s['efficiency']:.2f}",
                    f"{s['mean_batch_size']:.1f}",
                    f"{rep['ratio']:.2f}x" if name == "stream" else "1.00x", s["errors"]])
    return out


def format_report(rep: dict[str, Any], markdown: bool = False) -> str:
    return table(rows(rep), HEADERS, markdown=markdown)


HEADING = "## Verdicts streamed while the next call runs"


def section_lines(rep: dict[str, Any] | None) -> list[str]:
    """The RESULTS section, its sentence computed from ``rep``."""
    if rep is None:
        return []
    on, off = rep["settings"]["stream"], rep["settings"]["no stream"]
    return [HEADING, "",
            f"From `python -m xcosd.bench.streaming` (bench/out/streaming.json): "
            f"{rep['devices']} closed-loop devices, `xcosd-e` with top-k {rep['top_k']} and "
            f"{rep['draft_len']} drafts a round, against a cloud serving `{rep['target']}` "
            f"(a call sleeps {A_MS:g} ms + {B_MS:g} ms a row, as a GPU would; verification "
            f"warps {VOCAB:,}-id rows on the CPU) with at most {rep['max_batch']} sessions a "
            "batch, so a batch is always queued. `stream` (the default) verifies on the loop "
            "and sends each verdict as it is drawn while the worker thread runs the next "
            "call; `no stream` (`--no-stream`) verifies the whole batch in the worker thread "
            f"after its call. {rep['passes']} alternating passes of {rep['duration_s']:g} s "
            "(medians; the ratio is the median of the ratios within a pass).", "",
            format_report(rep, markdown=True), "",
            f"Streaming runs {rep['ratio']:.2f}x the rounds/s of verifying in the worker "
            f"({on['rounds_per_s']:.1f} against {off['rounds_per_s']:.1f}; efficiency "
            f"{on['efficiency']:.2f} against {off['efficiency']:.2f} of the cost model's full "
            "batches back to back): in the worker, each call waits for the last batch's "
            "verification.", ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.streaming",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=12)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--json", default=str(OUT))
    args = ap.parse_args(argv)
    rep = run(args.devices, args.max_batch, args.passes, args.duration, args.warmup)
    print(format_report(rep))
    write_json(Path(args.json), rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
