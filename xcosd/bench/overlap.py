"""Drafting while a verdict is in flight: speculation on and off, in one run.

    .venv/bin/python -m xcosd.bench.overlap [--prompts 8] [--tokens 96] [--passes 3]

A cloud in this process (ZeroMQ loopback) serves a synthetic target whose every
call sleeps :data:`TARGET_S`; the device drafts with a synthetic draft that sleeps
:data:`DRAFT_S` a step in its draft thread (sleeping, so neither competes with the
other for this machine's two cores: they stand for two machines). The draft ranks
tokens as the target does, with a flatter Zipf law, so its drafts are often
accepted whole. For each warper (T = 1 and greedy), unseeded ``xcosd-e``
generations run with ``speculate`` on (the default) and off, alternating which goes
first from pass to pass; each ratio is the median over passes of the ratio within a
pass.

Reported per warper and setting: tokens/s (wall), rounds per token, tokens drafted
per round, speculated tokens and the share of them later rounds sent, and modeled
tokens/s (the edge's drafting outside the wait, the cloud's compute and a
100 Mbit/s, 20 ms link). Prints and writes ``bench/out/overlap.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from xcosd.bench.report import OUT_DIR, machine, table, write_json

OUT = OUT_DIR / "overlap.json"
#: seconds a target call sleeps, and a draft step
TARGET_S = 0.020
DRAFT_S = 0.003
VOCAB = 256
#: the Zipf exponents of target and draft rows (the same ranking)
TARGET_SKEW, DRAFT_SKEW = 1.1, 0.9
WARPERS: dict[str, dict[str, Any]] = {"T=1": {}, "greedy": {"do_sample": False}}
MODEL_LINK: dict[str, Any] = {"up_bps": 100e6, "down_bps": 100e6, "rtt_s": 0.020}


async def _setting(edge: Any, prompts: list[str], tokens: int, warper: dict[str, Any],
                   speculate: bool) -> dict[str, Any]:
    from xcosd.nodes.stats import merge

    t0 = time.perf_counter()
    stats = [(await edge.generate(p, max_new_tokens=tokens, speculate=None if speculate
                                  else False, **warper)).stats for p in prompts]
    wall = time.perf_counter() - t0
    st = merge(stats)
    return {"tok_s": st.tokens / wall, "tokens": st.tokens, "rounds": st.rounds,
            "drafted": st.drafted, "accepted": st.accepted, "speculated": st.speculated,
            "speculated_used": st.speculated_used,
            "modeled_tok_s": st.tokens / st.modeled_s if st.modeled_s > 0 else None}


async def _run(prompts: list[str], tokens: int, passes: int) -> dict[str, Any]:
    from xcosd.models.synthetic import SyntheticModel
    from xcosd.nodes import CloudNode, EdgeNode
    from xcosd.transport import LinkSpec

    target = SyntheticModel(VOCAB, a=TARGET_S, skew=TARGET_SKEW, name="synthetic-target")
    draft = SyntheticModel(VOCAB, a=DRAFT_S, skew=DRAFT_SKEW, name="synthetic-draft")
    out: dict[str, Any] = {}
    async with (CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud,
                EdgeNode(draft, cloud.endpoint, draft_thread=True,
                         model_link=LinkSpec.of(**MODEL_LINK)) as edge):
        await edge.generate(prompts[0], max_new_tokens=8)  # warm-up: the costs measured
        for wname, warper in WARPERS.items():
            runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
            for p in range(passes):
                order = ("on", "off") if p % 2 == 0 else ("off", "on")
                for name in order:
                    r = await _setting(edge, prompts, tokens, warper, name == "on")
                    runs[name].append(r)
                    print(f"  {wname} pass {p + 1} speculate {name}: {r['tok_s']:.1f} tok/s, "
                          f"{r['speculated_used']}/{r['speculated']} speculated used",
                          flush=True)
            out[wname] = {
                "passes": runs,
                "ratio": statistics.median(a["tok_s"] / b["tok_s"]
                                           for a, b in zip(runs["on"], runs["off"], strict=True)),
                **{name: _sum(rs) for name, rs in runs.items()},
            }
    return out


def _sum(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One setting over its passes: the median rates, the summed counts."""
    keys = ("tokens", "rounds", "drafted", "accepted", "speculated", "speculated_used")
    out: dict[str, Any] = {k: sum(r[k] for r in rs) for k in keys}
    out["tok_s"] = statistics.median(r["tok_s"] for r in rs)
    modeled = [r["modeled_tok_s"] for r in rs if r["modeled_tok_s"] is not None]
    out["modeled_tok_s"] = statistics.median(modeled) if modeled else None
    return out


def run(prompts: int, tokens: int, passes: int) -> dict[str, Any]:
    chosen = [f"prompt {i}: " for i in range(prompts)]
    return {"schema_version": 1, "kind": "overlap", "prompts": prompts,
            "tokens_per_prompt": tokens, "passes": passes, "target_call_s": TARGET_S,
            "draft_step_s": DRAFT_S, "vocab": VOCAB, "skews": [TARGET_SKEW, DRAFT_SKEW],
            "model_link": MODEL_LINK,
            "warpers": asyncio.run(_run(chosen, tokens, passes)), "machine": machine()}


def rows(rep: dict[str, Any]) -> list[list[Any]]:
    """The report's table: one row per warper and setting."""
    out = []
    for wname, w in rep["warpers"].items():
        for name in ("off", "on"):
            s = w[name]
            used = s["speculated_used"] / s["speculated"] if s["speculated"] else None
            out.append([wname, name, f"{s['tok_s']:.1f}",
                        f"{w['ratio']:.2f}x" if name == "on" else "1.00x",
                        f"{s['rounds'] / s['tokens']:.2f}", f"{s['drafted'] / s['rounds']:.2f}",
                        s["speculated"], "" if used is None else f"{used:.0%}",
                        "" if s["modeled_tok_s"] is None else f"{s['modeled_tok_s']:.1f}"])
    return out


HEADERS = ["warper", "speculate", "tok/s", "vs off", "rounds/token", "drafted/round",
           "speculated", "of them sent", "modeled tok/s"]


def format_report(rep: dict[str, Any], markdown: bool = False) -> str:
    return table(rows(rep), HEADERS, markdown=markdown)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.overlap", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--json", default=str(OUT))
    args = ap.parse_args(argv)
    rep = run(args.prompts, args.tokens, args.passes)
    print(format_report(rep))
    write_json(Path(args.json), rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
