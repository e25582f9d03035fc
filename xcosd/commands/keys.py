"""``xcosd keys``: CURVE key pairs and device allowlists for the ZeroMQ transport.

* ``xcosd keys generate DIR --name NAME`` writes ``DIR/NAME.key`` (public) and
  ``DIR/NAME.key_secret`` (both keys, created with mode 0600). Files already
  there are refused unless ``--force``; a link at either path is never followed
  (:meth:`xcosd.transport.curve.KeyPair.save`).
* ``xcosd keys show FILE`` prints the public key of a key file.
* ``xcosd keys allow ALLOWDIR FILE [--name NAME]`` copies a device's public key
  into the cloud's allowlist directory (``serve --curve-allow ALLOWDIR``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .options import add_verbose, existing_file


def add_parser(sub: Any) -> None:
    p = sub.add_parser("keys", help="CURVE key pairs and allowlists for ZeroMQ",
                       description="Generate and manage CURVE keys (ZeroMQ certificate files).")
    ks = p.add_subparsers(dest="keys_command", metavar="ACTION")
    ks.required = True
    g = ks.add_parser("generate", help="write NAME.key and NAME.key_secret into DIR")
    g.add_argument("dir", help="directory for the key files (created if missing)")
    g.add_argument("--name", default="xcosd", help="file name stem")
    g.add_argument("--force", action="store_true",
                   help="replace existing files (a link there is replaced, not followed)")
    g.add_argument("--json", action="store_true", help="print JSON")
    s = ks.add_parser("show", help="print the public key of a key file")
    s.add_argument("file", type=existing_file, help="a NAME.key or NAME.key_secret file")
    a = ks.add_parser("allow", help="add a device's public key to an allowlist directory")
    a.add_argument("allow_dir", help="the cloud's allowlist directory (serve --curve-allow)")
    a.add_argument("file", type=existing_file, help="the device's NAME.key or NAME.key_secret")
    a.add_argument("--name", help="name in the allowlist (default: the file's stem)")
    a.add_argument("--force", action="store_true", help="replace a key of that name")
    for leaf in (g, s, a):
        add_verbose(leaf)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..transport.curve import KeyFileExists, KeyPair

    if args.keys_command == "generate":
        try:
            pub, sec = KeyPair.generate().save(Path(args.dir), args.name,
                                               overwrite=args.force)
        except KeyFileExists as e:
            raise KeyFileExists(f"{e.message}; pass --force to replace it") from None
        info = {"public_key": KeyPair.load(pub).public.decode(), "public_file": str(pub),
                "secret_file": str(sec)}
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            print(f"public key {info['public_key']}\n  {pub}\n  {sec} (keep private)")
        return 0
    if args.keys_command == "show":
        print(KeyPair.load(args.file).public.decode())
        return 0
    keys = KeyPair(KeyPair.load(args.file).public)
    name = args.name or Path(args.file).name.split(".")[0]
    try:
        pub, _ = keys.save(args.allow_dir, name, overwrite=args.force)
    except KeyFileExists as e:
        raise KeyFileExists(f"{e.message}; pass --force to replace it") from None
    print(f"allowed {keys.public.decode()} as {pub}")
    return 0
