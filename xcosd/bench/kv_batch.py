"""What a batched verification costs, and how much of it is copying caches.

    .venv/bin/python -m xcosd.bench.kv_batch [--model gemma3-270m] [--sessions 1,8,64]
        [--contexts 64,1024,2048] [--rows 5] [--threads 1] [--json PATH]

For each (sessions, context) pair, every session holds a cache of ``context``
positions and the cloud verifies ``rows`` new tokens of each in one
:meth:`~xcosd.models.transformers_model.TransformersModel.score` call (a round of
4 drafts plus the pending token), then rolls them back, twice; the faster call is
kept. Reported: the call's seconds, per session, and the copy share: the seconds
spent gathering the sessions' caches into the batch and copying the new states
back (``TransformersModel.copy_s``) over the call's seconds. One session takes the
unbatched path, which copies nothing.

The caches are filled with random states instead of being computed: a prefill of
64 x 2,048 positions would take this CPU most of an hour, and what a call costs
depends on the caches' shapes, not on their values.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from xcosd.bench.report import OUT_DIR, machine, table, write_json


def _sessions(model: Any, n: int, context: int, shapes: list[tuple[Any, Any]]) -> list[Any]:
    """``n`` sessions whose caches hold ``context`` random positions."""
    import torch

    from xcosd.models.transformers_model import _KV

    out = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        s = model.start([int(i) for i in torch.randint(10, 1000, (context,), generator=gen)])
        kv: _KV = s.cache
        like = [(torch.randn((*k.shape[:2], len(kv.prefix) + context, *k.shape[3:]),
                             generator=gen),
                 torch.randn((*v.shape[:2], len(kv.prefix) + context, *v.shape[3:]),
                             generator=gen)) for k, v in shapes]
        kv.write(0, like)
        s.cached = context
        out.append(s)
    return out


def run(model_name: str, sessions: list[int], contexts: list[int], rows: int,
        threads: int) -> dict[str, Any]:
    import torch

    from xcosd.models import load_model

    torch.set_num_threads(threads)
    from xcosd.models.transformers_model import TransformersModel

    model = load_model(model_name)
    if not isinstance(model, TransformersModel):
        raise SystemExit(f"{model_name} is not a transformers model")
    probe = model.start([11, 12, 13])
    model.score([(probe, [])])
    shapes = [(k[:, :, :1], v[:, :, :1]) for k, v in probe.cache.bufs]
    model.end(probe)
    points = []
    for ctx in contexts:
        for n in sessions:
            ss = _sessions(model, n, ctx, shapes)
            new = [[100 + j for j in range(rows)] for _ in ss]
            best: tuple[float, float] | None = None
            for _ in range(2):
                c0, t0 = model.copy_s, time.perf_counter()
                model.score(list(zip(ss, new, strict=True)))
                wall = time.perf_counter() - t0
                copy = model.copy_s - c0
                for s in ss:
                    model.rollback(s, ctx)
                if best is None or wall < best[0]:
                    best = (wall, copy)
            assert best is not None
            for s in ss:
                model.end(s)
            wall, copy = best
            points.append({"sessions": n, "context": ctx, "rows": rows, "call_s": wall,
                           "per_session_ms": 1000 * wall / n, "copy_s": copy,
                           "copy_share": copy / wall})
            print(f"  {n:3d} sessions x {ctx:5d} context: {wall:7.3f} s "
                  f"({1000 * wall / n:7.1f} ms/session), copy {100 * copy / wall:4.1f} %",
                  flush=True)
    return {"schema_version": 1, "model": model_name, "rows": rows, "threads": threads,
            "points": points, "machine": machine()}


def format_report(rep: dict[str, Any], markdown: bool = False) -> str:
    rows = [[p["sessions"], p["context"], f"{p['call_s']:.3f}", f"{p['per_session_ms']:.1f}",
             f"{100 * p['copy_share']:.1f} %"] for p in rep["points"]]
    return table(rows, ["sessions", "context", "call s", "ms per session", "copy share"],
                 markdown=markdown)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.kv_batch", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--sessions", default="1,8,64")
    ap.add_argument("--contexts", default="64,1024,2048")
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=OUT_DIR / "kv_batch.json")
    a = ap.parse_args(argv)
    rep = run(a.model, [int(x) for x in a.sessions.split(",")],
              [int(x) for x in a.contexts.split(",")], a.rows, a.threads)
    print(format_report(rep))
    write_json(a.json, rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
