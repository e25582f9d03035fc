"""The real pair live over an emulated link: what a user sees at a real round trip.

    .venv/bin/python -m xcosd.bench.live_link [--rtt-ms 20,50,100] [--prompts 3] [--tokens 48]

SmolLM2-135M drafting for Gemma-3-270m, llama.cpp on both sides at its default
threads for one core each: the cloud is ``xcosd serve --link-rtt-ms RTT`` in its
own process pinned to one core, the edge this process pinned to the other, so the
unseeded policies (the draft length fitted to the measured draft step and round,
the tree policy's shape) see the real round trip rather than a model of it. Rows,
at each RTT: ``ar`` (the cloud draws every token), ``xcosd-e`` with default
settings, and ``xcosd-e`` with ``tree="auto"``; each generation unseeded, T = 0.7
and top-p 0.9 by default, ``--passes`` passes with the rows' order rotated (the
machine is shared: each ratio is the median of within-pass ratios).

Where ``xcosd-e`` runs faster than ``ar`` at an RTT, speculation pays there on this
machine; the modeled figures of the other real-pair benches say what a GPU cloud
would add.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from xcosd.bench.real_pair import DRAFT, PROMPTS, TARGET, _free_port
from xcosd.bench.report import OUT_DIR, machine, table, write_json

HEADING = "## Live over the emulated link"
OUT_NAME = "live_link.json"
RTTS_MS = (20.0, 50.0, 100.0)
#: (row, method, tree)
ROWS: tuple[tuple[str, str, str | None], ...] = (
    ("ar", "ar", None), ("xcosd-e", "xcosd-e", None), ("xcosd-e tree=auto", "xcosd-e", "auto"))
EDGE_CORE, CLOUD_CORE = 0, 1
#: the goal at RTT 50 ms: default xcosd-e against ar
GOAL_RTT, GOAL = 50.0, 1.3


def _pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def _serve(endpoint: str, rtt_ms: float) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "xcosd", "serve", "--target", f"{TARGET}@llama.cpp",
         "--threads", "1", "--bind", endpoint, "--link-rtt-ms", repr(rtt_ms)],
        env=env, stdout=subprocess.DEVNULL, preexec_fn=lambda: _pin(CLOUD_CORE))


async def _rows(draft: Any, endpoint: str, prompts: list[str], tokens: int, passes: int,
                temperature: float, top_p: float) -> dict[str, Any]:
    from xcosd.nodes import EdgeNode
    from xcosd.nodes.stats import merge

    names = [r[0] for r in ROWS]
    spec = {r[0]: r for r in ROWS}
    per: dict[str, list[float]] = {n: [] for n in names}
    stats: dict[str, list[Any]] = {n: [] for n in names}
    async with EdgeNode(draft, endpoint, connect_timeout_s=600.0, silence_timeout_s=300.0) as edge:
        for n in names:  # warm-up, untimed (the policies learn the costs here too)
            await edge.generate(prompts[0], max_new_tokens=8, method=spec[n][1], tree=spec[n][2],
                                temperature=temperature, top_p=top_p)
        for p in range(passes):
            k = p % len(names)
            for n in names[k:] + names[:k]:
                done, wall = 0, 0.0
                for prompt in prompts:
                    t0 = time.perf_counter()
                    r = await edge.generate(prompt, max_new_tokens=tokens, method=spec[n][1],
                                            tree=spec[n][2], temperature=temperature,
                                            top_p=top_p, ignore_eos=True)
                    wall += time.perf_counter() - t0
                    done += r.stats.tokens
                    stats[n].append(r.stats)
                per[n].append(done / wall)
                print(f"  pass {p + 1} {n}: {done / wall:.2f} tok/s", flush=True)
    out = {}
    for n in names:
        st = merge(stats[n])
        trips = st.rounds + st.extra_round_trips
        out[n] = {"tok_s": statistics.median(per[n]), "tok_s_passes": per[n],
                  "vs_ar": statistics.median(a / b for a, b in zip(per[n], per["ar"], strict=True)),
                  "tokens": st.tokens, "round_trips": trips, "drafted": st.drafted,
                  "accepted": st.accepted, "tree_rounds": st.tree_rounds,
                  "shapes": dict(st.shapes), "edge_compute_s": st.draft_compute_s,
                  "up_bytes": st.uplink_bytes, "down_bytes": st.downlink_bytes}
    return out


def run(rtts: list[float], prompts: int, tokens: int, passes: int, temperature: float = 0.7,
        top_p: float = 0.9) -> dict[str, Any]:
    from xcosd.models import load_model

    _pin(EDGE_CORE)
    chosen = (PROMPTS * (prompts // len(PROMPTS) + 1))[:prompts]
    t0 = time.perf_counter()
    draft = load_model(f"{DRAFT}@llama.cpp", threads=1)
    by_rtt = {}
    for rtt in rtts:
        endpoint = f"tcp://127.0.0.1:{_free_port()}"
        cloud = _serve(endpoint, rtt)
        try:
            print(f"RTT {rtt:g} ms", flush=True)
            by_rtt[f"{rtt:g}"] = asyncio.run(_rows(draft, endpoint, chosen, tokens, passes,
                                                   temperature, top_p))
        finally:
            cloud.terminate()
            cloud.wait(30)
    return {"schema_version": 1, "draft": DRAFT, "target": TARGET, "backend": "llama.cpp",
            "threads_per_side": 1, "pinned": (os.cpu_count() or 1) >= 2, "prompts": prompts,
            "tokens_per_prompt": tokens, "passes": passes, "temperature": temperature,
            "top_p": top_p, "rtts_ms": [float(r) for r in rtts], "rows": by_rtt,
            "wall_s": time.perf_counter() - t0, "machine": machine()}


def format_report(rep: dict[str, Any], markdown: bool = False) -> str:
    out = []
    for rtt, rows in rep["rows"].items():
        for name, r in rows.items():
            t = max(r["tokens"], 1)
            shapes = ", ".join(f"{k} {v}" for k, v in sorted(r["shapes"].items(),
                                                              key=lambda kv: -kv[1])[:3])
            out.append([f"{rtt} ms", name, f"{r['tok_s']:.2f}", f"{r['vs_ar']:.2f}x",
                        f"{r['round_trips'] / t:.3f}",
                        f"{r['drafted'] / max(1, r['round_trips']):.2f}",
                        f"{r['accepted'] / r['drafted']:.2f}" if r["drafted"] else "",
                        f"{1e3 * r['edge_compute_s'] / t:.1f}",
                        f"{(r['up_bytes'] + r['down_bytes']) / t:.0f}", shapes])
    return table(out, ["RTT", "row", "tok/s", "vs ar", "round trips/token", "drafted/round",
                       "acceptance", "edge ms/token", "bytes/token", "tree shapes (rounds)"],
                 markdown=markdown)


def goals(rep: dict[str, Any]) -> list[str]:
    lines = []
    for rtt, rows in rep["rows"].items():
        e, t = rows["xcosd-e"]["vs_ar"], rows["xcosd-e tree=auto"]["vs_ar"]
        line = f"- RTT {rtt} ms: xcosd-e {e:.2f}x ar, tree=auto {t:.2f}x ar"
        if float(rtt) == GOAL_RTT:
            line += f" (goal: xcosd-e >= {GOAL}x: {'met' if e >= GOAL else 'not met'})"
        lines.append(line + ".")
    return lines


def section_lines(rep: dict[str, Any] | None) -> list[str]:
    if rep is None:
        return []
    return [HEADING, "",
            f"From `python -m xcosd.bench.live_link` (bench/out/{OUT_NAME}): {rep['draft']} "
            f"drafting for {rep['target']}, llama.cpp on both sides, one thread each"
            + (", the edge and the cloud each pinned to a core of its own" if rep["pinned"]
               else "")
            + f"; the cloud is `xcosd serve --link-rtt-ms RTT`, so every message really waits "
            f"its half round trip and the unseeded policies see it. {rep['prompts']} prompts x "
            f"{rep['tokens_per_prompt']} tokens, T={rep['temperature']:g} top-p "
            f"{rep['top_p']:g}, unseeded, {rep['passes']} passes in rotated order (ratios "
            "are medians of within-pass ratios).", "",
            format_report(rep, markdown=True), "", *goals(rep), ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.live_link",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rtt-ms", default=",".join(f"{r:g}" for r in RTTS_MS),
                    help="comma-separated round-trip times")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--json", type=Path, default=OUT_DIR / OUT_NAME)
    a = ap.parse_args(argv)
    rtts = [float(x) for x in a.rtt_ms.split(",") if x.strip()]
    rep = run(rtts, a.prompts, a.tokens, a.passes, a.temperature, a.top_p)
    print(format_report(rep))
    print("\n".join(goals(rep)))
    write_json(a.json, rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
