"""Codec costs: bytes, encode/decode time and TV(p, p*) on real model rows, and
encode/decode speed on 262,144-entry rows built to stress the codecs.

    .venv/bin/python -m xcosd.bench.codecs [--rows N] [--quick] [--speed-only]

Rows are the default pair's target distributions (``xcosd.models.default_pair()``:
a 4-gram model over Llama 3's 128,256 ids) at successive positions of a text,
warped three ways (T=1 dense; top-p 0.95; top-k 50). For every codec, per warper:

* bytes of an HR payload (the row over V_C, as hybrid resampling sends it) and of
  a full row (over V_T, as straightforward sends it), means over the rows;
* encode and decode microseconds for a full row (medians), and the same as MB/s of
  float32 row (4 bytes per entry, in both directions);
* TV(p, p*) for the full row (``normalise(commit(p))``) and for the HR payload
  (``p*`` from :func:`xcosd.methods.commit.committed_hybrid`, theta_o included);
* ratios against ``f32`` measured in the same run.

The speed section (``speed`` in the JSON) times every codec on synthetic rows of
262,144 entries, the size the codecs' speed target is stated for: ``dense`` (a
Dirichlet(0.05) draw: every entry non-zero, spread over many octaves), ``tiny``
(mostly ~1e-9: under float16's normal range, numpy's slow cast path), ``denormal``
(mostly float32 subnormals) and ``ties`` (a 4-gram row's shape: 85 % of the entries
share one backed-off value, the rest a few hundred values, a few zeros). Times are
the minimum over repetitions (the machine is shared: the minimum is the cost, the
rest is other work), next to a same-run ``memcpy`` of the row (``np.copyto``) and
its ``tobytes()``; MB/s is row bytes (4 per entry) over the time, for encode and
decode alike, so every number compares with memcpy's.

Prints the tables and writes ``bench/out/codecs.json`` (``--speed-only``: just the
speed section, without loading the model, to ``bench/out/codec_speed.json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import numpy as np

from xcosd.bench.report import OUT_DIR
from xcosd.codecs import get_codec
from xcosd.methods.base import Space
from xcosd.methods.commit import committed_hybrid
from xcosd.methods.distance import total_variation, tv_distance
from xcosd.sampling import SamplingParams, warp
from xcosd.vocab import VocabMap

OUT = OUT_DIR / "codecs.json"
OUT_SPEED = OUT_DIR / "codec_speed.json"
CODECS = ["f32", "f16", "bf16", "q8", "q8:lin", "q8:sqrt", "sparse", "topk:50",
          "topk:1000", "f32+zstd", "f16+zstd", "bf16+zstd", "q8+zstd", "sparse+zstd"]
#: the speed section's row length (the codecs' speed target: <= 3 ms a row each way)
SPEED_N = 262_144
SPEED_ROWS = ("dense", "tiny", "denormal", "ties")
WARPS = [("T=1", SamplingParams()), ("top-p 0.95", SamplingParams(top_p=0.95)),
         ("top-k 50", SamplingParams(top_k=50))]
TEXT = ("The cloud server verifies a block of drafted tokens in one pass, and only a few "
        "bytes cross the network, while the output is distributed exactly as the target "
        "model alone would produce it. Speculative decoding between two vocabularies")


def model_rows(n: int) -> tuple[list[np.ndarray], Space, str]:
    from xcosd.models import default_pair

    draft, target = default_pair()
    ids = target.tokenize(TEXT)
    session = target.start(ids[:2])
    rows = list(target.score([(session, ids[2:2 + n])])[0])[:n]
    space = Space.from_vocab_map(VocabMap(draft.vocab, target.vocab))
    return rows, space, f"default_pair target ({target.vocab.name}, {target.vocab.size} ids)"


def _us(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def measure(rows: list[np.ndarray], space: Space, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, params in WARPS:
        warped = [warp(r, params) for r in rows]
        table = {}
        for name in CODECS:
            c = get_codec(name)
            full_bytes, hr_bytes, tv_full, tv_hr, enc, dec = [], [], [], [], [], []
            for p in warped:
                data = c.encode(p)
                full_bytes.append(len(data))
                hr_bytes.append(len(c.encode(p[space.common_ids])))
                tv_full.append(tv_distance(p, c))
                tv_hr.append(total_variation(p, committed_hybrid(c, p, space)))
            for p in warped[: max(2, len(warped) // 4)]:
                data = c.encode(p)
                enc.append(_us(lambda p=p, c=c: c.encode(p), reps))
                dec.append(_us(lambda d=data, n=p.size, c=c: c.decode(d, n), reps))
            row_bytes = 4 * warped[0].size
            table[name] = {
                "exact": c.exact,
                "bytes_full": statistics.mean(full_bytes),
                "bytes_hr": statistics.mean(hr_bytes),
                "encode_us": statistics.median(enc),
                "decode_us": statistics.median(dec),
                "encode_mb_s": row_bytes / statistics.median(enc),  # bytes/us = MB/s
                "decode_mb_s": row_bytes / statistics.median(dec),
                "tv_full_mean": statistics.mean(tv_full),
                "tv_full_max": max(tv_full),
                "tv_hr_mean": statistics.mean(tv_hr),
            }
        base = table["f32"]
        for v in table.values():
            v["bytes_full_vs_f32"] = v["bytes_full"] / base["bytes_full"]
            v["bytes_hr_vs_f32"] = v["bytes_hr"] / base["bytes_hr"]
            v["encode_vs_f32"] = v["encode_us"] / base["encode_us"]
            v["decode_vs_f32"] = v["decode_us"] / base["decode_us"]
        out[label] = {"nonzero_mean": statistics.mean(int((p > 0).sum()) for p in warped),
                      "codecs": table}
    return out


def speed_rows(n: int = SPEED_N, seed: int = 0) -> dict[str, np.ndarray]:
    """The speed section's rows (see the module docstring), each summing to 1."""
    rng = np.random.default_rng(seed)
    rows = {"dense": rng.dirichlet(np.full(n, 0.05))}
    tiny = np.full(n, 1e-9) * rng.uniform(0.5, 2.0, n)
    tiny[rng.choice(n, 50, replace=False)] = rng.uniform(0.01, 0.05, 50)
    rows["tiny"] = tiny
    denormal = rng.uniform(0.0, 1e-38, n)
    denormal[rng.choice(n, 10, replace=False)] = 0.1
    rows["denormal"] = denormal
    values = np.sort(rng.uniform(1e-8, 1e-3, 400))
    ties = np.full(n, 7e-8)
    picked = rng.choice(n, int(0.15 * n), replace=False)
    ties[picked] = values[rng.integers(0, values.size, picked.size)]
    ties[rng.choice(n, 2000, replace=False)] = 0.0
    rows["ties"] = ties
    return {k: (r / r.sum()).astype(np.float32) for k, r in rows.items()}


