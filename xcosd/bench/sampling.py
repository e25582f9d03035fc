"""Warper and verification cost at full vocabulary size.

    .venv/bin/python -m xcosd.bench.sampling [--quick]

Three measurements, on synthetic rows over 262,144 ids (Gemma-3's vocabulary size):

* **warp ms per row** (median of repeated calls) of :func:`xcosd.sampling.warp` on one
  row, for top-p 0.95, top-k 50 and T=0.7, on four row shapes: ``flat`` (uniform
  noise: top-p keeps ~93% of the row), ``llm`` (float32 softmax of bf16 logits, normal
  with a peaked head), ``zipf`` (shuffled 1/rank^1.1) and ``peaked`` (Cauchy logits).
* **cloud batch cost**: :func:`xcosd.nodes.scoring.score_batch` over 1..64
  sessions x 5 rows (4 drafts + bonus row), xcosd-e / f32, with a model that returns
  precomputed ``llm`` rows instantly, so what is timed is the batch's warping (each
  session's rows warped as its verification reads them,
  :class:`~xcosd.sampling.WarpedRows`: rows this long are not warped together)
  plus every session's verification (commit,
  accept test, bonus or rejection candidates), per batch and per session.
* **one call or row by row**: ms per row of warping N ``llm`` rows (the rows one
  verification step reads across N sessions) in one vectorised call,
  ``warp(block)``, against :func:`~xcosd.sampling.warp` on each row in turn: whether
  a batch's warping gets cheaper per row as the batch grows on this machine.

Prints both tables and writes ``bench/out/sampling.json``. Wall times on a shared
machine are noisy; the medians over repetitions are what is reported.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from xcosd.bench.report import OUT_DIR
from xcosd.methods import Space, get_method
from xcosd.methods.base import Draft
from xcosd.methods.round import Round
from xcosd.models.base import LanguageModel, Session
from xcosd.nodes.scoring import score_batch
from xcosd.protocol.cloud import CloudSession, ModelSlot, ScoreNeeded
from xcosd.sampling import SamplingParams, warp

OUT = OUT_DIR / "sampling.json"
VOCAB = 262_144
WARPERS = {"T=1": SamplingParams(), "top-p 0.95": SamplingParams(top_p=0.95),
           "top-k 50": SamplingParams(top_k=50), "T=0.7": SamplingParams(temperature=0.7)}
SESSIONS = (1, 4, 16, 64)
DRAFT = 4


def _softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float32)
    x = np.exp(x - x.max(axis=-1, keepdims=True))
    return (x / x.sum(axis=-1, keepdims=True)).astype(np.float32)


def rows(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` probability rows over :data:`VOCAB` ids of one shape (module docstring)."""
    if kind == "flat":
        p = rng.random((n, VOCAB), dtype=np.float32) + np.float32(1.0)
        return (p / p.sum(axis=-1, keepdims=True)).astype(np.float32)
    if kind == "llm":
        logits = rng.normal(0.0, 2.0, (n, VOCAB)).astype(np.float32)
        head = rng.integers(0, VOCAB, (n, 40))
        logits[np.arange(n)[:, None], head] += rng.uniform(6.0, 14.0, (n, 40)).astype(np.float32)
        bf16 = (logits.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        return _softmax(bf16)
    if kind == "zipf":
        base = (1.0 / np.arange(1, VOCAB + 1) ** 1.1).astype(np.float32)
        out = np.stack([rng.permutation(base) for _ in range(n)])
        return (out / out.sum(axis=-1, keepdims=True)).astype(np.float32)
    if kind == "peaked":
        return _softmax(np.clip(rng.standard_cauchy((n, VOCAB)), -50, 50) * 3)
    raise ValueError(kind)


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def warp_table(reps: int, rng: np.random.Generator) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in ("flat", "llm", "zipf", "peaked"):
        row = rows(kind, 1, rng)[0]
        out[kind] = {}
        for label, params in WARPERS.items():
            if params.identity:
                continue
            ms = _median_ms(functools.partial(warp, row, params), reps)
            kept = int(np.count_nonzero(warp(row, params)))
            out[kind][label] = {"ms": ms, "kept": kept}
    return out


class _RowsModel:
    """A target whose ``score`` hands back precomputed rows at no cost."""

    name = "precomputed"

    def __init__(self, blocks: Sequence[np.ndarray]) -> None:
        self.blocks = blocks
        self.calls = 0

    def start(self, prompt_ids: Sequence[int]) -> Session:
        return Session(ids=list(prompt_ids))

    def rollback(self, session: Session, length: int) -> None:
        del session.ids[length:]

    def append(self, session: Session, ids: Sequence[int]) -> None:
        session.ids.extend(ids)

    def end(self, session: Session) -> None:
        pass

    def score(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> list[np.ndarray]:
        self.calls += 1
        return [self.blocks[i % len(self.blocks)] for i in range(len(batch))]


def _requests(n: int, params: SamplingParams, space: Space, blocks: Sequence[np.ndarray],
              rng: np.random.Generator) -> list[ScoreNeeded]:
    """``n`` sessions, each with a 4-token draft whose q(x) is near the target's p(x), so
    some rounds accept everything and some reject (as real rounds do)."""
    out = []
    for s in range(n):
        p = warp(blocks[s % len(blocks)], params)
        ids = []
        for i in range(DRAFT):
            common = np.flatnonzero(p[i][space.common_ids] > 0)
            ids.append(int(space.common_ids[rng.choice(common)]) if common.size
                       else int(space.common_ids[0]))
        draft_ids = np.array(ids, dtype=np.int64)
        q = np.minimum(1.0, p[np.arange(DRAFT), draft_ids] * rng.uniform(0.6, 1.6, DRAFT))
        q = np.maximum(q, 1e-6).astype(np.float32)
        rd = Round(get_method("xcosd-e"), space, params, Draft(ids=draft_ids, q_values=q),
                   key=s, round=0)
        # the compute reads the round and the model slot only: no session is needed
        out.append(ScoreNeeded(cast(CloudSession, None), rd, ModelSlot("bench"), [0], 1, [],
                               ids))
    return out


def batch_table(reps: int, rng: np.random.Generator, sessions: Sequence[int]
                ) -> dict[str, dict[str, Any]]:
    blocks = [rows("llm", DRAFT + 1, rng) for _ in range(8)]
    space = Space.from_mask(rng.random(VOCAB) < 0.6)
    out: dict[str, dict[str, Any]] = {}
    for label, params in WARPERS.items():
        if label == "T=0.7":
            continue
        out[label] = {}
        for n in sessions:
            # score_batch only scores: the rows model needs no vocabulary or tokenizer
            model = cast(LanguageModel, _RowsModel(blocks))
            reqs = _requests(n, params, space, blocks, rng)
            ms = _median_ms(functools.partial(score_batch, model, reqs), max(3, reps // n))
            out[label][str(n)] = {"ms_per_batch": ms, "ms_per_session": ms / n,
                                  "ms_per_row": ms / (n * (DRAFT + 1))}
    return out


def _row_by_row(block: np.ndarray, params: SamplingParams) -> list[np.ndarray]:
    return [warp(r, params) for r in block]


def vector_table(reps: int, rng: np.random.Generator, sessions: Sequence[int]
                 ) -> dict[str, dict[str, Any]]:
    """ms per row of warping ``n`` rows in one call and row by row, for each ``n``."""
    block = rows("llm", max(sessions), rng)
    out: dict[str, dict[str, Any]] = {}
    for label, params in WARPERS.items():
        if params.identity:
            continue
        out[label] = {}
        for n in sessions:
            sub = block[:n]
            k = max(3, reps // n)
            alone = _median_ms(functools.partial(_row_by_row, sub, params), k)
            whole = _median_ms(functools.partial(warp, sub, params), k)
            out[label][str(n)] = {"row_by_row_ms": alone / n, "one_call_ms": whole / n}
    return out


def _pairs(block: dict[str, dict[str, Any]], unit: str, width: int, first: str, first_w: int,
           first_d: int, second: str, second_d: int) -> list[str]:
    """A warper x N table whose cells are two figures, ``first / second``."""
    ns = list(next(iter(block.values())))
    out = [f"{'warper':12s}" + "".join(f"{n + ' ' + unit:>{width}s}" for n in ns)]
    for label, by in block.items():
        out.append(f"{label:12s}" + "".join(
            f"{by[n][first]:>{first_w}.{first_d}f} / {by[n][second]:>6.{second_d}f}" for n in ns))
    return out


def format_tables(res: dict[str, Any]) -> str:
    lines = [f"warp ms per row, {VOCAB:,} ids (median; kept tokens in brackets)"]
    labels = [w for w in WARPERS if w != "T=1"]
    lines.append(f"{'row':8s}" + "".join(f"{w:>22s}" for w in labels))
    for kind, by in res["warp"].items():
        cells = "".join(f"{by[w]['ms']:>12.3f} ({by[w]['kept']:>7,})" for w in labels)
        lines.append(f"{kind:8s}{cells}")
    lines.append("")
    lines.append(f"cloud batch: warp + verify (xcosd-e, f32), sessions x {DRAFT + 1} rows, "
                 "ms per batch / per session")
    lines += _pairs(res["batch"], "sess", 20, "ms_per_batch", 10, 1, "ms_per_session", 2)
    if "vector" in res:
        lines += ["", "warping N rows: ms per row, row by row / in one call"]
        lines += _pairs(res["vector"], "rows", 18, "row_by_row_ms", 8, 3, "one_call_ms", 3)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, up to 16 sessions")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    reps = 5 if args.quick else 30
    sessions = SESSIONS[:3] if args.quick else SESSIONS
    res = {"machine": platform.platform(), "vocab": VOCAB, "warp": warp_table(reps, rng),
           "batch": batch_table(2 * reps, rng, sessions),
           "vector": vector_table(2 * reps, rng, sessions)}
    print(format_tables(res))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
