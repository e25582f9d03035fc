"""The accelerator check: the cloud's target and its verification on one device.

``make gpu-check`` runs it on ``cuda``; CI runs it on the CPU device with ``--quick``
(``tests/test_gpu_check.py``), so it cannot rot. It prints, and saves as JSON
(``--out``):

1. ``generate``: the target generating alone through xcosd (one edge, one cloud over
   ZeroMQ on loopback, the target on the device, verification on the device), ``ar``
   and ``xcosd-e``, against transformers' own ``generate`` on the same device and
   weights (tokens/s, same run; the ratio is the figure);
2. ``verify``: warp + verify of one batch of 1, 64 and 256 sessions at the target's
   vocabulary (top-p 0.95, T = 1, 4 drafts each), on the device
   (:func:`xcosd.accel.verify_batch`) and, for comparison, the numpy path on the host
   with the rows copied there;
3. ``law``: the first-token law over ZeroMQ with the target on the device (T = 1,
   top-k 20, ``--law-n`` generations per method; chi-square and total variation
   against the target's own warped row);
4. ``load``: 64 devices (concurrent sessions over 8 edge connections) generating for a
   while: tokens/s with verification on the device and on the host, same run; the
   devices draft with ``--load-draft`` (a model as cheap as a lookup by default: 64
   devices' drafting in one process would measure that process's CPU, not the cloud).

``--pair real`` is the real SmolLM2-135M -> Gemma-3-270m pair (``make setup-real``);
``--pair arch:DIR`` builds the same two architectures with random weights from the
configs and tokenizers in ``DIR/gemma`` and ``DIR/smollm`` (a machine the 350 MB of
weights cannot reach: the speed figures are the architectures' own, acceptance is not
the trained pair's); ``--pair tiny`` two tiny local models.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import xcosd
from xcosd.accel import Round, verify_batch
from xcosd.methods import Space, get_method
from xcosd.methods.base import Draft
from xcosd.methods.round import verify_block
from xcosd.models.transformers_model import TransformersModel
from xcosd.sampling import SamplingParams, WarpedRows, warp
from xcosd.vocab import VocabMap

PROMPT = "The history of the city begins"
TOPP = SamplingParams(top_p=0.95)
LAW = SamplingParams(top_k=20)


def log(*a: Any) -> None:
    print(*a, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the pair ---------------------------------------------------------------------


def _from_arch(d: Path, device: str, dtype: torch.dtype, seed: int) -> TransformersModel:
    """A model of ``d``'s architecture with random weights, and ``d``'s tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="xcosd-arch-"))
    for f in d.iterdir():
        if f.name.endswith(".gz"):
            with gzip.open(f, "rb") as src, open(work / f.name[:-3], "wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            shutil.copy(f, work / f.name)
    tok = AutoTokenizer.from_pretrained(str(work), local_files_only=True)
    cfg = AutoConfig.from_pretrained(str(work), local_files_only=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return TransformersModel(model.eval(), tok, name=d.name + "-random", device=device)


def build_pair(spec: str, device: str, dtype: str) -> tuple[Any, Any]:
    """(target on ``device``, draft on the CPU: the edge is another machine)."""
    td = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if spec == "real":
        target = xcosd.load_model("gemma3-270m", device=device, dtype=dtype)
        draft = xcosd.load_model("smollm2-135m")
        return target, draft
    if spec.startswith("arch:"):
        root = Path(spec[5:])
        return (_from_arch(root / "gemma", device, td, 1),
                _from_arch(root / "smollm", "cpu", torch.float32, 2))
    if spec == "tiny":
        from xcosd.models.tiny import tiny_llama

        t_dir = Path(tempfile.mkdtemp(prefix="xcosd-tiny-"))
        tiny_llama(t_dir, layers=2, seed=1)
        draft = tiny_llama(sentencepiece=True, layers=1, seed=2)
        return TransformersModel.from_pretrained(t_dir, device=device, dtype=dtype), draft
    raise SystemExit(f"unknown --pair {spec!r}: real, arch:DIR or tiny")


# -- 1. the target through xcosd against transformers' generate -------------------


async def _xcosd_stream(target: Any, draft: Any, method: str, n: int, verify_on: bool
                        ) -> dict[str, Any]:
    async with (xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0",
                                verify_on_device=verify_on) as cloud,
                xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge):
        await edge.generate(PROMPT, max_new_tokens=4, method=method, seed=0)  # warm
        t0 = time.perf_counter()
        r = await edge.generate(PROMPT, max_new_tokens=n, method=method, seed=1,
                                temperature=1.0)
        wall = time.perf_counter() - t0
    st = r.stats
    return {"tokens": len(r.token_ids), "s": wall, "tokens_per_s": len(r.token_ids) / wall,
            "acceptance": st.accepted / st.drafted if st.drafted else None}


def _hf_generate(target: TransformersModel, n: int) -> dict[str, Any]:
    ids = torch.tensor([target.tokenize(PROMPT)], device=target.device)
    kw = {"do_sample": True, "top_k": 0, "top_p": 1.0, "temperature": 1.0,
          "pad_token_id": 0}
    with torch.inference_mode():
        target.model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        sync(target.device)
        t0 = time.perf_counter()
        out = target.model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(target.device)
    wall = time.perf_counter() - t0
    got = int(out.shape[1] - ids.shape[1])
    return {"tokens": got, "s": wall, "tokens_per_s": got / wall}


async def check_generate(target: Any, draft: Any, n: int) -> dict[str, Any]:
    hf = _hf_generate(target, n)
    log(f"  transformers generate: {hf['tokens_per_s']:.1f} tokens/s")
    out: dict[str, Any] = {"transformers_generate": hf}
    for method in ("ar", "xcosd-e"):
        got = await _xcosd_stream(target, draft, method, n, True)
        got["vs_generate"] = got["tokens_per_s"] / hf["tokens_per_s"]
        out[method] = got
        log(f"  xcosd {method}: {got['tokens_per_s']:.1f} tokens/s "
            f"({got['vs_generate']:.2f}x generate), acceptance {got['acceptance']}")
    return out


# -- 2. warp + verify per batch ----------------------------------------------------


def _batch(space: Space, b: int, d: int, device: torch.device, rng: np.random.Generator
           ) -> tuple[list[Round], list[torch.Tensor]]:
    """``b`` xcosd-e rounds of ``d`` drafts on rows shaped like a language model's
    (a few hundred tokens carry most of the mass)."""
    size = space.target_size
    rounds, rows = [], []
    m = get_method("xcosd-e")
    g = torch.Generator(device=device).manual_seed(int(rng.integers(1 << 30)))
    logits = torch.randn((b, d + 1, size), generator=g, device=device) * 3.0
    probs = torch.softmax(logits, dim=-1)
    for i in range(b):
        pos = rng.integers(0, space.n_common, d)
        dr = Draft(ids=space.common_ids[pos], q_values=np.full(d, 0.5, dtype=np.float32))
        rounds.append(Round(m, space, TOPP, dr, key=i, round=0))
        rows.append(probs[i])
    return rounds, rows


def check_verify(space: Space, device: torch.device, sizes: list[int], reps: int
                 ) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"vocab": space.target_size, "warper": TOPP.label(), "drafts": 4}
    m = get_method("xcosd-e")
    for b in sizes:
        rounds, rows = _batch(space, b, 4, device, rng)
        verify_batch(rounds, rows)  # warm
        sync(device)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            verify_batch(rounds, rows)
            sync(device)
            times.append(time.perf_counter() - t0)
        dev_s = statistics.median(times)
        # the numpy path: the rows copied to the host, each session verified there
        t0 = time.perf_counter()
        host = [r.float().cpu().numpy() for r in rows]
        gen = np.random.default_rng(1)
        for rd, h in zip(rounds, host, strict=True):
            verify_block(m, WarpedRows(h, TOPP), rd.draft, space, gen)
        host_s = time.perf_counter() - t0
        out[str(b)] = {"device_ms": dev_s * 1e3, "host_ms": host_s * 1e3,
                       "host_over_device": host_s / dev_s}
        log(f"  batch {b}: device {dev_s * 1e3:.2f} ms, host numpy {host_s * 1e3:.1f} ms "
            f"({host_s / dev_s:.1f}x)")
        del rows
    return out


