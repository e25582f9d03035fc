"""``xcosd serve``: run a CloudNode until interrupted.

    xcosd serve --target default-target --bind tcp://0.0.0.0:5555 --metrics-port 9100

The target is any spec :func:`xcosd.models.load_model` understands. CURVE is on
when ``--curve-secret`` is given (with ``--curve-allow DIR`` of device keys, or
``--curve-allow-any``). The options it shares with ``edge``, ``demo`` and ``bench``
live in :mod:`xcosd.commands.options`.

Replicas (docs/NODES.md, "Replicas"):

    xcosd serve --replicas 4 --bind tcp://0.0.0.0:5555 --backend tcp://0.0.0.0:5556
    xcosd serve --join tcp://broker-host:5556 --target default-target   # on another host

``--replicas N`` runs a :class:`~xcosd.nodes.Broker` on ``--bind`` in this process
and N replica processes, each ``xcosd serve --join BACKEND`` with the same target
and limits; one that exits is started again. ``--join`` runs one CloudNode on the
``replica`` transport. ``--backend-curve-secret`` puts CURVE on the broker's back
end (replica keys from ``--backend-curve-allow``; its own replicas get a key made
at start); a replica that joins one gives ``--join-curve-secret`` and
``--join-curve-server-key``.

The allow directory is read again on SIGHUP and whenever it changes
(:mod:`xcosd.commands.allow_reload`): a key file removed ends that device's live
connections and sessions at once, with a typed error to it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any

from ..gc_tuning import many_sessions_gc
from ..policies.tree_policy import DEFAULT_MAX_TREE
from ..transport.fds import raise_fd_limit
from .allow_reload import reloading_allow
from .options import (
    UsageError,
    add_device_args,
    add_link_args,
    add_loop_args,
    add_transport_arg,
    add_verbose,
    check_curve_transport,
    check_device,
    check_model,
    check_model_keywords,
    device_kw,
    endpoint,
    existing_dir,
    existing_file,
    link_from_args,
    method_list,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    slot_count,
)


def _merge_note(merge: dict[str, Any] | None) -> str:
    """The stats line's account of the merge policy (xcosd/nodes/merging.py)."""
    if not merge or merge.get("fixed_cost_s") is None or merge.get("fill_time_s") is None:
        return ""
    return (f"  fixed cost {merge['fixed_cost_s'] * 1e3:.1f} ms  fill time "
            f"{merge['fill_time_s'] * 1e3:.1f} ms  held {merge['holds']} "
            f"(filled {merge['holds_filled']})")


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
                   help="model spec for xcosd.models.load_model (a real model or a .gguf "
                        "runs on llama.cpp with the suffix @llama.cpp)")
    p.add_argument("--bind", default="tcp://127.0.0.1:5555", type=endpoint,
                   help="endpoint to bind")
    add_transport_arg(p)
    add_device_args(p, "the target")
    p.add_argument("--slots", type=slot_count, default=None, metavar="N",
                   help="sessions whose cache a llama.cpp target keeps at once (1..64, "
                        "default 8); past them the least recently used is evicted and its "
                        "whole context evaluated again at its next round. Each slot costs "
                        "--context positions of KV cache, allocated at start")
    p.add_argument("--verify", choices=("auto", "device", "host"), default="auto",
                   help="where each batch is warped and verified: next to the target's rows "
                        "in torch on its device, or in numpy on the host; auto: on the device "
                        "when the target is on an accelerator (see xcosd/accel/)")
    p.add_argument("--max-batch", type=positive_int, default=32, help="sessions per target call")
    p.add_argument("--max-batch-tokens", type=positive_int, default=256,
                   help="rows one target call scores at most")
    p.add_argument("--max-wait-ms", type=nonneg_float, default=2.0,
                   help="how long a batch waits to fill up (not once every open "
                        "session is in it)")
    p.add_argument("--no-merge", action="store_true",
                   help="start queued rounds as soon as the target is free, never "
                        "waiting for the sessions just answered (see xcosd/nodes/merging.py)")
    p.add_argument("--no-stream", action="store_true",
                   help="verify each batch in the worker thread after its call and send "
                        "its verdicts afterwards, instead of verifying on the loop and "
                        "sending each verdict as it is drawn (see xcosd/nodes/scheduler.py)")
    p.add_argument("--max-sessions", type=positive_int, default=1024,
                   help="open sessions at most")
    p.add_argument("--max-queue", type=positive_int, default=4096,
                   help="queued rounds before 'busy'")
    p.add_argument("--max-draft", type=positive_int, default=32, help="longest draft accepted")
    p.add_argument("--max-tree", type=nonneg_int, default=DEFAULT_MAX_TREE,
                   help="most nodes of a draft tree verified (0: chains only; edges asking "
                        "for trees then draft chains)")
    p.add_argument("--max-message-mb", type=positive_float, default=16.0,
                   help="largest message accepted, MiB")
    p.add_argument("--heartbeat", type=positive_float, default=1.0,
                   help="seconds between edge pings")
    p.add_argument("--silence-timeout", "--timeout", dest="timeout", type=positive_float,
                   default=15.0,
                   help="seconds of silence before a device's sessions are freed (the node's "
                        "silence_timeout_s; --timeout is its old name)")
    p.add_argument("--methods", type=method_list, default=None,
                   help="comma-separated methods to serve (default: all)")
    p.add_argument("--curve-secret", default=None, type=existing_file,
                   help="server key file (NAME.key_secret): turns CURVE on")
    p.add_argument("--curve-allow", default=None, type=existing_dir,
                   help="directory of allowed device keys (read again on SIGHUP and when it "
                        "changes: a key removed ends that device's sessions)")
    p.add_argument("--curve-allow-any", action="store_true",
                   help="encrypt without authenticating devices")
    p.add_argument("--metrics-port", type=nonneg_int, default=None,
                   help="serve Prometheus metrics on this port (/metrics)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics server")
    p.add_argument("--stats-every", type=nonneg_float, default=0.0,
                   help="print a stats line every N seconds (0: only at exit)")
    p.add_argument("--drain-timeout", type=nonneg_float, default=30.0,
                   help="on SIGTERM, seconds running generations get to finish before the "
                        "rest are handed off (resumed elsewhere); then the process exits. "
                        "SIGINT, or a second SIGTERM, stops at once")
    g = p.add_argument_group("replicas", "many target replicas behind one endpoint")
    g.add_argument("--replicas", type=nonneg_int, default=None, metavar="N",
                   help="run a broker on --bind and N replica processes behind it (0: the "
                        "broker alone, for replicas that --join)")
    g.add_argument("--backend", type=endpoint, default=None, metavar="ENDPOINT",
                   help="where the broker takes replicas (default tcp://127.0.0.1:0; bind "
                        "tcp://0.0.0.0:PORT so replicas on other hosts can --join)")
    g.add_argument("--join", type=endpoint, default=None, metavar="ENDPOINT",
                   help="serve as one replica of the broker whose back end is ENDPOINT "
                        "(instead of binding --bind)")
    g.add_argument("--replica-timeout", type=positive_float, default=5.0,
                   help="seconds of silence after which the broker forgets a replica")
    g.add_argument("--backend-curve-secret", default=None, type=existing_file, metavar="FILE",
                   help="the broker's back-end key file (NAME.key_secret): CURVE on the back "
                        "end, so only allowed replicas join (its own replicas get a key of "
                        "their own)")
    g.add_argument("--backend-curve-allow", default=None, type=existing_dir, metavar="DIR",
                   help="directory of the replica keys (NAME.key) that may --join")
    g.add_argument("--join-curve-secret", default=None, type=existing_file, metavar="FILE",
                   help="this replica's key file (NAME.key_secret), for a back end with CURVE")
    g.add_argument("--join-curve-server-key", default=None, type=existing_file, metavar="FILE",
                   help="the broker back end's public key file (NAME.key)")
    # a replica the broker process started leaves with it
    g.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    add_loop_args(p)
    add_link_args(p)
    add_verbose(p)
    p.set_defaults(func=run, check=check)