def _best_ms(fn: Any, reps: int) -> float:
    best = np.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def measure_speed(reps: int, n: int = SPEED_N,
                  codecs: list[str] | None = None) -> dict[str, Any]:
    """Encode and decode ms (minimum over ``reps``) and MB/s of every codec on each
    of :func:`speed_rows`, with a same-run memcpy and ``tobytes()`` of the row."""
    mb = 4 * n / 1e6  # row bytes, in MB
    out: dict[str, Any] = {"n": n, "row_bytes": 4 * n, "reps": reps, "timing": "min",
                           "rows": {}}
    for kind, row in speed_rows(n).items():
        dst = np.empty_like(row)
        copy_ms = _best_ms(lambda r=row, d=dst: np.copyto(d, r), reps)
        tobytes_ms = _best_ms(row.tobytes, reps)
        table: dict[str, Any] = {}
        for name in codecs or CODECS:
            c = get_codec(name)
            data = c.encode(row)
            enc = _best_ms(lambda c=c, r=row: c.encode(r), reps)
            dec = _best_ms(lambda c=c, d=data: c.decode(d, n), reps)
            table[name] = {"bytes": len(data), "encode_ms": enc, "decode_ms": dec,
                           "encode_mb_s": mb / enc * 1e3, "decode_mb_s": mb / dec * 1e3,
                           "encode_vs_memcpy": enc / copy_ms, "decode_vs_memcpy": dec / copy_ms}
        out["rows"][kind] = {
            "nonzero": int(np.count_nonzero(row)), "distinct": int(np.unique(row).size),
            "memcpy_ms": copy_ms, "memcpy_mb_s": mb / copy_ms * 1e3,
            "tobytes_ms": tobytes_ms, "tobytes_mb_s": mb / tobytes_ms * 1e3,
            "codecs": table}
    return out


