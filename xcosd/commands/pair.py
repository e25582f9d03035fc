"""``xcosd pair DRAFT TARGET``: the report to run before deploying a pair.

How V_C pairs the two vocabularies (strings a side spells twice included), where
the target's mass sits on sample text, the acceptance ceiling per warper, the
measured draft step, and from those the predicted round trips per token and the
modeled speed against ``ar`` at the round-trip times and cloud cost given
(:mod:`xcosd.bench.pair_report`). ``--measure`` runs seeded ``xcosd-e``
generations through the protocol on the same prompts and prints them beside the
prediction.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .options import add_verbose, check_model, existing_file, is_tty, nonneg_float, positive_int


def _rtts(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds like 20,50,100, got {s!r}") from None
    if not out or any(not 0 <= x < 1e6 for x in out):
        raise argparse.ArgumentTypeError(f"expected milliseconds like 20,50,100, got {s!r}")
    return out


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "pair", help="what a draft/target pair can gain: V_C, mass, ceilings, predicted speed",
        description="Report on a draft/target pair before deploying it: how V_C pairs the "
                    "vocabularies, where the target's mass sits on sample text (the target's "
                    "own generations, or --text), the acceptance ceiling per warper, the "
                    "draft step, and the predicted round trips per token and modeled tok/s "
                    "against ar.")
    p.add_argument("draft", help="draft model spec (smollm2-135m, smollm2-135m@llama.cpp, a .gguf "
                                 "file, default-draft ...)")
    p.add_argument("target", help="target model spec, as for DRAFT")
    p.add_argument("--text", type=existing_file, metavar="FILE",
                   help="measure on windows of this UTF-8 file instead of the target's own text")
    p.add_argument("--prompts", type=positive_int, default=8,
                   help="sample sequences (prompts the target continues, or windows of --text)")
    p.add_argument("--tokens", type=positive_int, default=32, help="tokens per sample sequence")
    p.add_argument("--rtt-ms", type=_rtts, default=[20.0, 50.0, 100.0], metavar="MS[,MS...]",
                   help="round-trip times to model the speed at")
    p.add_argument("--cloud-ms", type=nonneg_float, default=4.0,
                   help="the cloud's cost of one target call, milliseconds (4: a GPU-like cloud)")
    p.add_argument("--step-cost", type=nonneg_float, default=None,
                   help="a draft step's cost over a round's fixed part, for the policies "
                        "(default: a seeded generation's, 0.05)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled text and the runs")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="threads per model (llama.cpp, torch)")
    p.add_argument("--measure", action="store_true",
                   help="also run seeded xcosd-e generations and print the measured round "
                        "trips per token beside the prediction")
    p.add_argument("--progress", action="store_true", default=None,
                   help="draw progress on stderr (default: when stderr is a terminal)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="also write the JSON report to FILE")
    add_verbose(p)
    p.set_defaults(func=run, check=check)


def check(args: argparse.Namespace) -> None:
    check_model(args.draft, "draft")
    check_model(args.target, "target")


def _progress(enabled: bool) -> Any:
    def show(phase: str, done: int, total: int) -> None:
        if enabled:
            sys.stderr.write(f"\r{phase:<28} {done}/{total}   ")
            if done >= total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    return show


def run(args: argparse.Namespace) -> int:
    from ..bench import pair_report as pr
    from ..models import load_model
    from ..policies.draft_length import DEFAULT_COST

    kw: dict[str, Any] = {} if args.threads is None else {"threads": args.threads}
    show = _progress(args.progress if args.progress is not None else is_tty(sys.stderr))
    show("loading the models", 0, 2)
    draft = load_model(args.draft, **kw)
    show("loading the models", 1, 2)
    target = load_model(args.target, **kw)
    show("loading the models", 2, 2)
    if args.text:
        text = Path(args.text).read_text(encoding="utf-8")
        one = pr.text_samples(target, text, args.tokens, args.prompts)
        samples = {name: one for name in pr.WARPERS}
    else:
        prompts = [pr.PROMPTS[i % len(pr.PROMPTS)] for i in range(args.prompts)]
        samples = {}
        for name, params in pr.WARPERS.items():
            def step(_phase: str, done: int, total: int, name: str = name) -> None:
                show(f"sampling ({name})", done, total)

            samples[name] = pr.target_samples(target, prompts, args.tokens, args.seed, params,
                                              progress=step)
    info = pr.report(draft, target, samples, rtts_ms=args.rtt_ms, cloud_ms=args.cloud_ms,
                     step_cost=DEFAULT_COST if args.step_cost is None else args.step_cost,
                     progress=show)
    if args.measure:
        info["measured"] = pr.measure(draft, target, samples, seed=args.seed + 1, progress=show)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(info, indent=2) + "\n")
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_report(info))
    return 0


def format_report(info: dict[str, Any]) -> str:
    v, m = info["vocab"], info["mass"]
    dup = v["duplicated"]
    lines = [f"{info['draft']} -> {info['target']}",
             f"|V_C| = {v['common']:,}   |V_O| = {v['other']:,}   fingerprint {v['fingerprint']}"]
    for side in ("target", "draft"):
        rows = dup[side]
        if not rows:
            lines.append(f"{side}: no string spelled twice")
            continue
        written = sum(r["written_by_tokenizer"] for r in rows)
        show = ", ".join(f"{r['bytes']!r} {r['ids']} -> {r['written']}" for r in rows[:6])
        lines.append(f"{side}: {len(rows)} strings spelled twice, {written} paired by the id its "
                     f"tokenizer writes ({show}{', ...' if len(rows) > 6 else ''})")
    s = info["sample"]
    lines += ["", f"the target's mass on {s['positions']} positions of sample text:",
              f"  on V_C                                  {100 * m['v_c']:7.2f} %",
              f"  on a twice-spelled string's other id    {100 * m['duplicate_not_in_v_c']:7.2f} %",
              f"  on V_O, the draft spells as one token   {100 * m['v_o_draft_one_token']:7.2f} %",
              f"  on V_O, as two draft tokens             {100 * m['v_o_draft_two_tokens']:7.2f} %",
              f"  on V_O, as three or more                {100 * m['v_o_draft_three_or_more']:7.2f} %",
              f"  on V_O, not at all                      {100 * m['v_o_draft_cannot_spell']:7.2f} %",
              "", f"draft step {info['draft_step_ms']:.1f} ms; cloud call {info['cloud_ms']:g} ms "
                  f"(given); policy step cost {info['step_cost']:g}", ""]
    rtts = list(next(iter(info["warpers"].values()))["modeled"])
    head = (f"{'warper':<16}{'ceiling':>8}{'by bytes':>9}{'k':>3}{'trips/tok':>10}"
            + ("" if "measured" not in info else f"{'measured':>9}")
            + f"{'tree':>14}{'trips/tok':>10}"
            + "".join(f"{'x ar @' + r + 'ms':>12}" for r in rtts))
    lines.append(head)
    for name, w in info["warpers"].items():
        row = (f"{name:<16}{w['mean_ceiling']:8.3f}{w['bytes_ceiling']:9.3f}{w['draft_len']:3d}"
               f"{w['trips_per_token']:10.3f}")
        if "measured" in info:
            row += f"{info['measured'][name]['trips_per_token']:9.3f}"
        row += f"{w['tree']['shape']:>14}{w['tree']['trips_per_token']:10.3f}"
        row += "".join(f"{w['modeled'][r]['speedup']:12.2f}" for r in rtts)
        lines.append(row)
    lines.append("(ceiling: sum over V_C of min(p, q), a drafted token's acceptance; by bytes: "
                 "against every target id with its bytes; x ar: modeled chains over ar)")
    return "\n".join(lines)
