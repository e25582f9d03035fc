"""``xcosd bench load`` and ``xcosd bench methods``: the benchmarks.

``load`` runs many closed-loop edge devices against one cloud (or, with
``--scaling``, a sweep over device counts with batching on and off); ``methods``
measures every resampling method and codec on real model rows. Both print a
report, and write JSON (``--json``) and PNG plots (``--plots DIR``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="load test and method benchmarks",
                       description="Benchmarks: `load` (devices against a cloud) and "
                                   "`methods` (methods x codecs on real model rows).")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True
    _add_load(bsub)
    _add_methods(bsub)


# ------------------------------------------------------------------ load


#: the load test's default target (kept here so the parser needs no heavy import)
DEFAULT_TARGET = "synthetic:256:20:0.5"


def _add_load(bsub: Any) -> None:
    p = bsub.add_parser("load", help="N closed-loop edge devices against one cloud",
                        description="Closed-loop load test: N edge devices (asyncio tasks in "
                                    "--procs device processes) against one cloud over ZeroMQ "
                                    "or TCP. Warm-up is excluded from every number.")
    p.add_argument("-n", "--devices", type=int, default=16)
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="target model spec (default %(default)s: a+b*rows ms per call); "
                        "default-target, smollm2-135m, gemma3-270m, a model dir ...")
    p.add_argument("--draft", default=None,
                   help="draft model spec (default: a cost-free synthetic draft for a "
                        "synthetic target, default-draft otherwise)")
    p.add_argument("--method", default="xcosd-e")
    p.add_argument("--codec", default="f32")
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=None,
                   help="measured seconds (default 8 unless --generations is given)")
    p.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds (excluded)")
    p.add_argument("--generations", type=int, default=None,
                   help="instead of --duration: measured generations per device")
    p.add_argument("--warmup-generations", type=int, default=1)
    p.add_argument("--no-batching", action="store_true", help="one session per target call")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--transport", choices=("zmq", "tcp"), default="zmq")
    p.add_argument("--procs", type=int, default=1,
                   help="device processes (0: devices in the cloud's own event loop)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per generation")
    p.add_argument("--link-rate-mbps", type=float, default=None,
                   help="emulate a link of this rate (both ways) on every device")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="emulated round-trip time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scaling", default=None, metavar="N,N,...",
                   help="sweep these device counts, batching on and off (e.g. 1,4,16,64,256)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots there")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="live progress bar on stderr (default: only on a TTY)")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=run_load)


def load_config(args: argparse.Namespace) -> Any:
    from ..bench.load import LoadConfig

    duration = args.duration
    if duration is None and args.generations is None:
        duration = 8.0
    return LoadConfig(
        devices=args.devices, target=args.target, draft=args.draft, method=args.method,
        codec=args.codec, draft_len=args.draft_len, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        duration_s=duration, warmup_s=args.warmup, generations=args.generations,
        warmup_generations=args.warmup_generations, batching=not args.no_batching,
        max_batch=args.max_batch, max_wait_s=args.max_wait_ms / 1e3, transport=args.transport,
        procs=args.procs, timeout_s=args.timeout, seed=args.seed,
        link_rate_mbps=args.link_rate_mbps, rtt_ms=args.rtt_ms)


def run_load(args: argparse.Namespace) -> int:
    from ..bench import load, plots
    from ..bench.report import table

    cfg = load_config(args)
    command = "xcosd " + " ".join(sys.argv[1:]) if sys.argv[1:] else "xcosd bench load"
    if args.scaling:
        counts = [int(x) for x in args.scaling.split(",") if x.strip()]
        rep = load.run_scaling(cfg, counts, progress=args.progress)
        rep["command"] = command
        print(table(load.scaling_rows(rep), load.SCALING_HEADER))
        if args.plots:
            plots.scaling_plot(rep, Path(args.plots) / "load_scaling.png")
    else:
        rep = load.run_load_sync(cfg, progress=args.progress)
        rep["command"] = command
        print(load.format_report(rep))
        if args.plots:
            plots.load_plots(rep, args.plots)
    if args.json:
        _write_json(args.json, rep)
    errors = (sum(p["errors_total"] for p in rep["points"]) if args.scaling
              else rep["errors_total"])
    return 1 if errors else 0


# ------------------------------------------------------------------ methods


def _add_methods(bsub: Any) -> None:
    from ..bench import grid as mb

    p = bsub.add_parser("methods", help="every method x codec on real model rows",
                        description="Acceptance, bytes, cloud calls, round trips, measured TV "
                                    "to the target, modeled tokens/s per link rate and live "
                                    "tokens/s, per (pair, method, codec, warper).")
    p.add_argument("--pairs", default="embedded",
                   help="comma list: embedded (the n-gram default pair), real "
                        "(SmolLM2-135M -> Gemma-3-270M, when installed)")
    p.add_argument("--methods", default=",".join(mb.all_methods()), help="comma list")
    p.add_argument("--codecs", default=",".join(mb.CODECS),
                   help="comma list (used by methods whose codec applies to a vector)")
    p.add_argument("--warpers", default=",".join(mb.WARPERS), help="comma list of "
                   + ", ".join(mb.WARPERS))
    p.add_argument("--prompts", type=int, default=4, help="prompts per record")
    p.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--rates", default="100,200,300", help="downlink Mbps for the link model")
    p.add_argument("--rtt-ms", type=float, default=20.0)
    p.add_argument("--tv-trials", type=int, default=2000,
                   help="rounds per context for the measured TV (0: skip)")
    p.add_argument("--tv-contexts", type=int, default=3)
    p.add_argument("--live-rate", type=float, default=200.0,
                   help="Mbps for the live run through real nodes (0: skip)")
    p.add_argument("--live", default="f32",
                   help="which records also run live: 'f32' (each method with f32, at the "
                        "first warper), 'all', or 'none'")
    p.add_argument("--real-tokens", type=int, default=16, help="new tokens per prompt, real pair")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the records as JSON")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots there")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None)
    g.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=run_methods)


def run_methods(args: argparse.Namespace) -> int:
    from ..bench.methods import MethodsConfig, format_report, plot_report
    from ..bench.methods import run_methods as run_grid

    cfg = MethodsConfig(
        pairs=_split(args.pairs), methods=_split(args.methods), codecs=_split(args.codecs),
        warpers=_split(args.warpers), prompts=args.prompts, tokens=args.tokens,
        real_tokens=args.real_tokens, draft_len=args.draft_len,
        rates_mbps=[float(x) for x in _split(args.rates)], rtt_ms=args.rtt_ms,
        tv_trials=args.tv_trials, tv_contexts=args.tv_contexts, live_rate_mbps=args.live_rate,
        live=args.live, seed=args.seed)
    rep = run_grid(cfg, progress=args.progress)
    rep["command"] = "xcosd " + " ".join(sys.argv[1:]) if sys.argv[1:] else "xcosd bench methods"
    print(format_report(rep))
    if args.plots:
        plot_report(rep, args.plots)
    if args.json:
        _write_json(args.json, rep)
    return 0


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _write_json(path: str, obj: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1))
    print(f"wrote {p}", file=sys.stderr)