# -- 3. the first-token law over ZeroMQ --------------------------------------------


def _target_law(target: Any) -> np.ndarray:
    s = target.start(target.tokenize(PROMPT))
    try:
        row = target.score([(s, [])])[0][0]
    finally:
        target.end(s)
    return warp(np.asarray(row, dtype=np.float64), LAW)


async def check_law(target: Any, draft: Any, n: int) -> dict[str, Any]:
    from scipy import stats

    law = _target_law(target)
    support = np.flatnonzero(law > 0)
    out: dict[str, Any] = {"n": n, "warper": LAW.label(), "support": int(support.size)}
    async with (xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", max_batch=64,
                                max_sessions=4 * n, verify_on_device=True) as cloud,
                xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge):
        for method in ("xcosd-e", "xcosd"):
            sem = asyncio.Semaphore(64)

            async def one(i: int, method: str = method, sem: asyncio.Semaphore = sem
                          ) -> int:
                async with sem:
                    r = await edge.generate(PROMPT, max_new_tokens=2, method=method,
                                            seed=10_000 + i, top_k=LAW.top_k,
                                            draft_len=1, adaptive_draft=False)
                return int(r.token_ids[0])

            t0 = time.perf_counter()
            first = np.array(await asyncio.gather(*[one(i) for i in range(n)]))
            wall = time.perf_counter() - t0
            counts = np.bincount(first, minlength=law.shape[0])
            off = int(counts[law == 0].sum())
            # in float64: a float32 law's sum is off by more than chisquare's tolerance
            w = law[support].astype(np.float64)
            expected = w / w.sum() * counts[support].sum()
            p = float(stats.chisquare(counts[support], expected).pvalue) if not off else 0.0
            tv = 0.5 * float(np.abs(counts / n - law).sum())
            bound = float(np.sqrt(support.size / n))
            ok = off == 0 and p > 1e-3 and tv < bound
            out[method] = {"pvalue": p, "tv": tv, "tv_bound": bound, "off_support": off,
                           "s": wall, "ok": ok}
            log(f"  {method}: N={n} chi-square p={p:.3g}, TV {tv:.4f} (bound {bound:.3f}), "
                f"{off} off the support: {'holds' if ok else 'FAILS'}")
    return out


