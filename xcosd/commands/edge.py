"""``xcosd edge``: run an EdgeNode against a cloud and generate, or serve the
OpenAI-compatible HTTP API.

    xcosd edge --connect tcp://127.0.0.1:5555 --method xcosd-e "Return a new list"
    xcosd edge serve --connect tcp://127.0.0.1:5555 --http 127.0.0.1:8000

Text streams to stdout as it is committed; a stats line per generation goes to
stderr. ``--json`` prints instead one JSON object per prompt on stdout (text, token
ids, finish reason, full stats). Several prompts (arguments, or ``--prompts-file``
with one per line) run concurrently with ``--concurrent``.

``--http HOST:PORT`` (``serve`` before the options reads better and is allowed)
serves ``xcosd.api``'s OpenAI-compatible API instead: every HTTP request is a
generation on the node's one cloud connection, with the command's generation
options as each request's defaults, until SIGINT or SIGTERM. A server outlives its
cloud's absences: it listens as soon as its draft model is loaded, connects in the
background (for as long as it takes, unless ``--connect-timeout`` is given),
answers ``/health`` with 503 ``connecting`` meanwhile and holds each request up to
``--cloud-wait`` seconds before a 503; the same after a lost connection, until it
connects again.

With ``--http`` the API is behind ``--api-key`` (or ``--api-key-file``, or the
``XCOSD_API_KEY`` environment variable) and a request picks only the methods,
codecs and sizes ``--allow-methods`` and its friends allow (docs/API.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from .api_access import (
    add_api_access_args,
    api_keys,
    check_api_access,
    request_policy,
    warn_if_open,
)
from .http_limits import add_http_limit_args, connection_limits
from .options import (
    UsageError,
    add_curve_client_args,
    add_device_args,
    add_generation_args,
    add_link_args,
    add_loop_args,
    add_transport_arg,
    add_verbose,
    check_curve_client,
    check_device,
    check_model,
    check_model_keywords,
    device_kw,
    endpoints,
    existing_file,
    generation_config,
    host_port,
    link_from_args,
    nonneg_float,
    positive_float,
    positive_int,
    probe,
)
from .serve import run_main

#: the one-shot command's ``--connect-timeout`` when none is given (a server's is none)
CONNECT_TIMEOUT_S = 30.0
#: ``--cloud-wait``: long enough for a cloud restart on the embedded pair (its model
#: loads from the cache in about a second), short enough that a client is told
CLOUD_WAIT_S = 10.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("edge", help="run an edge node (the draft model) and generate",
                       description="Draft on this device, verify in the cloud.")
    p.add_argument("prompts", nargs="*",
                   help="prompt text (default: --prompts-file, else stdin when piped)")
    p.add_argument("--prompts-file", default=None, type=existing_file,
                   help="one prompt per line")
    p.add_argument("--draft", default="default-draft",
                   help="model spec for xcosd.models.load_model (a real model or a .gguf "
                        "runs on llama.cpp with the suffix @llama.cpp)")
    p.add_argument("--connect", default="tcp://127.0.0.1:5555", type=endpoints,
                   help="the cloud's endpoint, or several comma-separated (tried in turn; a "
                        "host name with several addresses counts as several)")
    add_transport_arg(p)
    add_device_args(p, "the draft", "draft-")
    add_generation_args(p, method_options=True, stop=True)
    p.add_argument("--http", default=None, type=host_port, metavar="HOST:PORT",
                   help="serve the OpenAI-compatible API on HOST:PORT instead of generating "
                        "(port 0: any free port; the address is printed)")
    p.add_argument("--model-name", default=None,
                   help="with --http: the model id clients name (default: the cloud's target)")
    p.add_argument("--max-in-flight", type=positive_int, default=64,
                   help="with --http: generations at once; more get 429 (default 64)")
    p.add_argument("--max-tokens-limit", type=positive_int, default=4096,
                   help="with --http: the most tokens one request may ask for")
    p.add_argument("--open-hold-ms", type=nonneg_float, default=None,
                   help="with --http: the longest a request's first round waits for the "
                        "requests that arrived beside it, so they share the cloud's first "
                        "call; never longer than the cloud's least recent call time "
                        "(default: EdgeNode's open_hold_s, 25 ms; 0: never wait)")
    add_http_limit_args(p)
    add_api_access_args(p)
    p.add_argument("--concurrent", action="store_true", help="run all prompts at once")
    p.add_argument("--no-stream", action="store_true", help="print each text when done")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt on stdout (prompt, text, token ids, "
                        "stats) instead of the text")
    add_curve_client_args(p, "device key file (NAME.key_secret): turns CURVE on")
    p.add_argument("--silence-timeout", "--timeout", dest="timeout", type=positive_float,
                   default=15.0,
                   help="seconds of silence before the cloud counts as lost (the edge then "
                        "connects again; the node's silence_timeout_s, not a generation's "
                        "deadline; --timeout is its old name)")
    p.add_argument("--connect-timeout", type=positive_float, default=None,
                   help="seconds to look for the cloud before giving up with an error: for its "
                        "address to accept a connection, then for its handshake, and after a "
                        "lost connection for a new one (default 30; with --http no limit: the "
                        "API answers 503 meanwhile)")
    p.add_argument("--cloud-wait", type=nonneg_float, default=CLOUD_WAIT_S,
                   help="with --http: the longest a request waits for a cloud that is not "
                        "connected (starting, lost) before it gets 503")
    add_loop_args(p)
    add_link_args(p)
    add_verbose(p)
    p.set_defaults(func=run, check=check)


def check(args: argparse.Namespace) -> None:
    if args.prompts[:1] == ["serve"]:  # `xcosd edge serve --http ...`
        if args.http is None:
            raise UsageError("edge serve needs --http HOST:PORT")
        args.prompts = args.prompts[1:]
    if args.http is not None and (args.prompts or args.prompts_file):
        raise UsageError("--http serves requests: give no prompts")
    generation_config(args)
    check_api_access(args)
    check_curve_client(args)
    check_model(args.draft, "--draft")
    check_device(args, "draft-")
    check_model_keywords(args.draft, {"--draft-context": ("context", args.draft_context)})


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [ln.rstrip("\n") for ln in f if ln.strip()]
    if not prompts and not sys.stdin.isatty():
        prompts = [ln.rstrip("\n") for ln in sys.stdin if ln.strip()]
    return prompts or [""]


def run(args: argparse.Namespace) -> int:
    return run_main(_serve_http(args) if args.http is not None else _edge(args), args.uvloop)


def stats_line(st: Any) -> str:
    return (f"[{st.method}/{st.codec}] {st.tokens} tokens, {st.rounds} rounds, acceptance "
            f"{st.acceptance_rate:.2f}, mean length {st.mean_acceptance_length:.2f}, "
            f"up {st.uplink_bytes} B, down {st.downlink_bytes} B, "
            f"{st.tokens_per_s:.1f} tok/s wall, {st.finish_reason}")


async def _node(args: argparse.Namespace) -> Any:
    """The EdgeNode the options describe (not started)."""
    from ..models import load_model
    from ..nodes import EdgeNode

    cfg = generation_config(args)
    serving = args.http is not None
    connect_timeout = (args.connect_timeout if args.connect_timeout is not None or serving
                       else CONNECT_TIMEOUT_S)
    if not serving:
        # a wrong or dead address fails now, with its reason, not after loading the
        # model (a server waits for its cloud instead, answering 503 meanwhile)
        await asyncio.to_thread(probe, args.connect, connect_timeout)
    curve = None
    if args.curve_secret:
        from ..transport import CurveClient

        curve = CurveClient.from_files(args.curve_secret, args.curve_server_key)
    print(f"loading {args.draft} ...", file=sys.stderr, flush=True)
    draft = await asyncio.to_thread(load_model, args.draft, **device_kw(args, "draft-"))
    return EdgeNode(draft=draft, connect=args.connect, transport=args.transport,
                    config=cfg, link=link_from_args(args), curve=curve,
                    silence_timeout_s=args.timeout, connect_timeout_s=connect_timeout,
                    cloud_wait_s=args.cloud_wait if serving else None,
                    **({} if args.open_hold_ms is None
                       else {"open_hold_s": args.open_hold_ms / 1e3}))


async def _serve_http(args: argparse.Namespace) -> int:
    import signal

    from ..api import OpenAIApp, RequestLimits
    from ..http import HttpServer

    host, port = args.http
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    edge = await _node(args)
    try:
        await edge.start(wait=False)  # the cloud is looked for in the background
        limits = RequestLimits(max_tokens=args.max_tokens_limit,
                               default_max_tokens=min(args.max_new_tokens or 256,
                                                      args.max_tokens_limit))
        keys = api_keys(args)
        api = OpenAIApp(edge, model=args.model_name, limits=limits,
                        max_in_flight=args.max_in_flight, api_keys=keys,
                        open_metrics=args.open_metrics, policy=request_policy(args))
        warn_if_open(args, keys)
        async with HttpServer(api, host, port, limits=connection_limits(args),
                              name="xcosd-edge-http") as http:
            name = repr(args.model_name) if args.model_name else "the cloud's target"
            print(f"serving {name} on {http.url}/v1 (cloud {args.connect})",
                  file=sys.stderr, flush=True)
            watch = asyncio.ensure_future(report_reach(edge))
            stopped = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({watch, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (watch, stopped):
                    t.cancel()
            if watch.done() and not watch.cancelled() and watch.exception() is not None:
                raise watch.exception()  # type: ignore[misc]  # it gave up on the cloud
    finally:
        await edge.close()
    return 0


async def report_reach(edge: Any) -> None:
    """Print each change of ``edge``'s hold on its cloud (one line on stderr);
    raise why, once it gives up (past ``--connect-timeout``, or an answer retrying
    cannot change: another protocol version, another vocabulary)."""
    from ..errors import TransportError
    from ..nodes.reach import ReachPhase

    while True:
        reach = edge.reach
        if reach.phase is ReachPhase.CONNECTED:
            print(f"connected to the cloud at {edge.address} (target {edge.target_name!r}, "
                  f"reconnects {reach.reconnects})", file=sys.stderr, flush=True)
        elif reach.phase is ReachPhase.CONNECTING:
            lost = f"lost the cloud ({reach.error}); " if reach.losses else ""
            print(f"{lost}looking for the cloud at {edge.endpoint}; /health answers 503 until "
                  "it is connected", file=sys.stderr, flush=True)
        elif reach.phase is ReachPhase.UNREACHABLE:
            raise edge.failure or TransportError(
                f"cannot reach the cloud at {edge.endpoint}: {reach.error}", code="connect")
        else:
            return
        await edge.reach_changed()


async def _edge(args: argparse.Namespace) -> int:
    prompts = _prompts(args)
    async with await _node(args) as edge:
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
