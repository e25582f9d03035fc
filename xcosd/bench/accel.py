"""Warp + verify per batch: the accelerator path in torch on the CPU against the numpy
path, same run (a record, not a goal: the torch path is built for a GPU, where
``bench/gpu_check.py`` measures it).

Each session is an xcosd-e round of 4 drafts over ``llm``-shaped rows (a softmax of
scaled Gaussian logits: a few hundred ids hold most of the mass). The numpy path is
what the scheduler runs per session (:func:`xcosd.methods.round.verify_block` on rows
warped as verification reads them); the torch path is :func:`xcosd.accel.verify_batch`
on the whole batch. Median ms per batch of ``--reps`` runs.

    python -m xcosd.bench.accel [--json bench/out/accel.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..methods import Space, get_method
from ..methods.base import Draft
from ..methods.round import verify_block
from ..sampling import SamplingParams, WarpedRows

OUT = Path("bench/out/accel.json")
HEADING = "## Verification next to the logits"
WARPERS = {"T=1": SamplingParams(), "top-p 0.95": SamplingParams(top_p=0.95)}


def _rows(b: int, size: int, d: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((b, d + 1, size), dtype=np.float32) * np.float32(3.0)
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True, dtype=np.float64).astype(np.float32)
    return x


def measure(size: int, batches: list[int], reps: int, seed: int = 0) -> dict[str, Any]:
    import torch

    from ..accel import Round, verify_batch

    rng = np.random.default_rng(seed)
    common = np.sort(rng.choice(size, size * 3 // 4, replace=False))
    space = Space(size, common)
    m = get_method("xcosd-e")
    d = 4
    out: dict[str, Any] = {"vocab": size, "drafts": d, "method": m.name,
                           "torch_threads": torch.get_num_threads(), "rows": {}}
    for label, params in WARPERS.items():
        per: dict[str, Any] = {}
        for b in batches:
            rows = _rows(b, size, d, rng)
            drafts = [Draft(ids=common[rng.integers(0, common.shape[0], d)],
                            q_values=np.full(d, 0.5, dtype=np.float32)) for _ in range(b)]
            tensors = [torch.from_numpy(r) for r in rows]
            rounds = [Round(m, space, params, dr, key=i, round=0) for i, dr in enumerate(drafts)]
            verify_batch(rounds, tensors)  # warm
            t_torch, t_numpy = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                verify_batch(rounds, tensors)
                t_torch.append(time.perf_counter() - t0)
                gen = np.random.default_rng(1)
                t0 = time.perf_counter()
                for r, dr in zip(rows, drafts, strict=True):
                    verify_block(m, WarpedRows(r, params), dr, space, gen)
                t_numpy.append(time.perf_counter() - t0)
            tt, tn = statistics.median(t_torch), statistics.median(t_numpy)
            per[str(b)] = {"torch_ms": tt * 1e3, "numpy_ms": tn * 1e3, "torch_over_numpy": tt / tn}
            print(f"{label:>11} batch {b:>3}: torch (CPU) {tt * 1e3:8.1f} ms, "
                  f"numpy {tn * 1e3:8.1f} ms ({tt / tn:.2f}x)", flush=True)
        out["rows"][label] = per
    return out


def section_lines(rep: dict[str, Any] | None) -> list[str]:
    if not rep:
        return []
    batches = list(next(iter(rep["rows"].values())))
    lines = [HEADING, "",
             "From `python -m xcosd.bench.accel` (bench/out/accel.json): warp + verify of one "
             f"batch of xcosd-e rounds ({rep['drafts']} drafts each, `llm`-shaped rows of "
             f"{rep['vocab']:,} ids), the accelerator path (`xcosd.accel.verify_batch`, torch "
             f"on this machine's CPU, {rep['torch_threads']} threads) against the numpy path "
             "the scheduler runs per session, same run: median ms per batch, torch / numpy.",
             "", "| warper | " + " | ".join(f"{b} sessions" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for label, per in rep["rows"].items():
        cells = [f"{per[b]['torch_ms']:.1f} / {per[b]['numpy_ms']:.1f} "
                 f"({per[b]['torch_over_numpy']:.1f}x)" for b in batches]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "A record, not a goal: the torch path sorts every row for top-p and sums "
              "with fixed-order scans (the same bits in any batch, xcosd/accel/sums.py), "
              "work a GPU does in parallel and a CPU does not; the numpy path finds top-p's "
              "cut without a sort and warps only the rows verification reads. On the CPU the "
              "numpy path stays the default (`--verify auto`); the GPU figures are in the "
              "next section.", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.accel", description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args(argv)
    rep = measure(args.vocab, [int(b) for b in args.batches.split(",")], args.reps)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rep, indent=2))
    print("\n".join(section_lines(rep)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
