"""``xcosd vocab DRAFT TARGET``: the common vocabulary of two real tokenizers.

Each side is a vocabulary (``llama3``, ``qwen``, ``cl100k``, ``o200k``, a tiktoken
file) or a model spec as ``serve --target`` / ``edge --draft`` take it
(``default-draft``, ``ngram:qwen:4``, ``smollm2-135m``, a ``.gguf`` file ...): a user
who asks "how much do my two models share" should not have to know which tokenizer
each one uses. Named vocabularies of the embedded models load without the model.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from .options import add_verbose, check_model


def add_parser(sub: Any) -> None:
    p = sub.add_parser("vocab", help="sizes, |V_C| and fingerprint of a draft/target pair",
                       description="Compare two vocabularies by token bytes.")
    p.add_argument("draft", help="vocabulary (llama3, qwen, cl100k, o200k, a tiktoken file) "
                                 "or model spec (default-draft, ngram:qwen:4, smollm2-135m, "
                                 "a .gguf file ...)")
    p.add_argument("target", help="vocabulary or model spec, as for DRAFT")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_verbose(p)
    p.set_defaults(func=run, check=check)


def check(args: argparse.Namespace) -> None:
    for spec in (args.draft, args.target):
        if not _is_vocabulary(spec):
            check_model(spec, f"{spec!r} is neither a vocabulary nor a model")


def _is_vocabulary(spec: str) -> bool:
    from ..vocab import QUICKTOK_ALIASES

    p = Path(spec)
    return spec in QUICKTOK_ALIASES or (p.is_file() and p.suffix != ".gguf")


def load_vocabulary(spec: str) -> Any:
    """The vocabulary named by ``spec``, or that of the model it names (loading the
    model only when its vocabulary has no name of its own)."""
    from ..models.default import DEFAULT_DRAFT, DEFAULT_TARGET
    from ..vocab import Vocabulary

    if _is_vocabulary(spec):
        return Vocabulary.load(spec)
    if spec in ("default-draft", "default-target"):
        return Vocabulary.load((DEFAULT_DRAFT if spec == "default-draft" else DEFAULT_TARGET)[0])
    if spec.startswith("ngram:"):
        return Vocabulary.load(spec.split(":")[1])
    from ..models import load_model

    return load_model(spec).vocab


def run(args: argparse.Namespace) -> int:
    from ..vocab import VocabMap

    draft, target = load_vocabulary(args.draft), load_vocabulary(args.target)
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
