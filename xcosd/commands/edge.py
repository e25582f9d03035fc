"""``xcosd edge``: run an EdgeNode against a cloud and generate.

    xcosd edge --connect tcp://127.0.0.1:5555 --method xcosd-e "Return a new list"

Text streams to stdout as it is committed; a stats line per generation goes to
stderr. ``--json`` prints instead one JSON object per prompt on stdout (text, token
ids, finish reason, full stats). Several prompts (arguments, or ``--prompts-file``
with one per line) run concurrently with ``--concurrent``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from .options import (
    add_curve_client_args,
    add_generation_args,
    add_link_args,
    add_loop_args,
    add_transport_arg,
    add_verbose,
    check_curve_client,
    check_model,
    endpoint,
    existing_file,
    generation_config,
    link_from_args,
    positive_float,
    probe,
)
from .serve import run_main


def add_parser(sub: Any) -> None:
    p = sub.add_parser("edge", help="run an edge node (the draft model) and generate",
                       description="Draft on this device, verify in the cloud.")
    p.add_argument("prompts", nargs="*",
                   help="prompt text (default: --prompts-file, else stdin when piped)")
    p.add_argument("--prompts-file", default=None, type=existing_file,
                   help="one prompt per line")
    p.add_argument("--draft", default="default-draft",
                   help="model spec for xcosd.models.load_model")
    p.add_argument("--connect", default="tcp://127.0.0.1:5555", type=endpoint,
                   help="the cloud's endpoint")
    add_transport_arg(p)
    add_generation_args(p, method_options=True, stop=True)
    p.add_argument("--concurrent", action="store_true", help="run all prompts at once")
    p.add_argument("--no-stream", action="store_true", help="print each text when done")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt on stdout (prompt, text, token ids, "
                        "stats) instead of the text")
    add_curve_client_args(p, "device key file (NAME.key_secret): turns CURVE on")
    p.add_argument("--timeout", type=positive_float, default=15.0,
                   help="seconds of silence before the cloud counts as lost")
    p.add_argument("--connect-timeout", type=positive_float, default=30.0,
                   help="seconds to wait for the cloud to accept the connection")
    add_loop_args(p)
    add_link_args(p)
    add_verbose(p)
    p.set_defaults(func=run, check=check)


def check(args: argparse.Namespace) -> None:
    generation_config(args)
    check_curve_client(args)
    check_model(args.draft, "--draft")


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [ln.rstrip("\n") for ln in f if ln.strip()]
    if not prompts and not sys.stdin.isatty():
        prompts = [ln.rstrip("\n") for ln in sys.stdin if ln.strip()]
    return prompts or [""]


def run(args: argparse.Namespace) -> int:
    return run_main(_edge(args), args.uvloop)


def stats_line(st: Any) -> str:
    return (f"[{st.method}/{st.codec}] {st.tokens} tokens, {st.rounds} rounds, acceptance "
            f"{st.acceptance_rate:.2f}, mean length {st.mean_acceptance_length:.2f}, "
            f"up {st.uplink_bytes} B, down {st.downlink_bytes} B, "
            f"{st.tokens_per_s:.1f} tok/s wall, {st.finish_reason}")


async def _edge(args: argparse.Namespace) -> int:
    from ..models import load_model
    from ..nodes import EdgeNode

    cfg = generation_config(args)
    # a wrong or dead address fails now, with its reason, not after loading the model
    await asyncio.to_thread(probe, args.connect, args.connect_timeout)
    curve = None
    if args.curve_secret:
        from ..transport import CurveClient

        curve = CurveClient.from_files(args.curve_secret, args.curve_server_key)
    print(f"loading {args.draft} ...", file=sys.stderr, flush=True)
    draft = await asyncio.to_thread(load_model, args.draft)
    prompts = _prompts(args)
    async with EdgeNode(draft=draft, connect=args.connect, transport=args.transport,
                        config=cfg, link=link_from_args(args), curve=curve,
                        timeout_s=args.timeout,
                        connect_timeout_s=args.connect_timeout) as edge:
        if args.concurrent or args.no_stream or args.json:
            results = ([await edge.generate(p) for p in prompts] if not args.concurrent
                       else await asyncio.gather(*[edge.generate(p) for p in prompts]))
            for p, r in zip(prompts, results, strict=True):
                if args.json:
                    print(json.dumps({"prompt": p, "text": r.text, "token_ids": r.token_ids,
                                      "finish_reason": r.finish_reason,
                                      "stats": r.stats.to_dict()}), flush=True)
                else:
                    print(p + r.text, flush=True)
                    print(stats_line(r.stats), file=sys.stderr, flush=True)
            return 0

        def show(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        for p in prompts:
            show(p)
            r = await edge.generate(p, on_text=show)
            show("\n")
            print(stats_line(r.stats), file=sys.stderr, flush=True)
    return 0