def format_speed(speed: dict[str, Any]) -> str:
    lines = [f"\nspeed on {speed['n']:,}-entry rows (ms: minimum of {speed['reps']}; "
             "MB/s of float32 row, both directions)"]
    for kind, block in speed["rows"].items():
        lines.append(f"\n{kind}  ({block['nonzero']:,} non-zero, {block['distinct']:,} "
                     f"distinct; memcpy {block['memcpy_ms']:.3f} ms = "
                     f"{block['memcpy_mb_s']:,.0f} MB/s, tobytes {block['tobytes_ms']:.3f} ms)")
        lines.append(f"{'codec':<12}{'bytes':>11}{'enc ms':>9}{'dec ms':>9}{'enc MB/s':>10}"
                     f"{'dec MB/s':>10}")
        for name, v in block["codecs"].items():
            lines.append(f"{name:<12}{v['bytes']:>11,}{v['encode_ms']:>9.2f}"
                         f"{v['decode_ms']:>9.2f}{v['encode_mb_s']:>10,.0f}"
                         f"{v['decode_mb_s']:>10,.0f}")
    return "\n".join(lines)


def format_tables(res: dict[str, Any]) -> str:
    lines = []
    for label, block in res["warpers"].items():
        lines.append(f"\n{label}  (mean non-zeros per row: {block['nonzero_mean']:,.0f}; "
                     f"|V_C| = {res['n_common']:,}, |V_T| = {res['n_target']:,})")
        lines.append(f"{'codec':<12}{'HR bytes':>10}{'x f32':>7}{'full bytes':>12}{'x f32':>7}"
                     f"{'enc us':>9}{'dec us':>9}{'TV full':>10}{'TV HR':>10}")
        for name, v in block["codecs"].items():
            lines.append(
                f"{name:<12}{v['bytes_hr']:>10,.0f}{v['bytes_hr_vs_f32']:>7.3f}"
                f"{v['bytes_full']:>12,.0f}{v['bytes_full_vs_f32']:>7.3f}"
                f"{v['encode_us']:>9,.0f}{v['decode_us']:>9,.0f}"
                f"{v['tv_full_mean']:>10.2e}{v['tv_hr_mean']:>10.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16, help="model rows (positions)")
    ap.add_argument("--quick", action="store_true",
                    help="4 rows, 3 timing repetitions (speed section: 5)")
    ap.add_argument("--speed-only", action="store_true",
                    help="only the speed section (no model), to bench/out/codec_speed.json")
    ap.add_argument("--speed-reps", type=int, default=25,
                    help="repetitions per speed measurement (the minimum is kept)")
    args = ap.parse_args(argv)
    speed_reps = 5 if args.quick else args.speed_reps
    if args.speed_only:
        speed = {"machine": platform.platform(), **measure_speed(speed_reps)}
        print(format_speed(speed))
        OUT_SPEED.parent.mkdir(parents=True, exist_ok=True)
        OUT_SPEED.write_text(json.dumps(speed, indent=2))
        print(f"\nwrote {OUT_SPEED}")
        return 0
    n, reps = (4, 3) if args.quick else (args.rows, 7)
    rows, space, source = model_rows(n)
    res: dict[str, Any] = {
        "source": source,
        "rows": len(rows),
        "n_common": space.n_common,
        "n_target": space.target_size,
        "machine": platform.platform(),
        "warpers": measure(rows, space, reps),
        "speed": measure_speed(speed_reps),
    }
    print(f"codecs on {len(rows)} rows of the {source}")
    print(format_tables(res))
    print(format_speed(res["speed"]))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