def check(args: argparse.Namespace) -> None:
    if args.replicas is not None and args.join is not None:
        raise UsageError("--replicas runs a broker, --join a replica of one: not both")
    if args.backend is not None and args.replicas is None:
        raise UsageError("--backend is the broker's: it needs --replicas")
    if (args.replicas is not None or args.join is not None) and args.transport != "zmq":
        raise UsageError("replicas work over ZeroMQ: --transport tcp does not apply")
    if args.join is not None and args.curve_secret:
        raise UsageError("--curve-secret belongs on the broker (--replicas), not on a replica")
    if args.backend_curve_secret and args.replicas is None:
        raise UsageError("--backend-curve-secret is the broker's: it needs --replicas")
    if args.backend_curve_allow and not args.backend_curve_secret:
        raise UsageError("--backend-curve-allow needs --backend-curve-secret")
    if args.replicas == 0 and args.backend_curve_secret and not args.backend_curve_allow:
        raise UsageError("--replicas 0 with --backend-curve-secret admits no replica: "
                         "name their keys with --backend-curve-allow")
    if bool(args.join_curve_secret) != bool(args.join_curve_server_key):
        raise UsageError("--join-curve-secret and --join-curve-server-key go together")
    if args.join_curve_secret and args.join is None:
        raise UsageError("--join-curve-secret is a replica's: it needs --join")
    if args.replicas == 0:
        return  # the broker loads no model
    check_model(args.target, "--target")
    check_device(args)
    check_model_keywords(args.target, {"--context": ("context", args.context),
                                       "--slots": ("sequences", args.slots)})
    check_curve_transport(args, bool(args.curve_secret))
    if (args.curve_allow or args.curve_allow_any) and not args.curve_secret:
        raise UsageError("--curve-allow and --curve-allow-any need --curve-secret")


