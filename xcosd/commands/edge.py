"""``xcosd edge``: run an EdgeNode against a cloud and generate.

    xcosd edge --connect tcp://127.0.0.1:5555 --method xcosd-e "Return a new list"

Text streams to stdout as it is committed; a stats line per generation goes to
stderr (``--json`` prints the full stats). Several prompts (arguments, or
``--prompts-file`` with one per line) run concurrently with ``--concurrent``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from .serve import add_link_args, link_from_args, run_main


def add_parser(sub: Any) -> None:
    p = sub.add_parser("edge", help="run an edge node (the draft model) and generate",
                       description="Draft on this device, verify in the cloud.")
    p.add_argument("prompts", nargs="*", help="prompt text (default: read --prompts-file)")
    p.add_argument("--prompts-file", default=None, help="one prompt per line")
    p.add_argument("--draft", default="default-draft",
                   help="model spec for xcosd.models.load_model (default: default-draft)")
    p.add_argument("--connect", default="tcp://127.0.0.1:5555", help="the cloud's endpoint")
    p.add_argument("--transport", choices=("zmq", "tcp"), default="zmq")
    p.add_argument("--method", default="xcosd-e")
    p.add_argument("--codec", default="f32")
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("-K", type=int, default=None, help="xcosd-e candidates per round")
    p.add_argument("-M", type=int, default=None, help="xcosd-e candidate rounds before HR")
    p.add_argument("--no-hr-presample", action="store_true",
                   help="HR: ask for the V_O sample with an extra round trip")
    p.add_argument("--threshold", type=float, default=None, help="uhlm uncertainty threshold")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--concurrent", action="store_true", help="run all prompts at once")
    p.add_argument("--no-stream", action="store_true", help="print each text when done")
    p.add_argument("--json", action="store_true", help="print full stats as JSON (stderr)")
    p.add_argument("--curve-secret", default=None, help="device key file (NAME.key_secret)")
    p.add_argument("--curve-server-key", default=None, help="the server's public key file")
    p.add_argument("--timeout", type=float, default=15.0)
    p.add_argument("--uvloop", action="store_true", help="run on uvloop")
    add_link_args(p)
    p.set_defaults(func=run)


def method_options(args: argparse.Namespace) -> dict[str, Any]:
    from ..methods import get_method

    opts: dict[str, Any] = {}
    if args.K is not None:
        opts["K"] = args.K
    if args.M is not None:
        opts["M"] = args.M
    if args.no_hr_presample:
        opts["hr_presample"] = False
    if args.threshold is not None:
        opts["threshold"] = args.threshold
    known = get_method(args.method).options()
    return {k: v for k, v in opts.items() if k in known}


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

    curve = None
    if args.curve_secret:
        from ..transport import CurveClient

        curve = CurveClient.from_files(args.curve_secret, args.curve_server_key)
    print(f"loading {args.draft} ...", file=sys.stderr, flush=True)
    draft = await asyncio.to_thread(load_model, args.draft)
    prompts = _prompts(args)
    kw: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "seed": args.seed}
    async with EdgeNode(draft=draft, connect=args.connect, transport=args.transport,
                        method=args.method, codec=args.codec, draft_len=args.draft_len,
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        link=link_from_args(args), curve=curve, timeout_s=args.timeout,
                        **method_options(args)) as edge:
        if args.concurrent or args.no_stream:
            results = ([await edge.generate(p, **kw) for p in prompts] if not args.concurrent
                       else await asyncio.gather(*[edge.generate(p, **kw) for p in prompts]))
            for p, r in zip(prompts, results, strict=True):
                print(p + r.text, flush=True)
                _report(args, r.stats)
            return 0
        def show(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        for p in prompts:
            show(p)
            r = await edge.generate(p, on_text=show, **kw)
            show("\n")
            _report(args, r.stats)
    return 0


def _report(args: argparse.Namespace, st: Any) -> None:
    if args.json:
        print(json.dumps(st.to_dict(), indent=2), file=sys.stderr)
    else:
        print(stats_line(st), file=sys.stderr, flush=True)
