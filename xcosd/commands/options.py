"""What the ``xcosd`` subcommands share: the parser class, the option groups, the checks.

Every option that several commands take (generation settings, the link emulation,
CURVE, the event loop) is defined here once, so its name, default, help and
validation cannot drift between ``serve``, ``edge``, ``demo`` and ``bench``.

Mistakes are caught before any model loads: values by the ``type=`` of each option
(argparse calls them while parsing), combinations by each command's ``check``
(``set_defaults(check=...)``, run by :func:`xcosd.cli.main` right after parsing).
Either way the user gets one line, ``xcosd: error: ...``, and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import re
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

# --------------------------------------------------------------------------- parser


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except the uninformative ``None`` / ``False``
    of optional values and flags."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class UsageError(ValueError):
    """A mistake on the command line found after parsing (a combination of options)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with defaults in ``--help`` and one-line errors.

    argparse's own ``error`` prints the usage and ``PROG SUB: error: ...``; a user
    who mistyped one option wants the one line that says what is wrong, the same
    for every subcommand: ``xcosd: error: ...`` on stderr, exit status 2.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        fail(message)


def fail(message: str) -> NoReturn:
    """Print the one error line and exit with status 2."""
    print(f"xcosd: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def add_verbose(p: argparse.ArgumentParser) -> None:
    """``-v`` after the subcommand too (``xcosd edge -v ...``); cli.main adds the two
    counts. A separate dest: a subcommand's default would overwrite the top level's."""
    p.add_argument("-v", "--verbose", dest="verbose_sub", action="count",
                   default=argparse.SUPPRESS, help="more logging (-vv: debug)")


# --------------------------------------------------------------------------- types


def _number(kind: Callable[[str], Any], what: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    def parse(s: str) -> Any:
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if (isinstance(v, float) and not math.isfinite(v)) or not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _number(int, "an integer >= 1", lambda v: v >= 1)
nonneg_int = _number(int, "an integer >= 0", lambda v: v >= 0)
positive_float = _number(float, "a number > 0", lambda v: v > 0)
nonneg_float = _number(float, "a number >= 0", lambda v: v >= 0)
#: ``--slots``: llama.cpp's sequences of one context (``LLAMA_MAX_SEQ``)
slot_count = _number(int, "an integer in 1..64", lambda v: 1 <= v <= 64)


def draft_cost(s: str) -> float | str:
    """``--draft-cost``: a number >= 0, or ``auto``."""
    return "auto" if s == "auto" else nonneg_float(s)
probability = _number(float, "a number in (0, 1]", lambda v: 0 < v <= 1)
unit_interval = _number(float, "a number in [0, 1]", lambda v: 0 <= v <= 1)


def rate_or_inf(s: str) -> float:
    """``--request-rate``: a number > 0, or ``inf`` (no arrival process: closed loop)."""
    if s.strip().lower() in ("inf", "infinity"):
        return math.inf
    v: float = positive_float(s)
    return v


def percentile_list(s: str) -> list[float]:
    """``--percentiles``: a comma-separated list of numbers in [0, 100]."""
    try:
        qs = [float(x) for x in split(s)]
    except ValueError:
        qs = []
    if not qs or not all(math.isfinite(q) and 0 <= q <= 100 for q in qs):
        raise argparse.ArgumentTypeError(f"expected percentiles in [0, 100] like 50,90,99, got {s!r}")
    return qs


def slo(s: str) -> tuple[str, float]:
    """One ``--goodput`` objective: ``KEY:MS`` (``ttft:500``, ``tpot:50``, ``e2e:4000``)."""
    from ..bench.load.config import SLO_METRICS

    key, _, ms = s.partition(":")
    try:
        v = float(ms)
    except ValueError:
        v = math.nan
    if key not in SLO_METRICS or not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(
            f"expected KEY:MS with KEY one of {', '.join(SLO_METRICS)} and MS > 0, got {s!r}")
    return key, v


def method_names() -> list[str]:
    from ..methods import METHODS

    return list(METHODS)


def codec_name(s: str) -> str:
    """``--codec``: any name :func:`xcosd.codecs.get_codec` accepts."""
    from ..codecs import get_codec
    from ..errors import CodecError

    try:
        get_codec(s)
    except CodecError as e:
        raise argparse.ArgumentTypeError(e.message) from None
    return s


def method_list(s: str) -> list[str]:
    """A comma-separated list of method names, each checked."""
    names = [x.strip() for x in s.split(",") if x.strip()]
    known = method_names()
    bad = [x for x in names if x not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown method {', '.join(map(repr, bad)) or repr(s)}; known: {', '.join(known)}")
    return names


def host_port(s: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) of an HTTP server; port 0: any free one."""
    host, sep, port = s.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {s!r}")
    return host, int(port)


def endpoint(s: str) -> str:
    """``tcp://HOST:PORT`` (either transport) or ``ipc://PATH`` (ZeroMQ); checked here
    because a malformed endpoint otherwise shows up as a connection that never comes."""
    if s.startswith("ipc://") and len(s) > len("ipc://"):
        return s
    from ..errors import TransportError
    from ..transport.tcp import parse_tcp_endpoint

    try:
        _, port = parse_tcp_endpoint(s)
    except TransportError as e:
        raise argparse.ArgumentTypeError(f"bad endpoint: {e.message}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"bad endpoint {s!r}: port out of range")
    return s


def endpoints(s: str) -> str:
    """One endpoint or several, comma-separated (an edge tries them in turn:
    xcosd/transport/addresses.py), each checked as :func:`endpoint` checks one."""
    parts = [p.strip() for p in s.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"bad endpoint {s!r}: no address")
    for part in parts:
        endpoint(part)
    return ",".join(parts)


def existing_file(s: str) -> str:
    if not Path(s).is_file():
        raise argparse.ArgumentTypeError(f"file {s!r} does not exist")
    return s


def existing_dir(s: str) -> str:
    if not Path(s).is_dir():
        raise argparse.ArgumentTypeError(f"directory {s!r} does not exist")
    return s


# --------------------------------------------------------------------------- groups


def add_generation_args(p: argparse.ArgumentParser, *, method: bool = True,
                        method_options: bool = False, max_new_tokens: int = 64,
                        seed: int | None = None, seed_help: str | None = None,
                        stop: bool = False) -> None:
    """The settings of :class:`xcosd.config.GenerationConfig` (transformers' names).

    ``seed_help``: for a command whose ``--seed`` is not one generation's seed
    (``bench load`` derives every generation's seed from it)."""
    from ..config import GenerationConfig

    d = GenerationConfig()
    if method:
        p.add_argument("--method", default=d.method, choices=method_names(), metavar="METHOD",
                       help="resampling method: %(choices)s")
    p.add_argument("--codec", default=d.codec, type=codec_name,
                   help="probability codec: f32, f16, bf16, q8, sparse, topk:K, each "
                        "optionally +zstd")
    p.add_argument("--draft-len", type=nonneg_int, default=d.draft_len,
                   help="tokens the first round drafts (every round's with "
                        "--fixed-draft-len)")
    p.add_argument("--fixed-draft-len", action="store_true",
                   help="draft --draft-len tokens every round (default: the length that "
                        "maximises tokens per second at the acceptance seen so far)")
    p.add_argument("--draft-cost", type=draft_cost, default=d.draft_cost,
                   help="a draft step's time over a round's fixed time (round trip and "
                        "verification), for the adaptive length; auto: measure it "
                        "(default: auto, or 0.05 with --seed)")
    p.add_argument("--draft-confidence", type=unit_interval, default=d.draft_confidence,
                   help="stop a round's drafting after a token the draft gave a probability "
                        "below this (0: never)")
    p.add_argument("--max-draft-len", type=positive_int, default=d.max_draft_len,
                   help="the adaptive draft length's upper bound")
    p.add_argument("--tree", default=d.tree, metavar="SHAPE",
                   help="draft a tree of candidates a round: 3x2 (three, each with two), "
                        "spine:4x2x2, chain:4, or auto (the tree policy picks each round's "
                        "shape, chains included); default: chains by the adaptive length")
    p.add_argument("--tree-row-codec", type=codec_name, default=d.tree_row_codec,
                   metavar="CODEC", help="how a tree's draft rows cross (default head:64: "
                                         "64 entries and a flat tail; sparse sends a "
                                         "row whole; exact either way)")
    p.add_argument("--tree-iid", action="store_true",
                   help="draw a node's children i.i.d. (default: without replacement)")
    p.add_argument("--no-speculate", action="store_true",
                   help="do not draft while a verdict is in flight (default: speculate "
                        "unless --seed is given)")
    p.add_argument("--max-new-tokens", type=nonneg_int, default=max_new_tokens,
                   help="target tokens per generation")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not end at the target's end tokens: run to --max-new-tokens "
                        "(outputs of a fixed length, as vLLM's --ignore-eos)")
    p.add_argument("--temperature", type=nonneg_float, default=d.temperature,
                   help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=nonneg_int, default=d.top_k, help="top-k (0: off)")
    p.add_argument("--top-p", type=probability, default=d.top_p, help="top-p (1: off)")
    p.add_argument("--greedy", action="store_true",
                   help="greedy decoding (transformers' do_sample=False)")
    p.add_argument("--seed", type=nonneg_int, default=seed,
                   help=seed_help or ("seed (default: fresh entropy)" if seed is None else "seed"))
    if stop:
        p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="stop once the output contains TEXT (repeatable)")
    if method_options:
        p.add_argument("-K", type=positive_int, default=None,
                       help="xcosd-e: candidates per round (default 20)")
        p.add_argument("-M", type=positive_int, default=None,
                       help="xcosd-e: candidate rounds before hybrid resampling (default 10)")
        p.add_argument("--no-hr-presample", action="store_true",
                       help="xcosd, xcosd-e: ask for the V_O sample with an extra round trip")
        p.add_argument("--threshold", type=unit_interval, default=None,
                       help="uhlm: uncertainty threshold (default 0.3)")


def generation_config(args: argparse.Namespace, method: str | None = None) -> Any:
    """The GenerationConfig the options describe (``method``: instead of ``--method``).

    Raises UsageError for a combination GenerationConfig refuses (``-K`` with a
    method that takes no K ...).
    """
    from ..config import GenerationConfig

    kw: dict[str, Any] = {}
    if getattr(args, "K", None) is not None:
        kw["K"] = args.K
    if getattr(args, "M", None) is not None:
        kw["M"] = args.M
    if getattr(args, "no_hr_presample", False):
        kw["hr_presample"] = False
    if getattr(args, "threshold", None) is not None:
        kw["threshold"] = args.threshold
    try:
        return GenerationConfig(
            method=method or args.method, codec=args.codec, draft_len=args.draft_len,
            adaptive_draft=not args.fixed_draft_len, draft_confidence=args.draft_confidence,
            max_draft_len=args.max_draft_len, draft_cost=args.draft_cost,
            speculate=False if getattr(args, "no_speculate", False) else None,
            tree=args.tree, tree_row_codec=args.tree_row_codec,
            tree_distinct=not args.tree_iid,
            do_sample=not args.greedy,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            ignore_eos=bool(getattr(args, "ignore_eos", False)),
            stop_strings=tuple(getattr(args, "stop", None) or ()), seed=args.seed, **kw)
    except ValueError as e:
        raise UsageError(_option_names(str(e))) from None


def _option_names(message: str) -> str:
    """GenerationConfig speaks in field names; the user typed options."""
    if "does not take" not in message:
        return message
    for field, opt in ((r"\bK\b", "-K"), (r"\bM\b", "-M"),
                       (r"\bhr_presample\b", "--no-hr-presample"),
                       (r"\bthreshold\b", "--threshold")):
        message = re.sub(field, opt, message)
    return message


def add_link_args(p: argparse.ArgumentParser, *, mbps: float | None = None,
                  rtt_ms: float = 0.0, what: str = "emulate") -> None:
    """``--link-mbps`` / ``--link-rtt-ms``: the one pair of link flags of every command.

    ``--link-rate-mbps`` and ``--rtt-ms`` (``bench load``'s old names) still work,
    hidden from ``--help``.
    """
    p.add_argument("--link-mbps", type=positive_float, default=mbps,
                   help=f"{what} a link of this rate, both directions (default: unlimited)"
                   if mbps is None else f"{what} a link of this rate, both directions")
    p.add_argument("--link-rate-mbps", dest="link_mbps", type=positive_float,
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--link-rtt-ms", type=nonneg_float, default=rtt_ms,
                   help=f"{what} this round-trip time")
    p.add_argument("--rtt-ms", dest="link_rtt_ms", type=nonneg_float,
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def link_from_args(args: argparse.Namespace) -> Any:
    """The LinkSpec the link flags describe (``None``: no emulation)."""
    if args.link_mbps is None and not args.link_rtt_ms:
        return None
    from ..transport import LinkSpec

    rate = float("inf") if args.link_mbps is None else args.link_mbps * 1e6
    return LinkSpec.of(up_bps=rate, down_bps=rate, rtt_s=args.link_rtt_ms / 1000)


def add_loop_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--uvloop", action="store_true", help="run on uvloop")


def add_transport_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", choices=("zmq", "tcp"), default="zmq",
                   help="ZeroMQ (CURVE capable) or raw TCP")


# --------------------------------------------------------------------------- checks


def check_model(spec: str, what: str = "model") -> None:
    """A model spec that cannot load fails here, before any other model loads."""
    from ..errors import ModelError
    from ..models.registry import check_spec

    try:
        check_spec(spec)
    except ModelError as e:
        raise UsageError(f"{what}: {e.message}") from None


def check_model_keywords(spec: str, flags: dict[str, Any]) -> None:
    """Each of ``flags`` (``{"--context": ("context", 512)}``: the flag, the
    :func:`~xcosd.models.load_model` keyword it becomes and its value, ``None`` when
    not given) applies to the model ``spec`` names; else a usage error naming both,
    before any model loads."""
    from ..models.registry import takes_keyword

    for flag, (key, value) in flags.items():
        if value is None or takes_keyword(spec, key):
            continue
        if key == "sequences":
            hint = (" (it runs on llama.cpp with the suffix @llama.cpp)"
                    if takes_keyword(spec, "context") else "")
            raise UsageError(f"{flag} applies to a llama.cpp model, not {spec!r}{hint}")
        raise UsageError(f"{flag} applies to llama.cpp and transformers models, not {spec!r}")


def add_curve_client_args(p: argparse.ArgumentParser, secret_help: str) -> None:
    """A device's CURVE key files (``xcosd edge``, ``xcosd bench load --connect``)."""
    p.add_argument("--curve-secret", default=None, type=existing_file, help=secret_help)
    p.add_argument("--curve-server-key", default=None, type=existing_file,
                   help="the server's public key file (with --curve-secret)")


def check_curve_client(args: argparse.Namespace) -> None:
    """The two key files go together, and only over ZeroMQ."""
    if bool(args.curve_secret) != bool(args.curve_server_key):
        raise UsageError("--curve-secret and --curve-server-key go together")
    check_curve_transport(args, bool(args.curve_secret))


def check_curve_transport(args: argparse.Namespace, using_curve: bool) -> None:
    if using_curve and args.transport != "zmq":
        raise UsageError("CURVE encryption needs the zmq transport (not --transport "
                         f"{args.transport})")


def probe(endpoint_: str, timeout_s: float) -> None:
    """Wait until something accepts TCP connections at ``endpoint_``, for up to
    ``timeout_s`` seconds (a cloud still loading its model is waited for).

    Done before the draft model loads, so a wrong address fails in seconds with a
    reason instead of after a load and a handshake that never answers. ZeroMQ
    accepts and drops a connection without a greeting, so the probe is harmless.
    """
    if not any(p.strip().startswith("tcp://") for p in endpoint_.split(",")):
        return
    from ..errors import TransportError
    from ..transport.tcp import parse_tcp_endpoint

    # several addresses: any one that accepts will do
    targets = [parse_tcp_endpoint(p.strip()) for p in endpoint_.split(",")
               if p.strip().startswith("tcp://")]
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        left = deadline - time.monotonic()
        try:
            for i, (host, port) in enumerate(targets):
                try:
                    with socket.create_connection((host, port),
                                                  timeout=max(0.05, min(left, 2.0))):
                        return
                except OSError:
                    if i == len(targets) - 1:
                        raise
        except OSError as e:
            if time.monotonic() + delay >= deadline:
                reason = e.strerror or str(e) or type(e).__name__
                raise TransportError(f"cannot reach the cloud at {endpoint_}: {reason} "
                                     f"(tried for {timeout_s:g} s)", code="connect") from None
        time.sleep(delay)
        delay = min(0.5, delay * 2)


def split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


DTYPES = ("float32", "float16", "bfloat16")


def add_device_args(p: argparse.ArgumentParser, what: str, prefix: str = "") -> None:
    """``--device`` / ``--dtype`` (``prefix``: ``draft-`` gives ``--draft-device``)."""
    p.add_argument(f"--{prefix}device", default=None, metavar="DEVICE",
                   help=f"torch device for {what} (cpu, cuda, cuda:1, mps); a model that "
                        "computes its rows in numpy hands them over on it")
    p.add_argument(f"--{prefix}dtype", default=None, choices=DTYPES,
                   help=f"float type of {what}'s weights (transformers models)")
    p.add_argument(f"--{prefix}threads", default=None, type=positive_int, metavar="N",
                   help=f"CPU threads of {what}'s compute (llama.cpp's threads; torch's for "
                        "transformers models; default: llama.cpp every core, torch its own)")
    p.add_argument(f"--{prefix}context", default=None, type=positive_int, metavar="N",
                   help=f"positions one session of {what} holds, prompt and generation "
                        "(llama.cpp and transformers models; default: the model's trained "
                        "context, on llama.cpp at most what 1 GiB of KV cache holds for all "
                        "its sessions; longer than the trained context is refused)")


def device_kw(args: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """The ``device`` / ``dtype`` / ``threads`` / ``context`` keywords of
    :func:`xcosd.models.load_model` from the flags :func:`add_device_args` added."""
    attr = prefix.replace("-", "_")
    out: dict[str, Any] = {}
    for key in ("device", "dtype", "threads", "context"):
        v = getattr(args, attr + key, None)
        if v is not None:
            out[key] = v
    return out


def check_device(args: argparse.Namespace, prefix: str = "") -> None:
    """A device this machine lacks fails here, before any model loads."""
    from ..errors import ModelError

    dev = getattr(args, prefix.replace("-", "_") + "device", None)
    if dev is None:
        return
    from ..models.on_device import torch_device

    try:
        torch_device(dev)
    except ModelError as e:
        raise UsageError(f"--{prefix}device: {e.message}") from None
