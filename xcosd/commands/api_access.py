"""The options of ``xcosd edge serve`` that say who may use its API and what a
request may pick (:mod:`xcosd.api.keys`, :class:`xcosd.api.policy.RequestPolicy`),
defined once with their defaults.

Keys come from ``--api-key`` (repeatable), ``--api-key-file`` (one a line) and the
``XCOSD_API_KEY`` environment variable, all of them together. A server with no key
that listens beyond loopback says so on stderr: anyone who reaches it uses the
cloud with this edge's CURVE key.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from typing import Any

from .options import UsageError, existing_file, nonneg_int, split


def add_api_access_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("who may use the API, and what a request may pick (with --http; "
                             "docs/API.md)")
    g.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a key requests must carry as 'Authorization: Bearer KEY' (repeatable; "
                        "also --api-key-file and the XCOSD_API_KEY environment variable); "
                        "without any key the API is open, for loopback use")
    g.add_argument("--api-key-file", default=None, type=existing_file, metavar="FILE",
                   help="a file of keys, one a line ('#' starts a comment)")
    g.add_argument("--open-metrics", action="store_true",
                   help="serve /metrics without a key (default: behind the key, as /v1 is)")
    g.add_argument("--allow-methods", default=None, type=split, metavar="M1,M2",
                   help="the methods a request may pick in its 'xcosd' object (default: "
                        "ar,xcosd-e: lossless, bytes per token bounded)")
    g.add_argument("--allow-codecs", default=None, type=split, metavar="C1,C2",
                   help="the codecs a request may pick (default: f32,f16,bf16,q8)")
    g.add_argument("--allow-lossy", action="store_true",
                   help="let a request pick the lossy methods named in --allow-methods (each "
                        "response says whether its method was lossless)")
    g.add_argument("--allow-draft-len", default=None, type=nonneg_int, metavar="N",
                   help="the longest first draft a request may ask for (default 16)")
    g.add_argument("--allow-tree-nodes", default=None, type=nonneg_int, metavar="N",
                   help="the most nodes of a draft tree a request may ask for (default 0: none)")
    g.add_argument("--uplink-bytes-per-token", default=None, type=nonneg_int, metavar="B",
                   help="wire bytes one generation may send the cloud per token it may "
                        "generate, besides its prompt and a fixed 16 KiB (default 512)")


def api_keys(args: argparse.Namespace) -> list[str]:
    """Every key the options and the environment give."""
    from ..api.keys import API_KEY_ENV, read_key_file

    keys = list(args.api_key)
    if args.api_key_file:
        try:
            keys += read_key_file(args.api_key_file)
        except ValueError as e:
            raise UsageError(str(e)) from None
    env = os.environ.get(API_KEY_ENV, "").strip()
    if env:
        keys.append(env)
    return keys


def request_policy(args: argparse.Namespace) -> Any:
    """The :class:`~xcosd.api.policy.RequestPolicy` the options describe."""
    import dataclasses

    from ..api.policy import RequestPolicy

    given: dict[str, Any] = {
        "methods": None if args.allow_methods is None else frozenset(args.allow_methods),
        "codecs": None if args.allow_codecs is None else frozenset(args.allow_codecs),
        "max_draft_len": args.allow_draft_len, "max_tree_nodes": args.allow_tree_nodes,
        "uplink_bytes_per_token": args.uplink_bytes_per_token}
    try:
        return dataclasses.replace(RequestPolicy(lossy=args.allow_lossy),
                                   **{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        raise UsageError(f"{e} (--allow-methods, --allow-codecs, --allow-lossy)") from None


def check_api_access(args: argparse.Namespace) -> None:
    """Refuse a key or a policy that cannot work, before a model loads."""
    if args.http is None:
        return
    from ..api.keys import ApiKeys

    try:
        ApiKeys(api_keys(args))
    except ValueError as e:
        raise UsageError(str(e)) from None
    request_policy(args)


def warn_if_open(args: argparse.Namespace, keys: list[str]) -> None:
    """Say on stderr that an API without keys listens beyond loopback."""
    host = args.http[0]
    if keys or _loopback(host):
        return
    print(f"warning: the API on {host} has no key: anyone who reaches it uses the cloud "
          "with this edge's key; give --api-key (docs/DEPLOY.md)", file=sys.stderr, flush=True)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
