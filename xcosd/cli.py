"""The ``xcosd`` command line: a thin dispatcher over ``xcosd/commands/``.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` and
``run(args) -> int``; modules are imported only when their command runs, so
``xcosd vocab`` never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

#: subcommand -> module under xcosd.commands
COMMANDS: dict[str, str] = {
    "vocab": "vocab",
    "keys": "keys",
    "serve": "serve",
    "edge": "edge",
    "demo": "demo",
    "pair": "pair",
    "bench": "bench",
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .commands.options import ArgumentParser

    parser = ArgumentParser(
        prog="xcosd",
        description="Lossless collaborative speculative decoding across vocabularies.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-vv: debug); also accepted after the command")
    parser.add_argument("--version", action="version", version=f"xcosd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for _name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(f"xcosd.commands.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"xcosd.commands.{module}":
                raise
            continue  # command not present in this build
        mod.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a mistake is one ``xcosd: error: ...`` line and status 2.

    Parsing errors and each command's ``check`` (combinations of options, model
    specs, key files) come before any model loads; errors while running
    (:class:`~xcosd.errors.XcosdError`: the cloud cannot be reached ...) after.
    """
    from .commands.options import UsageError, fail

    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = args.verbose + getattr(args, "verbose_sub", 0)
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .errors import XcosdError

    check = getattr(args, "check", None)
    if check is not None:
        try:
            check(args)
        except (UsageError, XcosdError) as e:
            fail(e.message if isinstance(e, XcosdError) else str(e))
    try:
        return int(args.func(args) or 0)
    except XcosdError as e:
        print(f"xcosd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `xcosd vocab ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
