"""``xcosd demo`` (what ``make demo`` runs): every method, end to end, on one machine.

It starts a CloudNode and several EdgeNodes over ZeroMQ on loopback, each edge
behind an emulated 100 Mbps / 20 ms link, streams one generation to the terminal,
then runs a set of prompts through every method and prints one table: tokens/s
(wall and modeled), acceptance rate, mean acceptance length, bytes per token each
way, cloud calls per token and whether the method is lossless.

The models are the embedded default pair (an n-gram draft over ``o200k`` and an
n-gram target over ``llama3``: two real, different vocabularies); ``--real``
switches to SmolLM2-135M -> Gemma-3-270M when those packages are installed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from .options import (
    add_generation_args,
    add_link_args,
    add_loop_args,
    add_verbose,
    check_model,
    generation_config,
    is_tty,
    method_list,
    positive_int,
)
from .serve import run_main

PROMPTS = [
    "Return a new list containing",
    "The default value of the",
    "This module provides",
    "Raise ValueError if the",
    "If the argument is a",
    "The following example shows how to",
    "Create a new socket using the given",
    "Open the file and return a",
]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="every method end to end on one machine, with a table",
                       description="A cloud and several edges over ZeroMQ on loopback behind "
                                   "an emulated link; every method; one table.")
    p.add_argument("--real", action="store_true",
                   help="SmolLM2-135M (draft) -> Gemma-3-270M (target), if installed")
    p.add_argument("--edges", type=positive_int, default=4, help="edge nodes (devices)")
    p.add_argument("--prompts", type=positive_int, default=12, help="prompts per method")
    p.add_argument("--methods", type=method_list, default=None,
                   help="comma-separated methods (default: all)")
    add_generation_args(p, method=False, seed=0)
    add_link_args(p, mbps=100.0, rtt_ms=20.0)
    p.add_argument("--no-emulate", action="store_true",
                   help="model the link but do not delay messages for real")
    p.add_argument("--no-stream", action="store_true", help="skip the streamed generation")
    add_loop_args(p)
    add_verbose(p)
    p.set_defaults(func=run, check=check)


def check(args: argparse.Namespace) -> None:
    generation_config(args, method="xcosd-e")
    if args.real:
        check_model("smollm2-135m", "--real")
        check_model("gemma3-270m", "--real")


def run(args: argparse.Namespace) -> int:
    return run_main(_demo(args), args.uvloop)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _load(real: bool) -> tuple[Any, Any]:
    from ..models import default_pair, load_model

    if real:
        return (await asyncio.to_thread(load_model, "smollm2-135m"),
                await asyncio.to_thread(load_model, "gemma3-270m"))
    return await asyncio.to_thread(default_pair)


async def _demo(args: argparse.Namespace) -> int:
    from ..methods import METHODS
    from ..nodes import CloudNode, EdgeNode
    from ..transport import LinkSpec

    t0 = time.perf_counter()
    _say("xcosd demo: loading the models (the first run trains the n-gram pair) ...")
    draft, target = await _load(args.real)
    _say(f"  draft  {draft.name} (|V| = {draft.vocab.size:,})\n"
         f"  target {target.name} (|V| = {target.vocab.size:,})   "
         f"[{time.perf_counter() - t0:.1f}s]")
    spec = LinkSpec.of(up_bps=args.link_mbps * 1e6, down_bps=args.link_mbps * 1e6,
                       rtt_s=args.link_rtt_ms / 1000)
    emulate = None if args.no_emulate else spec
    methods = args.methods or list(METHODS)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    cfg = generation_config(args, method="xcosd-e")
    rows: list[tuple[str, Any, float]] = []
    async with CloudNode(target=target, bind="tcp://127.0.0.1:0", max_wait_s=0.002) as cloud:
        _say(f"cloud on {cloud.endpoint}; {args.edges} edges behind an emulated "
             f"{args.link_mbps:g} Mbps / {args.link_rtt_ms:g} ms link"
             + (" (modeled only)" if emulate is None else ""))
        def edge(i: int, vmap: Any = None) -> EdgeNode:
            return EdgeNode(draft=draft, connect=cloud.endpoint, link=emulate, model_link=spec,
                            config=cfg, name=f"edge-{i}", vocab_map=vmap)

        edges = [edge(0)]
        try:
            t = time.perf_counter()
            # the first edge fetches the target vocabulary; the others reuse its V_C map
            await edges[0].start()
            vmap = edges[0].vocab_map
            assert vmap is not None
            edges += [edge(i, vmap) for i in range(1, args.edges)]
            await asyncio.gather(*[e.start() for e in edges[1:]])
            _say(f"edges connected, V_C agreed: |V_C| = {vmap.n_common:,}, "
                 f"|V_O| = {vmap.n_other:,}   [{time.perf_counter() - t:.1f}s]")
            if not args.no_stream:
                await _stream_one(edges[0], prompts[0], args)
            for name in methods:
                rows.append(await _run_method(name, edges, prompts, args))
        finally:
            await asyncio.gather(*[e.close() for e in edges])
        cstats = cloud.stats()
    print(_table(rows, args))
    sched = cstats["scheduler"]
    print(f"\ncloud: {cstats['sessions_opened']} sessions, {cstats['rounds']} rounds in "
          f"{sched.get('batches', 0)} batched target calls (mean batch "
          f"{sched.get('mean_batch_size', 0):.2f}); total {time.perf_counter() - t0:.1f}s")
    return 0


async def _stream_one(edge: Any, prompt: str, args: argparse.Namespace) -> None:
    _say("\n--- one generation, streamed (xcosd-e) ---")
    sys.stdout.write(prompt)
    sys.stdout.flush()

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    res = await edge.generate(prompt, max_new_tokens=args.max_new_tokens * 2, on_text=show)
    st = res.stats
    sys.stdout.write("\n")
    _say(f"--- {st.tokens} tokens, acceptance {st.acceptance_rate:.2f}, mean length "
         f"{st.mean_acceptance_length:.2f}, {st.tokens_per_s:.1f} tok/s ---\n")


async def _run_method(name: str, edges: list[Any], prompts: list[str],
                      args: argparse.Namespace) -> tuple[str, Any, float]:
    from ..nodes import merge

    t = time.perf_counter()
    done = 0
    # carriage-return progress is for a terminal; in a log it would be one long line
    live = is_tty(sys.stderr)

    async def one(i: int, p: str) -> Any:
        nonlocal done
        seed = None if args.seed is None else args.seed + i
        r = await edges[i % len(edges)].generate(p, method=name, seed=seed)
        done += 1
        if live:
            print(f"\r  {name:<16} {done}/{len(prompts)} generations", end="",
                  file=sys.stderr, flush=True)
        return r

    results = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    wall = time.perf_counter() - t
    st = merge([r.stats for r in results])
    print(f"{chr(13) if live else ''}  {name:<16} {len(prompts)} generations, {st.tokens} "
          f"tokens in {wall:.1f}s", file=sys.stderr, flush=True)
    return name, st, wall


def _table(rows: list[tuple[str, Any, float]], args: argparse.Namespace) -> str:
    from ..methods import METHODS

    head = ("method", "lossless", "tok/s wall", "tok/s model", "accept", "mean len",
            "up B/tok", "down B/tok", "calls/tok")
    lines = []
    for name, st, _wall in rows:
        n = max(1, st.tokens)
        lines.append((
            name, "yes" if METHODS[name].lossless else "NO",
            # per generation: its tokens over its own wall / modeled time
            f"{st.tokens_per_s:.1f}", f"{st.modeled_tokens_per_s:.1f}",
            f"{st.acceptance_rate:.3f}" if st.drafted else "-",
            f"{st.mean_acceptance_length:.2f}",
            f"{st.uplink_bytes / n:.1f}", f"{st.downlink_bytes / n:.1f}",
            f"{st.target_calls / n:.3f}"))
    w = [max(len(head[i]), *(len(r[i]) for r in lines)) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w[0]}}}" if i == 0 else f"{{:>{w[i]}}}" for i in range(len(head)))
    out = [f"\nper method: {args.prompts} prompts x {args.max_new_tokens} tokens, "
           f"codec {args.codec}, link {args.link_mbps:g} Mbps / {args.link_rtt_ms:g} ms; "
           "tok/s per generation (model: RTT/2 + 8 bytes / rate per message + measured "
           "compute)",
           fmt.format(*head), fmt.format(*("-" * x for x in w))]
    out += [fmt.format(*r) for r in lines]
    return "\n".join(out)