# -- 4. a 64-device load ------------------------------------------------------------


async def _load(target: Any, draft: Any, method: str, devices: int, seconds: float,
                on_device: bool) -> dict[str, Any]:
    edges_n = 8
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", max_batch=devices,
                               max_batch_tokens=devices * 8, max_sessions=4 * devices,
                               verify_on_device=on_device) as cloud:
        edges = [xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) for _ in range(edges_n)]
        for e in edges:
            await e.__aenter__()

        def committed() -> int:
            # every round commits its accepted drafts and one token more
            st = cloud.stats()
            return int(st["rounds"]) + int(st["accepted_tokens"])

        async def device(i: int) -> None:
            k = 0
            while True:
                await edges[i % edges_n].generate(PROMPT, max_new_tokens=16, method=method,
                                                  seed=i * 1000 + k, top_p=TOPP.top_p)
                k += 1

        tasks = [asyncio.ensure_future(device(i)) for i in range(devices)]
        try:
            await asyncio.sleep(min(2.0, seconds / 4))  # warm-up
            c0, b0 = committed(), cloud.stats()["scheduler"]
            t0 = time.perf_counter()
            await asyncio.sleep(seconds)  # the window: a fixed time, whatever is in flight
            tokens, wall = committed() - c0, time.perf_counter() - t0
            b1 = cloud.stats()["scheduler"]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for e in edges:
                await e.__aexit__(None, None, None)
        batches = b1["batches"] - b0["batches"]
        mean_batch = (b1["requests"] - b0["requests"]) / batches if batches else None
    return {"tokens": tokens, "s": wall, "tokens_per_s": tokens / wall,
            "mean_batch": mean_batch}


