"""Codec costs on real model rows: bytes, encode/decode time and TV(p, p*).

    .venv/bin/python -m xcosd.bench.codecs [--rows N] [--quick]

Rows are the default pair's target distributions (``xcosd.models.default_pair()``:
a 4-gram model over Llama 3's 128,256 ids) at successive positions of a text,
warped three ways (T=1 dense; top-p 0.95; top-k 50). For every codec, per warper:

* bytes of an HR payload (the row over V_C, as hybrid resampling sends it) and of
  a full row (over V_T, as straightforward sends it), means over the rows;
* encode and decode microseconds for a full row (medians);
* TV(p, p*) for the full row (``normalise(commit(p))``) and for the HR payload
  (``p*`` from :func:`xcosd.methods.commit.committed_hybrid`, theta_o included);
* ratios against ``f32`` measured in the same run.

Prints one table per warper and writes ``bench/out/codecs.json``.
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
CODECS = ["f32", "f16", "bf16", "q8", "q8:lin", "q8:sqrt", "sparse", "topk:50",
          "topk:1000", "f32+zstd", "f16+zstd", "bf16+zstd", "q8+zstd", "sparse+zstd"]
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
            table[name] = {
                "exact": c.exact,
                "bytes_full": statistics.mean(full_bytes),
                "bytes_hr": statistics.mean(hr_bytes),
                "encode_us": statistics.median(enc),
                "decode_us": statistics.median(dec),
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
    ap.add_argument("--quick", action="store_true", help="4 rows, 3 timing repetitions")
    args = ap.parse_args(argv)
    n, reps = (4, 3) if args.quick else (args.rows, 7)
    rows, space, source = model_rows(n)
    res = {
        "source": source,
        "rows": len(rows),
        "n_common": space.n_common,
        "n_target": space.target_size,
        "machine": platform.platform(),
        "warpers": measure(rows, space, reps),
    }
    print(f"codecs on {len(rows)} rows of the {source}")
    print(format_tables(res))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
