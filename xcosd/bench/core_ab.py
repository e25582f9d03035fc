"""The sans-I/O core's CPU per round, this checkout against another, in the same run.

    .venv/bin/python -m xcosd.bench.core_ab --src DIR [--pairs 12] [--methods xcosd-e,ar]

:func:`xcosd.bench.cloud_cpu.core_row` measures the core in its own process, on that
process's code only, so a change to the core could be weighed only against a report
from another run, on a shared machine whose speed drifts by more than the change.
Here both checkouts run the same loop (:data:`xcosd.bench.cloud_cpu.CORE_PASS`: ``Pump.generate`` over the
load runs' vocabulary-256 synthetic pair, T=1, the same fixed 4-token draft, as
``core_row``), each pass in a fresh process of its own, the two alternating pass by
pass and trading places each pair, so both see the same minutes of the machine. Each
figure is the thread's CPU time, not the wall clock: the pump's clock is swapped for
``time.thread_time``, so a pass that is preempted is not charged for it. The cloud's
figure leaves out the target's own call (timed apart), as ``core_row`` does; the
pump's events are dropped after each generation, as a node drops them once handled.

A pair's ratio is this checkout's figure over ``DIR``'s in the same pair; the report
keeps every pair, and each method's median ratio and its quartiles: how far apart the
two are, and how far the machine let the pairs scatter. Writes
``bench/out/core_ab.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xcosd.bench.cloud_cpu import DRAFT_LEN, code_info, one_pass
from xcosd.bench.report import OUT_DIR, machine, table, write_json

OUT = OUT_DIR / "core_ab.json"
METHODS = ("xcosd-e", "ar")
PAIRS = 12
GENERATIONS = 60

def _quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def compare(methods: Sequence[str], src: Path, pairs: int = PAIRS,
            generations: int = GENERATIONS, log: bool = True) -> dict[str, Any]:
    """Each method's core on this checkout (*this*) and on ``src`` (*src*), in
    ``pairs`` alternating pairs of passes."""
    t0 = time.perf_counter()
    say = print if log else (lambda *a, **k: None)
    rows = []
    for method in methods:
        got: list[dict[str, Any]] = []
        for k in range(pairs):
            order = ("this", "src") if k % 2 == 0 else ("src", "this")
            pair = {who: one_pass(method, None if who == "this" else src, generations)
                    for who in order}
            got.append(pair)
            say(f"{method:8} pair {k + 1:2}: cloud this {pair['this']['cloud_us_per_round']:.1f} "
                f"src {pair['src']['cloud_us_per_round']:.1f} us", flush=True)
        row: dict[str, Any] = {"method": method, "pairs": got}
        for side in ("cloud", "edge"):
            key = f"{side}_us_per_round"
            ratios = [p["this"][key] / p["src"][key] for p in got]
            q1, med, q3 = _quartiles(ratios)
            row[side] = {"this_median_us": statistics.median(p["this"][key] for p in got),
                         "src_median_us": statistics.median(p["src"][key] for p in got),
                         "ratio_median": med, "ratio_q1": q1, "ratio_q3": q3}
        rows.append(row)
    return {"bench": "core_ab", "this": code_info(None), "src": code_info(src),
            "generations": generations, "pairs": pairs, "draft_len": DRAFT_LEN,
            "clock": "thread CPU time", "rows": rows, "machine": machine(),
            "wall_s": time.perf_counter() - t0}


def lines(rep: dict[str, Any]) -> list[str]:
    """The comparison as a table: per method and side, each checkout's median µs a round
    and the median ratio of the pairs with its quartiles."""
    body = [[r["method"], side, r[side]["this_median_us"], r[side]["src_median_us"],
             r[side]["ratio_median"], f"{r[side]['ratio_q1']:.3f}-{r[side]['ratio_q3']:.3f}"]
            for r in rep["rows"] for side in ("cloud", "edge")]
    this, src = rep["this"].get("commit") or "?", rep["src"].get("commit") or "?"
    return [f"this {this[:10]}{' (changed)' if rep['this'].get('dirty') else ''} against "
            f"src {src[:10]}: {rep['pairs']} pairs of passes of {rep['generations']} "
            f"generations, {rep['clock']}", "",
            table(body, ["method", "side", "this µs", "src µs", "ratio", "quartiles"],
                  floatfmt=".3f")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.core_ab",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--src", type=Path, required=True, help="the other checkout")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--pairs", type=int, default=PAIRS)
    ap.add_argument("--generations", type=int, default=GENERATIONS,
                    help="generations of 64 tokens a pass")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    rep = compare(a.methods.split(","), a.src.resolve(), a.pairs, a.generations)
    print("\n".join(lines(rep)))
    write_json(a.out, rep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
