"""``xcosd vocab DRAFT TARGET``: the common vocabulary of two real tokenizers."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("vocab", help="sizes, |V_C| and fingerprint of a draft/target pair",
                       description="Compare two vocabularies by token bytes.")
    p.add_argument("draft", help="llama3, qwen, cl100k, o200k or a tiktoken file")
    p.add_argument("target", help="llama3, qwen, cl100k, o200k or a tiktoken file")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..vocab import VocabMap, Vocabulary

    draft, target = Vocabulary.load(args.draft), Vocabulary.load(args.target)
    _ = draft.byte_index, target.byte_index
    t0 = time.perf_counter()
    vmap = VocabMap(draft, target)
    info = vmap.summary()
    info["build_seconds"] = round(time.perf_counter() - t0, 4)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(format_table(info))
    return 0


def format_table(info: dict[str, Any]) -> str:
    d, t = info["draft"], info["target"]
    rows = [
        ("", "draft", "target"),
        ("vocabulary", d["name"], t["name"]),
        ("ids", f"{d['size']:,}", f"{t['size']:,}"),
        ("regular tokens", f"{d['regular']:,}", f"{t['regular']:,}"),
        ("share in V_C", f"{100 * d['common_share']:.2f} %", f"{100 * t['common_share']:.2f} %"),
    ]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))
             for r in rows]
    lines.append(f"|V_C| = {info['common']:,} common tokens by bytes "
                 f"(+{info['common_with_special_roles'] - info['common']} specials by role), "
                 f"|V_O| = {info['other']:,}")
    lines.append(f"fingerprint {info['fingerprint']}  (built in {info['build_seconds']:.3f} s)")
    return "\n".join(lines)