def curve_server(args: argparse.Namespace) -> Any:
    if not args.curve_secret:
        return None
    from ..transport import CurveServer, KeyPair, load_allowlist

    keys = KeyPair.load(args.curve_secret)
    allow = load_allowlist(args.curve_allow) if args.curve_allow else set()
    if not args.curve_allow and not args.curve_allow_any:
        print("warning: --curve-secret without --curve-allow admits no device (give the "
              "directory of their keys, or --curve-allow-any to encrypt without "
              "authenticating them)", file=sys.stderr, flush=True)
    elif args.curve_allow and not allow:
        print(f"warning: the allow directory {args.curve_allow} holds no key yet: no device "
              "is admitted until one is added", file=sys.stderr, flush=True)
    return CurveServer(keys, allow, allow_any=args.curve_allow_any)


def backend_curve_server(args: argparse.Namespace) -> Any:
    """The broker's back-end CURVE settings (``None``: a plain back end)."""
    if not args.backend_curve_secret:
        return None
    from ..transport import CurveServer

    return CurveServer.from_files(args.backend_curve_secret, args.backend_curve_allow or ())


def join_curve_client(args: argparse.Namespace) -> Any:
    """A replica's CURVE settings for its broker's back end (``None``: plain)."""
    if not args.join_curve_secret:
        return None
    from ..transport import CurveClient

    return CurveClient.from_files(args.join_curve_secret, args.join_curve_server_key)


@contextlib.contextmanager
def own_replica_keys(back_curve: Any) -> Iterator[list[str]]:
    """The ``--join-curve-*`` arguments of the replicas this process starts: a key
    pair of their own, made now and admitted by ``back_curve``, in a directory only
    this user can read, removed on exit. Empty for a plain back end."""
    if back_curve is None:
        yield []
        return
    from ..transport import KeyPair

    own = KeyPair.generate()
    back_curve.admit(own.public)
    d = tempfile.mkdtemp(prefix="xcosd-replica-keys-")  # mode 0700
    try:
        _pub, secret = own.save(d, "replica")
        server, _ = KeyPair(back_curve.keys.public).save(d, "backend")
        yield ["--join-curve-secret", str(secret), "--join-curve-server-key", str(server)]
    finally:
        shutil.rmtree(d, ignore_errors=True)


@many_sessions_gc()  # thousands of sessions' objects (xcosd/gc_tuning.py)
def run(args: argparse.Namespace) -> int:
    raise_fd_limit()  # a descriptor per device connection (xcosd.transport.fds)
    # replicas share their supervisor's stderr: Python writes stderr through, so a
    # print's text and its newline are two writes, and two replicas' lines came out
    # spliced into one; buffered to the line, each line is one write (atomic on a
    # pipe up to PIPE_BUF) and stays whole
    if isinstance(sys.stderr, io.TextIOWrapper):
        sys.stderr.reconfigure(line_buffering=True, write_through=False)
    if args.replicas is not None:
        return run_main(_broker(args), args.uvloop)
    return run_main(_serve(args), args.uvloop)


