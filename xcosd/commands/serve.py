"""``xcosd serve``: run a CloudNode until interrupted.

    xcosd serve --target default-target --bind tcp://0.0.0.0:5555 --metrics-port 9100

The target is any spec :func:`xcosd.models.load_model` understands. CURVE is on
when ``--curve-secret`` is given (with ``--curve-allow DIR`` of device keys, or
``--curve-allow-any``). The options it shares with ``edge``, ``demo`` and ``bench``
live in :mod:`xcosd.commands.options`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from .options import (
    UsageError,
    add_link_args,
    add_loop_args,
    add_transport_arg,
    add_verbose,
    check_curve_transport,
    check_model,
    endpoint,
    existing_file,
    link_from_args,
    method_list,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
)


def run_main(coro: Coroutine[Any, Any, int], use_uvloop: bool = False) -> int:
    """Run the command's coroutine on asyncio, or on uvloop when asked (and installed)."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            print("xcosd: uvloop is not installed; using asyncio", file=sys.stderr)
        else:
            return int(uvloop.run(coro))
    return int(asyncio.run(coro))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run a cloud node (the target model)",
                       description="Serve a target model to edge devices over ZeroMQ or TCP.")
    p.add_argument("--target", default="default-target",
                   help="model spec for xcosd.models.load_model")
    p.add_argument("--bind", default="tcp://127.0.0.1:5555", type=endpoint,
                   help="endpoint to bind")
    add_transport_arg(p)
    p.add_argument("--max-batch", type=positive_int, default=32, help="sessions per target call")
    p.add_argument("--max-wait-ms", type=nonneg_float, default=2.0,
                   help="how long a batch waits to fill up")
    p.add_argument("--max-sessions", type=positive_int, default=1024,
                   help="open sessions at most")
    p.add_argument("--max-queue", type=positive_int, default=4096,
                   help="queued rounds before 'busy'")
    p.add_argument("--max-draft", type=positive_int, default=32, help="longest draft accepted")
    p.add_argument("--max-message-mb", type=positive_float, default=16.0,
                   help="largest message accepted, MiB")
    p.add_argument("--heartbeat", type=positive_float, default=1.0,
                   help="seconds between edge pings")
    p.add_argument("--timeout", type=positive_float, default=15.0,
                   help="seconds of silence before a device's sessions are freed")
    p.add_argument("--methods", type=method_list, default=None,
                   help="comma-separated methods to serve (default: all)")
    p.add_argument("--curve-secret", default=None, type=existing_file,
                   help="server key file (NAME.key_secret): turns CURVE on")
    p.add_argument("--curve-allow", default=None, help="directory of allowed device keys")
    p.add_argument("--curve-allow-any", action="store_true",
                   help="encrypt without authenticating devices")
    p.add_argument("--metrics-port", type=nonneg_int, default=None,
                   help="serve Prometheus metrics on this port (/metrics)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics server")
    p.add_argument("--stats-every", type=nonneg_float, default=0.0,
                   help="print a stats line every N seconds (0: only at exit)")
    add_loop_args(p)
    add_link_args(p)
    add_verbose(p)
    p.set_defaults(func=run, check=check)


def check(args: argparse.Namespace) -> None:
    check_model(args.target, "--target")
    check_curve_transport(args, bool(args.curve_secret))
    if (args.curve_allow or args.curve_allow_any) and not args.curve_secret:
        raise UsageError("--curve-allow and --curve-allow-any need --curve-secret")
    if args.curve_allow and not os.path.isdir(args.curve_allow):
        raise UsageError(f"--curve-allow: directory {args.curve_allow!r} does not exist")


def curve_server(args: argparse.Namespace) -> Any:
    if not args.curve_secret:
        return None
    from ..transport import CurveServer, KeyPair, load_allowlist

    keys = KeyPair.load(args.curve_secret)
    allow = load_allowlist(args.curve_allow) if args.curve_allow else set()
    return CurveServer(keys, allow, allow_any=args.curve_allow_any)


def run(args: argparse.Namespace) -> int:
    return run_main(_serve(args), args.uvloop)


async def _serve(args: argparse.Namespace) -> int:
    from ..models import load_model
    from ..nodes import CloudNode

    print(f"loading {args.target} ...", file=sys.stderr, flush=True)
    target = await asyncio.to_thread(load_model, args.target)
    methods = tuple(args.methods) if args.methods else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with CloudNode(
            target=target, bind=args.bind, transport=args.transport, link=link_from_args(args),
            curve=curve_server(args), max_batch=args.max_batch,
            max_wait_s=args.max_wait_ms / 1000, max_sessions=args.max_sessions,
            max_queue=args.max_queue, max_draft=args.max_draft,
            max_message_bytes=int(args.max_message_mb * (1 << 20)),
            heartbeat_s=args.heartbeat, timeout_s=args.timeout, methods=methods,
            metrics_port=args.metrics_port, metrics_host=args.metrics_host) as cloud:
        print(f"serving {target.name} on {cloud.endpoint}"
              + (f", metrics on {cloud.metrics_endpoint}" if cloud.metrics_endpoint else ""),
              file=sys.stderr, flush=True)
        while not stop.is_set():
            every = args.stats_every or 3600.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
            if args.stats_every and not stop.is_set():
                s = cloud.stats()
                print(f"sessions {s['sessions_active']}  rounds {s['rounds']}  "
                      f"acceptance {s['acceptance_rate']:.3f}  "
                      f"mean batch {s['scheduler'].get('mean_batch_size', 0):.1f}",
                      file=sys.stderr, flush=True)
        stats = cloud.stats()
    stats.pop("bytes", None)
    print(json.dumps(stats, indent=2, default=str), file=sys.stderr)
    return 0