async def check_load(target: Any, draft: Any, devices: int, seconds: float,
                     methods: tuple[str, ...] = ("ar", "xcosd-e")) -> dict[str, Any]:
    out: dict[str, Any] = {"devices": devices, "warper": TOPP.label(),
                           "draft": getattr(draft, "name", str(draft))}
    for method in methods:
        row: dict[str, Any] = {}
        for where, flag in (("device", True), ("host", False)):
            row[where] = await _load(target, draft, method, devices, seconds, flag)
            log(f"  {method}, verify on the {where}: "
                f"{row[where]['tokens_per_s']:.1f} tokens/s, "
                f"mean batch {row[where]['mean_batch']}")
        row["device_over_host"] = (row["device"]["tokens_per_s"]
                                   / max(row["host"]["tokens_per_s"], 1e-9))
        out[method] = row
    return out


# -- main -----------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    dev = torch.device(args.device)
    report: dict[str, Any] = {
        "device": args.device, "dtype": args.dtype, "pair": args.pair,
        "torch": torch.__version__, "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "quick": args.quick}
    log(f"xcosd gpu-check on {args.device} ({report['gpu'] or platform.processor()}), "
        f"torch {torch.__version__}, pair {args.pair}")
    target, draft = build_pair(args.pair, args.device, args.dtype)
    vmap = VocabMap(draft.vocab, target.vocab)
    space = Space.from_vocab_map(vmap)
    log(f"pair: {target.name} ({target.vocab.size} ids, on {target.device}) <- "
        f"{draft.name} ({draft.vocab.size} ids); V_C {vmap.n_common}, V_O {vmap.n_other}")
    quick = args.quick
    only = set(args.only.split(",")) if args.only else {"generate", "verify", "law", "load"}
    took: dict[str, float] = {"pair": time.perf_counter() - t_start}
    report["section_s"] = took
    if "generate" in only:
        log("1. the target through xcosd against transformers' generate")
        t0 = time.perf_counter()
        report["generate"] = await check_generate(target, draft, 16 if quick else 128)
        took["generate"] = time.perf_counter() - t0
    if "verify" in only:
        log("2. warp + verify per batch")
        t0 = time.perf_counter()
        report["verify"] = check_verify(space, dev, [1, 4] if quick else [1, 64, 256],
                                        2 if quick else 10)
        took["verify"] = time.perf_counter() - t0
    if "law" in only:
        log("3. first-token law over ZeroMQ")
        t0 = time.perf_counter()
        report["law"] = await check_law(target, draft, args.law_n)
        took["law"] = time.perf_counter() - t0
    if "load" in only:
        log("4. load")
        t0 = time.perf_counter()
        # the devices' drafts: the pair's own draft, or a model as cheap as a lookup
        # (64 devices' drafting in this one process would otherwise measure its CPU)
        load_draft = draft if args.load_draft == "pair" else xcosd.load_model(args.load_draft)
        report["load"] = await check_load(target, load_draft, 8 if quick else 64,
                                          2.0 if quick else args.load_s,
                                          tuple(args.load_methods.split(",")))
        took["load"] = time.perf_counter() - t0
    report["wall_s"] = time.perf_counter() - t_start
    log(f"done in {report['wall_s']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()) + ")")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=float))
    law = report.get("law", {})
    return 0 if all(law[m]["ok"] for m in ("xcosd-e", "xcosd") if m in law) else 1


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--pair", default="real", help="real, arch:DIR or tiny")
    p.add_argument("--law-n", type=int, default=1500, help="generations per law test")
    p.add_argument("--load-s", type=float, default=15.0, help="seconds per load run")
    p.add_argument("--load-draft", default="synthetic:llama3",
                   help="the load's draft model spec, or 'pair' for the pair's draft")
    p.add_argument("--load-methods", default="ar,xcosd-e")
    p.add_argument("--only", default="", help="sections to run: generate,verify,law,load")
    p.add_argument("--quick", action="store_true", help="small sizes (the CI run)")
    p.add_argument("--out", default="bench/out/gpu_check.json")
    args = p.parse_args(argv)
    return asyncio.run(main(args))


if __name__ == "__main__":
    sys.exit(cli())