@contextlib.asynccontextmanager
async def _draining() -> AsyncIterator[tuple[asyncio.Event, asyncio.Event]]:
    """``(drain, stop)``: SIGTERM sets ``drain`` (a balancer's or an orchestrator's
    "leave now, gracefully"); SIGINT, or SIGTERM once ``drain`` is set, sets
    ``stop`` (leave at once)."""
    drain, stop = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def term() -> None:
        (stop if drain.is_set() else drain).set()

    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, term)
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGINT, stop.set)
    yield drain, stop


@contextlib.asynccontextmanager
async def _stopping(parent_pid: int | None = None) -> AsyncIterator[asyncio.Event]:
    """An event set on SIGINT / SIGTERM, or once ``parent_pid`` is no longer this
    process's parent (the broker process that started this replica is gone)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    async def watch(pid: int) -> None:
        while os.getppid() == pid:
            await asyncio.sleep(1.0)
        print("the broker process is gone; stopping", file=sys.stderr, flush=True)
        stop.set()

    task = None if parent_pid is None else loop.create_task(watch(parent_pid))
    try:
        yield stop
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _serve(args: argparse.Namespace) -> int:
    from ..models import load_model

    print(f"loading {args.target} ...", file=sys.stderr, flush=True)
    target = await asyncio.to_thread(load_model, args.target, **target_kw(args))
    methods = tuple(args.methods) if args.methods else None
    replica = args.join is not None
    if replica:
        # behind the broker, SIGTERM stops at once: the replica says BYE and the broker
        # moves its edges, which resume on another replica
        return await _serve_node(args, target, methods, replica)
    async with _draining() as (drain, stop):
        return await _serve_node(args, target, methods, replica, drain, stop)


def target_kw(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`~xcosd.models.load_model` keywords of the target's options."""
    kw = device_kw(args)
    if args.slots is not None:
        kw["sequences"] = args.slots
    return kw


def context_note(model: Any) -> str:
    """What the serving line says of a model's context: the tokens a session holds
    and, on llama.cpp, the sessions whose cache is kept."""
    from ..models.base import context_tokens

    n = context_tokens(model)
    if not n:
        return ""
    slots = getattr(model, "sequences", None)
    return f", sessions of up to {n} tokens" + (
        f" ({slots} cached at once)" if isinstance(slots, int) else "")


async def _serve_node(args: argparse.Namespace, target: Any, methods: tuple[str, ...] | None,
                      replica: bool, drain: asyncio.Event | None = None,
                      stop_now: asyncio.Event | None = None) -> int:
    """Serve until stopped; with ``drain``, a set ``drain`` drains the node first
    (xcosd/nodes/drain.py) unless ``stop_now`` is set meanwhile."""
    async with contextlib.AsyncExitStack() as stack:
        if stop_now is None:
            stop = await stack.enter_async_context(_stopping(args.parent_pid))
        else:
            stop = stop_now
        stats = await _run_node(args, target, methods, replica, stop, drain)
    stats.pop("bytes", None)
    print(json.dumps(stats, indent=2, default=str), file=sys.stderr)
    return 0


