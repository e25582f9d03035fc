"""``xcosd bench load`` and ``xcosd bench methods``: the benchmarks.

``load`` runs many closed-loop edge devices against one cloud (or, with
``--scaling``, a sweep over device counts with batching on and off); ``methods``
measures every resampling method and codec on real model rows. Both print a
report, and write JSON (``--json``) and PNG plots (``--plots DIR``). ``soak`` runs
devices against one cloud for a while with faults injected throughout (device
kills, cloud restarts, lost and duplicated messages) and checks every output.
``http-streams`` opens many streams at once through one edge's OpenAI-compatible
API and checks every one against the edge's own ``generate``. ``live`` runs the real
pair over an emulated link, ``ar`` beside ``xcosd-e`` and ``tree="auto"``. ``slots``
serves more sessions than a llama.cpp target keeps caches for.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..gc_tuning import many_sessions_gc
from ..methods.tree import DEFAULT_ROW_CODEC
from ..policies.draft_length import DEFAULT_CONFIDENCE, DEFAULT_COST
from .options import (
    UsageError,
    add_curve_client_args,
    add_generation_args,
    add_link_args,
    add_transport_arg,
    add_verbose,
    check_curve_client,
    check_model,
    codec_name,
    endpoints,
    existing_file,
    generation_config,
    method_list,
    method_names,
    nonneg_float,
    nonneg_int,
    percentile_list,
    positive_float,
    positive_int,
    probe,
    rate_or_inf,
    slo,
    split,
    unit_interval,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="load test and method benchmarks",
                       description="Benchmarks: `load` (devices against a cloud; "
                                   "`load-merge` adds up several generators' reports), "
                                   "`methods` (methods x codecs on real model rows), "
                                   "`scale` (throughput against 1, 2, 4 ... replicas, and a "
                                   "kill), `soak` (devices against a cloud with faults, every "
                                   "output checked), `http-streams` (many concurrent streams "
                                   "through one edge's HTTP API), `trees` (draft trees "
                                   "next to chains and ar), `live` (the real pair over an "
                                   "emulated link: ar, xcosd-e and tree=auto side by side), "
                                   "`chat` (multi-turn chats, prefix reuse on and off) and "
                                   "`slots` (more sessions than a llama.cpp target keeps "
                                   "caches for).")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True
    _add_load(bsub)
    _add_load_merge(bsub)
    _add_methods(bsub)
    _add_scale(bsub)
    _add_soak(bsub)
    _add_http_streams(bsub)
    _add_trees(bsub)
    _add_live(bsub)
    _add_chat(bsub)
    _add_slots(bsub)


def _add_outputs(p: Any, what: str) -> None:
    """What both benchmarks write and show (--json, --plots, --progress, -v), defined
    once so the two cannot drift."""
    p.add_argument("--json", default=None, metavar="PATH", help=f"write {what} as JSON")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots there")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="live progress bar on stderr (default: only on a TTY)")
    # default=None as on --progress: the flag pair's default is "decide by the TTY",
    # not store_false's implicit True (which --help would print)
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar")
    add_verbose(p)


# ------------------------------------------------------------------ load


#: the load test's default target (kept here so the parser needs no heavy import)
DEFAULT_TARGET = "synthetic:256:20:0.5"


def _add_load(bsub: Any) -> None:
    p = bsub.add_parser("load", help="N edge devices against one cloud, closed or open loop",
                        description="Load test: N edge devices (asyncio tasks in --procs device "
                                    "processes) against one cloud over ZeroMQ or TCP, the cloud "
                                    "started here or, with --connect, one already running. "
                                    "Closed loop by default, open loop (Poisson arrivals) with "
                                    "--request-rate. Warm-up is excluded from every number. "
                                    "docs/LOAD.md lists the fields of --json.")
    p.add_argument("-n", "--devices", type=positive_int, default=16, help="edge devices")
    p.add_argument("--target", default=None,
                   help=f"target model spec (default {DEFAULT_TARGET}, which costs a+b*rows ms "
                        "per call; default-target, smollm2-135m, gemma3-270m, a model dir ...); "
                        "with --connect: what the cloud there serves, if known (it picks the "
                        "default draft)")
    p.add_argument("--draft", default=None,
                   help="draft model spec (default: a cost-free synthetic draft for a "
                        "synthetic target, default-draft otherwise)")
    p.add_argument("--connect", default=None, type=endpoints, metavar="ENDPOINT",
                   help="load the cloud already running there (xcosd serve, a deployment) "
                        "instead of starting one; the cloud's own side is then not measured")
    add_curve_client_args(p, "device key file (NAME.key_secret) of every device: turns "
                             "CURVE on (with --connect)")
    p.add_argument("--connect-timeout", type=positive_float, default=30.0,
                   help="seconds to wait for the cloud to accept connections")
    p.add_argument("--request-rate", type=rate_or_inf, default=None, metavar="R",
                   help="open loop: generations arrive as a Poisson process of R per second "
                        "(drawn from --seed), spread over the devices round-robin, whether or "
                        "not earlier ones finished; inf or absent: closed loop")
    p.add_argument("--burstiness", type=positive_float, default=1.0, metavar="B",
                   help="with --request-rate: the gaps between arrivals are gamma distributed "
                        "with shape B and the same mean (as vllm bench serve's option): 1 is "
                        "Poisson, below 1 burstier, above 1 more regular (default: 1)")
    p.add_argument("--max-concurrency", type=positive_int, default=None, metavar="N",
                   help="with --request-rate: at most N generations in flight (as vllm bench "
                        "serve's option); an arrival past it waits for a slot, its latencies "
                        "counted from its arrival (default: no cap)")
    p.add_argument("--goodput", type=slo, nargs="+", default=None, metavar="KEY:MS",
                   help="service-level objectives (ttft, tpot, e2e in ms, as vllm bench "
                        "serve's option): report the completed generations that met all of "
                        "them, and their rate")
    p.add_argument("--prompts-file", default=None, type=existing_file, metavar="PATH",
                   help="prompts, cycled: one per line, or JSON Lines with a \"prompt\" field "
                        "(default: a few built-in ones)")
    p.add_argument("--check-greedy", action="store_true",
                   help="compare every generation with the target's own greedy decode of its "
                        "prompt (with --greedy; --target names what the cloud serves): the "
                        "report's greedy check")
    p.add_argument("--percentiles", type=percentile_list, default="50,90,99",
                   help="latency percentiles to report (the JSON always has p50, p90, p99 too)")
    # the generation flags of `xcosd edge`, every one (the devices are edges); only
    # --seed differs: a load run seeds each generation apart, from this one seed
    add_generation_args(p, method_options=True, stop=True, seed=0,
                        seed_help="the run's seed: device i's k-th generation is seeded "
                                  "from it, i and k (reruns repeat, devices differ)")
    p.add_argument("--duration", type=positive_float, default=None,
                   help="measured seconds (default 8 unless --generations is given)")
    p.add_argument("--warmup", type=nonneg_float, default=2.0, help="warm-up seconds (excluded)")
    p.add_argument("--generations", type=positive_int, default=None,
                   help="instead of --duration: measured generations per device")
    p.add_argument("--warmup-generations", type=nonneg_int, default=1,
                   help="warm-up generations per device (excluded)")
    p.add_argument("--no-batching", action="store_true", help="one session per target call")
    p.add_argument("--no-merge", action="store_true",
                   help="the cloud never holds a partial batch for the sessions it just "
                        "answered (see xcosd/nodes/merging.py)")
    p.add_argument("--no-stream", action="store_true",
                   help="the cloud verifies each batch in its worker thread after the call "
                        "and sends the verdicts afterwards (see xcosd/nodes/scheduler.py)")
    p.add_argument("--max-batch", type=positive_int, default=256, help="sessions per target call")
    p.add_argument("--max-wait-ms", type=nonneg_float, default=2.0,
                   help="how long a batch waits to fill up")
    add_transport_arg(p)
    p.add_argument("--procs", type=nonneg_int, default=1,
                   help="device processes (0: devices in the cloud's own event loop)")
    p.add_argument("--timeout", type=positive_float, default=120.0,
                   help="seconds per generation")
    add_link_args(p, what="emulate, on every device,")
    p.add_argument("--scaling", default=None, metavar="N,N,...",
                   help="sweep these device counts, batching on (with and without merging) "
                        "and off (e.g. 1,4,16,64,256)")
    _add_outputs(p, "the report")
    p.set_defaults(func=run_load, check=check_load)


def check_load(args: argparse.Namespace) -> None:
    generation_config(args)
    if args.target is not None:
        check_model(args.target, "--target")
    if args.draft is not None:
        check_model(args.draft, "--draft")
    check_curve_client(args)
    if args.curve_secret and not args.connect:
        raise UsageError("--curve-secret and --curve-server-key are for a cloud run elsewhere "
                         "(--connect)")
    if args.connect and args.scaling is not None:
        raise UsageError("--scaling sweeps the batching of a cloud it starts; not with --connect")
    if args.burstiness != 1.0 and args.request_rate is None:
        raise UsageError("--burstiness shapes the open loop's arrivals: it needs --request-rate")
    if args.check_greedy:
        g = generation_config(args)
        if g.do_sample and g.temperature != 0:
            raise UsageError("--check-greedy compares greedy generations: add --greedy")
        if args.connect and args.target is None:
            raise UsageError("--check-greedy with --connect needs --target (what the cloud "
                             "serves)")
    if args.max_concurrency is not None and args.request_rate is None:
        raise UsageError("--max-concurrency caps the open loop: it needs --request-rate (a "
                         "closed loop's concurrency is its devices)")
    if args.prompts_file:
        from ..bench.load import read_prompts

        try:
            read_prompts(args.prompts_file)
        except (ValueError, OSError) as e:
            raise UsageError(f"--prompts-file: {e}") from None
    if args.scaling is not None:
        try:
            counts = [int(x) for x in split(args.scaling)]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1:
            raise UsageError(f"--scaling: expected device counts like 1,4,16, got {args.scaling!r}")


def load_config(args: argparse.Namespace) -> Any:
    """The LoadConfig the options describe; its ``generation`` is built by the same
    :func:`generation_config` as ``xcosd edge``'s, less the seed (LoadConfig's)."""
    from ..bench.load import LoadConfig, read_prompts

    duration = args.duration
    if duration is None and args.generations is None:
        duration = 8.0
    return LoadConfig(
        devices=args.devices, target=args.target, draft=args.draft,
        generation=generation_config(args).replace(seed=None), duration_s=duration,
        warmup_s=args.warmup, generations=args.generations,
        warmup_generations=args.warmup_generations, batching=not args.no_batching,
        merge_batches=not args.no_merge, stream_verdicts=not args.no_stream,
        max_batch=args.max_batch, max_wait_s=args.max_wait_ms / 1e3, transport=args.transport,
        procs=args.procs, timeout_s=args.timeout, seed=args.seed,
        link_rate_mbps=args.link_mbps, rtt_ms=args.link_rtt_ms, connect=args.connect,
        curve_secret=args.curve_secret, curve_server_key=args.curve_server_key,
        connect_timeout_s=args.connect_timeout, request_rate=args.request_rate,
        burstiness=args.burstiness, goodput=dict(args.goodput) if args.goodput else None,
        max_concurrency=args.max_concurrency,
        prompts=read_prompts(args.prompts_file) if args.prompts_file else None,
        percentiles=tuple(args.percentiles), check_greedy=args.check_greedy)


@many_sessions_gc()  # its cloud and devices (xcosd/gc_tuning.py)
def run_load(args: argparse.Namespace) -> int:
    from ..bench import load, plots
    from ..bench.report import table

    cfg = load_config(args)
    command = "xcosd " + " ".join(sys.argv[1:]) if sys.argv[1:] else "xcosd bench load"
    if cfg.connect:
        # a wrong or dead address fails now, with its reason, not after loading the draft
        probe(cfg.connect, cfg.connect_timeout_s)
    if args.scaling:
        counts = [int(x) for x in split(args.scaling)]
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


def _add_load_merge(bsub: Any) -> None:
    p = bsub.add_parser("load-merge", help="merge the --json reports of several load generators",
                        description="One report from the `bench load --json` reports of load "
                                    "generators that ran side by side against one cloud: "
                                    "counts and rates add up, and the percentiles are those "
                                    "of their raw samples together (exact, not averaged).")
    p.add_argument("reports", nargs="+", type=existing_file, metavar="JSON",
                   help="reports written by `xcosd bench load --json`")
    p.add_argument("--percentiles", type=percentile_list, default=None,
                   help="latency percentiles to report (default: the first report's)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the merged report as JSON")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots there")
    add_verbose(p)
    p.set_defaults(func=run_load_merge)


def run_load_merge(args: argparse.Namespace) -> int:
    from ..bench import load, plots
    from ..errors import XcosdError

    reports = []
    for path in args.reports:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise XcosdError(f"{path}: not a readable JSON report: {e}") from None
    try:
        rep = load.merge_reports(reports, percentiles=args.percentiles)
    except ValueError as e:
        raise XcosdError(str(e)) from None
    rep["command"] = "xcosd " + " ".join(sys.argv[1:]) if sys.argv[1:] else "xcosd bench load-merge"
    print(load.format_report(rep))
    if args.plots:
        plots.load_plots(rep, args.plots)
    if args.json:
        _write_json(args.json, rep)
    return 1 if rep["errors_total"] else 0


# ------------------------------------------------------------------ methods


def _add_methods(bsub: Any) -> None:
    from ..bench import grid as mb

    p = bsub.add_parser("methods", help="every method x codec on real model rows",
                        description="Acceptance, bytes, cloud calls, round trips, measured TV "
                                    "to the target, modeled tokens/s per link rate and live "
                                    "tokens/s, per (pair, method, codec, warper).")
    p.add_argument("--pairs", default="embedded",
                   help="comma list: embedded (the n-gram default pair), real "
                        "(SmolLM2-135M -> Gemma-3-270M, when installed), real-llama.cpp "
                        "(the same pair on llama.cpp)")
    p.add_argument("--methods", type=method_list, default=None,
                   help="comma list (default: all)")
    p.add_argument("--codecs", default=",".join(mb.CODECS),
                   help="comma list (used by methods whose codec applies to a vector)")
    p.add_argument("--warpers", default=",".join(mb.WARPERS), help="comma list of "
                   + ", ".join(mb.WARPERS))
    p.add_argument("--prompts", type=positive_int, default=4, help="prompts per record")
    p.add_argument("--tokens", type=positive_int, default=48, help="new tokens per prompt")
    p.add_argument("--draft-len", type=nonneg_int, default=4,
                   help="tokens the first round drafts (every round's with --fixed-draft-len)")
    p.add_argument("--fixed-draft-len", action="store_true",
                   help="draft --draft-len tokens every round (default: the adaptive length)")
    p.add_argument("--draft-cost", type=nonneg_float, default=DEFAULT_COST,
                   help="the adaptive length's draft step cost over a round's fixed cost")
    p.add_argument("--draft-confidence", type=unit_interval, default=DEFAULT_CONFIDENCE,
                   help="stop a round's drafting after a token below this probability "
                        "(0: never)")
    p.add_argument("--rates", default="100,200,300", help="downlink Mbps for the link model")
    p.add_argument("--link-rtt-ms", type=nonneg_float, default=20.0,
                   help="round-trip time of the link model")
    p.add_argument("--rtt-ms", dest="link_rtt_ms", type=nonneg_float, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    p.add_argument("--tv-trials", type=nonneg_int, default=2000,
                   help="rounds per context for the measured TV (0: skip)")
    p.add_argument("--tv-contexts", type=positive_int, default=3,
                   help="contexts for the measured TV")
    p.add_argument("--live-rate", type=nonneg_float, default=200.0,
                   help="Mbps for the live run through real nodes (0: skip)")
    p.add_argument("--live", default="f32", choices=("f32", "all", "none"),
                   help="which records also run live: 'f32' (each method with f32, at the "
                        "first warper), 'all', or 'none'")
    p.add_argument("--real-tokens", type=positive_int, default=16,
                   help="new tokens per prompt, real pair")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed")
    _add_outputs(p, "the records")
    p.set_defaults(func=run_methods, check=check_methods)


def check_methods(args: argparse.Namespace) -> None:
    for c in split(args.codecs):
        try:
            codec_name(c)
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"--codecs: {e}") from None
    from ..bench import grid as mb

    bad = [w for w in split(args.warpers) if w not in mb.WARPERS]
    if bad:
        raise UsageError(f"--warpers: unknown {', '.join(map(repr, bad))}; known: "
                         + ", ".join(mb.WARPERS))
    try:
        [float(x) for x in split(args.rates)]
    except ValueError:
        raise UsageError(f"--rates: expected Mbps like 100,200, got {args.rates!r}") from None


def run_methods(args: argparse.Namespace) -> int:
    from ..bench.grid import all_methods
    from ..bench.methods import MethodsConfig, format_report, plot_report
    from ..bench.methods import run_methods_sync as run_grid

    cfg = MethodsConfig(
        pairs=split(args.pairs), methods=args.methods or all_methods(), codecs=split(args.codecs),
        warpers=split(args.warpers), prompts=args.prompts, tokens=args.tokens,
        real_tokens=args.real_tokens, draft_len=args.draft_len,
        adaptive_draft=not args.fixed_draft_len, draft_cost=args.draft_cost,
        draft_confidence=args.draft_confidence,
        rates_mbps=[float(x) for x in split(args.rates)], rtt_ms=args.link_rtt_ms,
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


# ------------------------------------------------------------------ trees


def _add_trees(bsub: Any) -> None:
    p = bsub.add_parser("trees", help="draft trees next to chains and ar on real models",
                        description="Each shape generates the same seeded prompts through "
                                    "the protocol (state machines, wire bytes): tokens per "
                                    "round trip, target calls, bytes, compute, modeled "
                                    "tok/s; the shape the tree policy "
                                    "picks from the measured acceptance is run too.")
    p.add_argument("--pairs", default="embedded",
                   help="comma list: embedded, real (transformers), real-llama.cpp")
    p.add_argument("--shapes", default=None,
                   help="comma list of shapes: chain:D, W1xW2x..., spine:W1xW2x... "
                        "(default: a set of chains and trees)")
    p.add_argument("--warpers", default="T=1", help="comma list of warpers (as bench methods)")
    p.add_argument("--method", default="xcosd-e", help="a lossless drafting method")
    p.add_argument("--row-codec", default=DEFAULT_ROW_CODEC,
                   help="the branching rows' codec (the draft proposes from what it "
                        f"commits; default {DEFAULT_ROW_CODEC}, a session's)")
    p.add_argument("--prompts", type=int, default=8, help="embedded pair's prompts")
    p.add_argument("--tokens", type=int, default=64, help="tokens per embedded prompt")
    p.add_argument("--real-prompts", type=int, default=3)
    p.add_argument("--real-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the report as JSON (bench/out/trees.json feeds RESULTS)")
    p.set_defaults(func=run_trees_cmd)


def run_trees_cmd(args: argparse.Namespace) -> int:
    from ..bench.trees import SHAPES, TreesConfig, format_report, run_trees

    cfg = TreesConfig(pairs=split(args.pairs),
                      shapes=split(args.shapes) if args.shapes else list(SHAPES),
                      warpers=split(args.warpers), method=args.method, row_codec=args.row_codec,
                      prompts=args.prompts, tokens=args.tokens, real_prompts=args.real_prompts,
                      real_tokens=args.real_tokens, seed=args.seed)
    rep = run_trees(cfg)
    rep["command"] = "xcosd " + " ".join(sys.argv[1:]) if sys.argv[1:] else "xcosd bench trees"
    print(format_report(rep))
    if args.json:
        _write_json(args.json, rep)
    return 0


# ------------------------------------------------------------------ scale

#: the scaling bench's target (xcosd.bench.scale.DEFAULT_TARGET, kept here so the
#: parser needs no heavy import)
SCALE_TARGET = "synthetic:256:20:0.5"


def _add_scale(bsub: Any) -> None:
    p = bsub.add_parser("scale", help="throughput against 1, 2, 4 ... replicas, and a kill",
                        description="Closed-loop devices against `xcosd serve --replicas N` "
                                    "for each N: tokens/s and the ratio to one replica; the "
                                    "controls (one replica serving its share of the devices "
                                    "alone, N clouds without a broker); then a run in which a "
                                    "replica process is killed, every output checked against "
                                    "the target's greedy decode.")
    p.add_argument("-n", "--devices", type=positive_int, default=128, help="edge devices")
    p.add_argument("--replicas", default="1,2,4", metavar="N,N,...",
                   help="replica counts to measure")
    p.add_argument("--target", default=SCALE_TARGET,
                   help="target model spec (the default sleeps a+b*rows ms per call)")
    p.add_argument("--method", default="xcosd-e", help="the devices' method")
    p.add_argument("--draft-len", type=positive_int, default=4, help="tokens drafted per round")
    p.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="tokens per generation")
    p.add_argument("--duration", type=positive_float, default=10.0, help="measured seconds")
    p.add_argument("--warmup", type=nonneg_float, default=3.0, help="warm-up seconds (excluded)")
    p.add_argument("--max-batch", type=positive_int, default=256, help="sessions per target call")
    p.add_argument("--max-batch-tokens", type=positive_int, default=4096,
                   help="rows per target call")
    p.add_argument("--max-wait-ms", type=nonneg_float, default=2.0,
                   help="how long a batch waits to fill up")
    p.add_argument("--no-controls", action="store_true",
                   help="skip the controls (one replica alone, N clouds without a broker)")
    p.add_argument("--no-kill", action="store_true", help="skip the killed-replica run")
    p.add_argument("--kill-replicas", type=positive_int, default=2,
                   help="replicas in the killed run (one is killed)")
    p.add_argument("--kill-generations", type=positive_int, default=3,
                   help="generations per device in the killed run")
    p.add_argument("--kill-after", type=nonneg_float, default=3.0,
                   help="seconds into the killed run to kill a replica")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the report there (default: bench/out/scale.json)")
    p.add_argument("--balancers", default="2,4", metavar="N,N,...|none",
                   help="cloud counts at which to compare the broker, HAProxy in front of "
                        "plain xcosd serve processes, and independent clouds (then, at each "
                        "count, a kill for each way and a drain through HAProxy and without "
                        "a balancer); written to bench/out/balancers.json")
    p.add_argument("--only-balancers", action="store_true",
                   help="run only that comparison")
    add_verbose(p)
    p.set_defaults(func=run_scale, check=check_scale)


def _replica_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in split(text))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise UsageError(f"--replicas: expected replica counts like 1,2,4, got {text!r}")
    return counts


def check_scale(args: argparse.Namespace) -> None:
    check_model(args.target, "--target")
    _replica_counts(args.replicas)
    if args.balancers != "none":
        _replica_counts(args.balancers)
    elif args.only_balancers:
        raise UsageError("--only-balancers with --balancers none runs nothing")
    if not args.no_kill and args.kill_replicas < 2:
        raise UsageError("--kill-replicas: the killed run needs 2 replicas or more")


@many_sessions_gc()  # its cloud and devices (xcosd/gc_tuning.py)
def run_scale(args: argparse.Namespace) -> int:
    from ..bench.scale import OUT_FILE, ScaleConfig, format_report, run_scale_sync

    cfg = ScaleConfig(
        devices=args.devices, replicas=_replica_counts(args.replicas), target=args.target,
        method=args.method, draft_len=args.draft_len, max_new_tokens=args.max_new_tokens,
        warmup_s=args.warmup, duration_s=args.duration, max_batch=args.max_batch,
        max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms,
        controls=not args.no_controls, kill=not args.no_kill, kill_replicas=args.kill_replicas,
        kill_generations=args.kill_generations, kill_after_s=args.kill_after)
    command = "xcosd " + " ".join(sys.argv[1:]) if sys.argv[1:] else "xcosd bench scale"
    failed = False
    if not args.only_balancers:
        rep = run_scale_sync(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
        rep["command"] = command
        print(format_report(rep))
        _write_json(args.json or str(OUT_FILE), rep)
        k = rep["killed"]
        failed = any(p["errors"] for p in rep["points"]) or bool(
            k is not None and (k["tokens_lost"] or k["failed"]))
    if args.balancers != "none":
        import asyncio

        from ..bench import balancing_ways
        from ..bench.report import machine

        brep = asyncio.run(balancing_ways.compare(
            cfg, _replica_counts(args.balancers),
            log=lambda line: print(line, file=sys.stderr, flush=True)))
        brep.update(schema_version=1, kind="balancers", config=cfg.to_dict(),
                    machine=machine(), command=command)
        print(balancing_ways.format_report(brep))
        _write_json(str(balancing_ways.OUT_FILE), brep)
        failed = failed or balancing_ways.failed(brep)
    return 1 if failed else 0

# ------------------------------------------------------------------ soak


def _add_soak(bsub: Any) -> None:
    from ..bench.soak import PAIRS, SoakConfig

    d = SoakConfig()
    p = bsub.add_parser("soak", help="devices against one cloud for a while, with faults",
                        description="N edge devices generate greedily against one cloud for "
                                    "--duration seconds while devices are killed, the cloud "
                                    "restarts and messages are lost and duplicated; every "
                                    "output is compared with the target's own greedy decode. "
                                    "Reports tokens/s, mismatches, errors, the sessions left "
                                    "on the cloud and the process's memory over time; exit "
                                    "status 1 if a check fails.")
    p.add_argument("-n", "--devices", type=positive_int, default=d.devices,
                   help="edge devices running at any time")
    p.add_argument("--duration", type=positive_float, default=d.duration_s,
                   help="seconds of faults and generations (then the running generations "
                        "finish and the cloud must free every session)")
    p.add_argument("--pair", choices=PAIRS, default=d.pair,
                   help="models: bytes (two byte-level n-grams, cheap rows) or embedded (the "
                        "default n-gram pair, 128k-200k-entry rows)")
    p.add_argument("--method", default=d.method, choices=method_names(), metavar="METHOD",
                   help="resampling method: %(choices)s")
    p.add_argument("--codec", default=d.codec, type=codec_name, help="probability codec")
    p.add_argument("--draft-len", type=nonneg_int, default=d.draft_len,
                   help="tokens drafted per round")
    p.add_argument("--max-new-tokens", type=positive_int, default=d.max_new_tokens,
                   help="tokens per generation")
    p.add_argument("--prompts", type=positive_int, default=d.prompts,
                   help="distinct prompts (each one's greedy decode is computed once)")
    p.add_argument("--loss", type=unit_interval, default=d.loss,
                   help="probability that a message is lost, per message and direction")
    p.add_argument("--duplicate", type=unit_interval, default=d.duplicate,
                   help="probability that a message is duplicated, per message and direction")
    p.add_argument("--kill-rate", type=nonneg_float, default=d.kill_rate,
                   help="device kills per second, on average (each replaced by a new device)")
    p.add_argument("--restarts", type=nonneg_int, default=d.restarts,
                   help="cloud restarts, evenly spaced over the run")
    p.add_argument("--heartbeat", type=positive_float, default=d.heartbeat_s,
                   help="seconds between an edge's pings")
    p.add_argument("--edge-timeout", type=positive_float, default=d.edge_timeout_s,
                   help="seconds of cloud silence after which an edge reconnects")
    p.add_argument("--cloud-timeout", type=positive_float, default=d.cloud_timeout_s,
                   help="seconds of silence after which the cloud frees a peer's sessions")
    p.add_argument("--resend-after", type=positive_float, default=d.resend_after_s,
                   help="seconds before an edge asks again for a late answer")
    p.add_argument("--generation-timeout", type=positive_float, default=d.generation_timeout_s,
                   help="seconds one generation may take")
    p.add_argument("--warmup-fraction", type=float, default=d.warmup_fraction,
                   help="share of the run before the memory baseline is sampled (over "
                        "ZeroMQ, libzmq allocates each connection's queue memory only as "
                        "that connection's messages pass: see docs/RESULTS.md)")
    add_transport_arg(p)
    p.add_argument("--seed", type=nonneg_int, default=d.seed,
                   help="seed of the prompts, the kills and the links")
    _add_outputs(p, "the report (default: bench/out/soak.json)")
    p.set_defaults(func=run_soak, check=check_soak)


def check_soak(args: argparse.Namespace) -> None:
    if args.loss >= 1:
        raise UsageError("--loss: expected a probability below 1 (every message lost "
                         "leaves nothing to measure)")
    try:
        soak_config(args)
    except ValueError as e:
        raise UsageError(str(e)) from None


def soak_config(args: argparse.Namespace) -> Any:
    """The SoakConfig the options describe."""
    from ..bench.soak import SoakConfig

    return SoakConfig(
        devices=args.devices, duration_s=args.duration, pair=args.pair, method=args.method,
        codec=args.codec, draft_len=args.draft_len, max_new_tokens=args.max_new_tokens,
        prompts=args.prompts, loss=args.loss, duplicate=args.duplicate,
        kill_rate=args.kill_rate, restarts=args.restarts, heartbeat_s=args.heartbeat,
        edge_timeout_s=args.edge_timeout, cloud_timeout_s=args.cloud_timeout,
        resend_after_s=args.resend_after, generation_timeout_s=args.generation_timeout,
        transport=args.transport, seed=args.seed, warmup_fraction=args.warmup_fraction)


@many_sessions_gc()  # its cloud and devices (xcosd/gc_tuning.py)
def run_soak(args: argparse.Namespace) -> int:
    import logging

    from ..bench.soak import OUT_FILE, format_report, plot
    from ..bench.soak import run_soak as run

    nodes_log = logging.getLogger("xcosd.nodes")
    level = nodes_log.level
    if not (args.verbose or getattr(args, "verbose_sub", 0)):
        # the faults are injected on purpose: every edge's "connection lost;
        # reconnecting" at a restart is expected, and would bury the report
        nodes_log.setLevel(logging.ERROR)
    try:
        rep = run(soak_config(args), progress=args.progress)
    finally:
        nodes_log.setLevel(level)
    rep["command"] = "xcosd " + " ".join(sys.argv[1:]) if sys.argv[1:] else "xcosd bench soak"
    print(format_report(rep))
    if args.plots:
        plot(rep, Path(args.plots) / "soak.png")
    _write_json(args.json or str(OUT_FILE), rep)
    return 0 if rep["ok"] else 1


def _write_json(path: str, obj: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1))
    print(f"wrote {p}", file=sys.stderr)


# ------------------------------------------------------------------ http-streams


def _add_http_streams(bsub: Any) -> None:
    p = bsub.add_parser("http-streams",
                        help="many concurrent streams through one edge's HTTP API",
                        description="Opens --streams streams at once through one edge's "
                                    "OpenAI-compatible API (a client process of its own, the "
                                    "cloud in another) and checks each stream's text against "
                                    "EdgeNode.generate for its seed; reports failures, "
                                    "mismatches, each stream's time to first text and "
                                    "tokens/s, and the edge's memory (xcosd/bench/"
                                    "http_streams.py). Exits 1 if a goal is missed.")
    p.add_argument("--streams", type=positive_int, default=1000, help="streams at once")
    p.add_argument("--tokens", type=positive_int, default=32, help="tokens per stream")
    p.add_argument("--pair", default="ngram", choices=("ngram", "remote"),
                   help="ngram: the embedded pair (its cloud computes on this machine); "
                        "remote: a synthetic target sleeping 20 ms a call")
    p.add_argument("--seed", type=positive_int, default=1000, help="the first stream's seed")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the report there (default: bench/out/http_streams.json)")
    p.set_defaults(func=run_http_streams)


def run_http_streams(args: argparse.Namespace) -> int:
    from ..bench import http_streams

    argv = ["--streams", str(args.streams), "--tokens", str(args.tokens), "--pair", args.pair,
            "--seed", str(args.seed), "--json", args.json or str(http_streams.OUT)]
    return http_streams.main(argv)


def _add_live(bsub: Any) -> None:
    p = bsub.add_parser("live", help="the real pair live over an emulated link, ar beside xcosd-e",
                        description="SmolLM2-135M drafting for Gemma-3-270m on llama.cpp, the "
                                    "cloud an `xcosd serve --link-rtt-ms RTT` process on a core "
                                    "of its own and the edge on the other: ar, default xcosd-e "
                                    "and xcosd-e with tree=auto side by side at each RTT, "
                                    "unseeded, so the policies see the real round trip "
                                    "(xcosd/bench/live_link.py).")
    p.add_argument("--rtt-ms", default="50", metavar="MS[,MS...]",
                   help="comma-separated round-trip times")
    p.add_argument("--prompts", type=positive_int, default=3)
    p.add_argument("--tokens", type=positive_int, default=48, help="tokens per prompt")
    p.add_argument("--passes", type=positive_int, default=2,
                   help="every row once per pass, in rotated order (medians reported)")
    p.add_argument("--temperature", type=nonneg_float, default=0.7)
    p.add_argument("--top-p", type=unit_interval, default=0.9)
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the report there (default: bench/out/live_link.json)")
    p.set_defaults(func=run_live, check=check_live)


def _add_chat(bsub: Any) -> None:
    p = bsub.add_parser("chat", help="multi-turn chats through the OpenAI API, prefix reuse "
                                     "on and off",
                        description="SmolLM2-135M drafting for Gemma-3-270m on llama.cpp, one "
                                    "core a side: one chat turn by turn (time to first token, "
                                    "positions each side computes, uplink bytes per turn) and "
                                    "devices opening at once with one system prompt, with prefix "
                                    "reuse on and off (xcosd/bench/chat_turns.py).")
    p.add_argument("--turns", type=positive_int, default=8)
    p.add_argument("--devices", type=positive_int, default=16)
    p.add_argument("--system-tokens", type=positive_int, default=400)
    p.add_argument("--turn-tokens", type=positive_int, default=150)
    p.add_argument("--max-tokens", type=positive_int, default=16, help="tokens per answer")
    p.add_argument("--context", type=positive_int, default=None,
                   help="positions per session on both models (default: the models' own)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the report there (default: bench/out/chat_turns.json)")
    p.set_defaults(func=run_chat, check=check_live)


def run_chat(args: argparse.Namespace) -> int:
    from ..bench import chat_turns

    argv = ["--turns", str(args.turns), "--devices", str(args.devices), "--system-tokens",
            str(args.system_tokens), "--turn-tokens", str(args.turn_tokens), "--max-tokens",
            str(args.max_tokens), "--json", args.json or str(chat_turns.OUT),
            *(["--context", str(args.context)] if args.context else [])]
    return chat_turns.main(argv)


def check_live(args: argparse.Namespace) -> None:
    check_model("smollm2-135m@llama.cpp", "bench live")
    check_model("gemma3-270m@llama.cpp", "bench live")


def run_live(args: argparse.Namespace) -> int:
    from ..bench import live_link

    argv = ["--rtt-ms", args.rtt_ms, "--prompts", str(args.prompts), "--tokens",
            str(args.tokens), "--passes", str(args.passes), "--temperature",
            repr(args.temperature), "--top-p", repr(args.top_p),
            "--json", args.json or str(live_link.OUT_DIR / live_link.OUT_NAME)]
    return live_link.main(argv)


def _add_slots(bsub: Any) -> None:
    p = bsub.add_parser("slots", help="more sessions than a llama.cpp target keeps caches for",
                        description="Gemma-3-270m on llama.cpp as a cloud's target with each "
                                    "--slots count, serving --sessions generations at once: "
                                    "evictions, tokens fed per generated token (sessions "
                                    "evaluated again), time per round and tokens/s "
                                    "(xcosd/bench/slots.py).")
    p.add_argument("--slots", default="4,8,12", metavar="N[,N...]",
                   help="comma-separated slot counts, one run each")
    p.add_argument("--sessions", type=positive_int, default=12)
    p.add_argument("--prompt-tokens", type=positive_int, default=96)
    p.add_argument("--tokens", type=positive_int, default=6, help="tokens per session")
    p.add_argument("--threads", type=positive_int, default=1, help="the target's threads")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the report there (default: bench/out/slots.json)")
    p.set_defaults(func=run_slots, check=check_slots)


def check_slots(args: argparse.Namespace) -> None:
    try:
        counts = [int(x) for x in args.slots.split(",")]
    except ValueError:
        raise UsageError(f"--slots: expected comma-separated integers, got {args.slots!r}") from None
    if not all(1 <= n <= 64 for n in counts):
        raise UsageError("--slots: each count must be in 1..64")
    check_model("gemma3-270m@llama.cpp", "bench slots")


def run_slots(args: argparse.Namespace) -> int:
    from ..bench import slots

    argv = ["--slots", args.slots, "--sessions", str(args.sessions), "--prompt-tokens",
            str(args.prompt_tokens), "--tokens", str(args.tokens), "--threads",
            str(args.threads), "--json", args.json or str(slots.OUT_DIR / slots.OUT_NAME)]
    return slots.main(argv)