async def _run_node(args: argparse.Namespace, target: Any, methods: tuple[str, ...] | None,
                    replica: bool, stop: asyncio.Event,
                    drain: asyncio.Event | None) -> dict[str, Any]:
    """One CloudNode, served until ``stop`` (or ``drain``, then drained); its stats."""
    from ..nodes import CloudNode

    curve = None if replica else curve_server(args)
    async with reloading_allow(curve, args.curve_allow), CloudNode(
            target=target, bind=args.join if replica else args.bind,
            transport="replica" if replica else args.transport, link=link_from_args(args),
            curve=join_curve_client(args) if replica else curve,
            max_batch=args.max_batch,
            max_batch_tokens=args.max_batch_tokens, merge_batches=not args.no_merge,
            stream_verdicts=not args.no_stream,
            max_wait_s=args.max_wait_ms / 1000, max_sessions=args.max_sessions,
            max_queue=args.max_queue, max_draft=args.max_draft, max_tree=args.max_tree,
            max_message_bytes=int(args.max_message_mb * (1 << 20)),
            heartbeat_s=args.heartbeat, silence_timeout_s=args.timeout, methods=methods,
            metrics_port=args.metrics_port, metrics_host=args.metrics_host,
            drain_timeout_s=args.drain_timeout,
            verify_on_device={"auto": None, "device": True, "host": False}[args.verify]
    ) as cloud:
        where = f"as a replica of the broker at {cloud.endpoint}" if replica else \
            f"on {cloud.endpoint}"
        print(f"serving {target.name} {where}{context_note(target)}"
              + (f", metrics on {cloud.metrics_endpoint}" if cloud.metrics_endpoint else ""),
              file=sys.stderr, flush=True)
        waits = [asyncio.ensure_future(e.wait()) for e in (stop, drain) if e is not None]
        try:
            while not any(w.done() for w in waits):
                every = args.stats_every or 3600.0
                await asyncio.wait(waits, timeout=every, return_when=asyncio.FIRST_COMPLETED)
                if any(w.done() for w in waits) or not args.stats_every:
                    continue
                s = cloud.stats()
                print(f"sessions {s['sessions_active']}  rounds {s['rounds']}  "
                      f"acceptance {s['acceptance_rate']:.3f}  "
                      f"mean batch {s['scheduler'].get('mean_batch_size', 0):.1f}"
                      f"{_merge_note(s['scheduler'].get('merge'))}",
                      file=sys.stderr, flush=True)
        finally:
            for w in waits:
                w.cancel()
        if drain is not None and drain.is_set() and not stop.is_set():
            print(f"draining: {cloud.stats()['sessions_active']} sessions have "
                  f"{args.drain_timeout:g} s to finish", file=sys.stderr, flush=True)
            draining = asyncio.ensure_future(cloud.drain())
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([draining, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if draining.done():
                print("drained: " + json.dumps(draining.result()), file=sys.stderr, flush=True)
            else:  # stopped at once: what was left ends with the node
                draining.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await draining
                print("stopped before the drain ended", file=sys.stderr, flush=True)
        return cloud.stats()


# ------------------------------------------------------------------ replicas

#: a replica that exits within this long of starting is restarted after a longer pause
_QUICK_EXIT_S = 10.0
#: the longest pause before a replica that keeps exiting is started again
_MAX_RESTART_DELAY_S = 30.0
#: how long stopped replicas get to leave before they are killed
_STOP_TIMEOUT_S = 10.0
#: how often the broker process looks at its replicas (and prints a change)
_WATCH_S = 0.1


def replica_argv(args: argparse.Namespace, backend: str, index: int,
                 curve: Sequence[str] = ()) -> list[str]:
    """The command line of replica ``index`` (from 0): ``xcosd serve --join`` with
    this command's target, batching, limits, liveness, methods and link, and
    ``curve`` (:func:`own_replica_keys`). Its metrics port is ``--metrics-port`` +
    ``index`` (0: each picks a free one)."""
    argv = [sys.executable, "-m", "xcosd", "serve", "--join", backend,
            "--target", args.target, "--max-batch", str(args.max_batch),
            "--max-batch-tokens", str(args.max_batch_tokens),
            "--max-wait-ms", repr(args.max_wait_ms), "--max-sessions", str(args.max_sessions),
            "--max-queue", str(args.max_queue), "--max-draft", str(args.max_draft),
            "--max-tree", str(args.max_tree),
            "--max-message-mb", repr(args.max_message_mb), "--heartbeat", repr(args.heartbeat),
            "--silence-timeout", repr(args.timeout), "--parent-pid", str(os.getpid()), *curve]
    if args.methods:
        argv += ["--methods", ",".join(args.methods)]
    if args.device is not None:
        argv += ["--device", args.device]
    if args.dtype is not None:
        argv += ["--dtype", args.dtype]
    for flag, value in (("--threads", args.threads), ("--context", args.context),
                        ("--slots", args.slots)):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--verify", args.verify]
    if args.no_merge:
        argv.append("--no-merge")
    if args.no_stream:
        argv.append("--no-stream")
    if args.metrics_port is not None:
        port = args.metrics_port + index if args.metrics_port else 0
        argv += ["--metrics-port", str(port), "--metrics-host", args.metrics_host]
    if args.stats_every:
        argv += ["--stats-every", repr(args.stats_every)]
    if args.link_mbps is not None:
        argv += ["--link-mbps", repr(args.link_mbps)]
    if args.link_rtt_ms:
        argv += ["--link-rtt-ms", repr(args.link_rtt_ms)]
    if args.uvloop:
        argv.append("--uvloop")
    verbose = getattr(args, "verbose", 0) + getattr(args, "verbose_sub", 0)
    if verbose:
        argv.append("-" + "v" * min(verbose, 2))
    return argv


class Replicas:
    """N replica processes, each started again when it exits (after a pause that
    grows while it keeps exiting quickly), stopped with SIGTERM and, past
    :data:`_STOP_TIMEOUT_S`, killed. ``argv(i)`` is replica ``i``'s command line;
    once ``stopping`` is set (a Ctrl-C reaches the replicas too) none is restarted."""

    def __init__(self, n: int, argv: Callable[[int], list[str]],
                 stopping: asyncio.Event | None = None) -> None:
        self.n = n
        self.argv = argv
        self.procs: list[asyncio.subprocess.Process | None] = [None] * n
        self.restarts = 0
        self._stopping = stopping if stopping is not None else asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._keep(i), name=f"xcosd-replica-{i}")
                       for i in range(self.n)]

    async def _keep(self, i: int) -> None:
        delay = 0.5
        while not self._stopping.is_set():
            t0 = time.monotonic()
            try:
                p = await asyncio.create_subprocess_exec(*self.argv(i))
            except OSError as e:
                print(f"replica {i} could not start: {e}", file=sys.stderr, flush=True)
                rc: int | str = "none"
            else:
                self.procs[i] = p
                print(f"replica {i} started (pid {p.pid})", file=sys.stderr, flush=True)
                rc = await p.wait()
            if self._stopping.is_set():
                return
            quick = time.monotonic() - t0 < _QUICK_EXIT_S
            delay = min(_MAX_RESTART_DELAY_S, delay * 2) if quick else 1.0
            print(f"replica {i} exited with status {rc}; starting it again in {delay:.0f}s",
                  file=sys.stderr, flush=True)
            self.restarts += 1
            await asyncio.sleep(delay)

    async def stop(self) -> None:
        self._stopping.set()
        live = [p for p in self.procs if p is not None and p.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        if live:
            _done, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live],
                                                timeout=_STOP_TIMEOUT_S)
            for p in live:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            if pending:
                await asyncio.wait(pending, timeout=_STOP_TIMEOUT_S)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _broker(args: argparse.Namespace) -> int:
    from ..nodes import Broker

    back_curve = backend_curve_server(args)
    curve = curve_server(args)
    with own_replica_keys(back_curve) as keys:
        async with _stopping() as stop, reloading_allow(curve, args.curve_allow), Broker(
                front=args.bind, back=args.backend or "tcp://127.0.0.1:0",
                replica_timeout_s=args.replica_timeout,
                edge_timeout_s=max(60.0, 2 * args.timeout),
                max_message_bytes=int(args.max_message_mb * (1 << 20)),
                curve=curve, back_curve=back_curve) as broker:
            print(f"broker: edges connect to {broker.endpoint}, replicas join at "
                  f"{broker.back_endpoint}; starting {args.replicas} replicas of {args.target}",
                  file=sys.stderr, flush=True)
            replicas = Replicas(args.replicas,
                                lambda i: replica_argv(args, broker.back_endpoint, i, keys), stop)
            replicas.start()
            live = 0
            next_stats = time.monotonic() + args.stats_every
            try:
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), _WATCH_S)
                    s = broker.stats()
                    if s["replicas_live"] != live:
                        # one line per change: what an operator (or a script) waits for
                        live = s["replicas_live"]
                        print(f"replicas live: {live} (joined {s['replicas_joined']}, lost "
                              f"{sum(s['replicas_lost'].values())})", file=sys.stderr, flush=True)
                    if args.stats_every and time.monotonic() >= next_stats:
                        next_stats += args.stats_every
                        print(f"replicas {live}  edges {s['edges']}  to replicas "
                              f"{s['to_replicas']}  to edges {s['to_edges']}  dropped "
                              f"{s['dropped_replica_full'] + s['dropped_edge_full']}",
                              file=sys.stderr, flush=True)
            finally:
                await replicas.stop()
            stats = broker.stats()
    stats["replica_restarts"] = replicas.restarts
    print(json.dumps(stats, indent=2, default=str), file=sys.stderr)
    return 0
