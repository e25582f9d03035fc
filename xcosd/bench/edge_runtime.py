"""The real pair on the edge's runtime: llama.cpp against torch, in one run.

    .venv/bin/python -m xcosd.bench.edge_runtime [--prompts 3] [--tokens 32] [--passes 3]

SmolLM2-135M-Instruct (Q4_1) and Gemma-3-270m (Q4_K_M) from the GGUF files the
packages ship, one thread per side; the edge (this process) and the cloud (its own
``xcosd serve`` process) each pinned to a core of its own where the machine has two,
as two machines' compute would be. Passes alternate the rows (the machine is shared
and drifts): compare the ratios, each the median over passes of the ratio within a
pass.

1. **A draft step**, per model, ms per generated token at T = 1 after each prompt:
   ``llama.cpp own`` (llama.cpp's C loop, nothing between the calls: one token
   decoded, then drawn by llama.cpp's dist sampler), ``xcosd llama.cpp`` (:class:`LlamaCppModel`:
   ``score`` one row, :func:`~xcosd.sampling.sample_index`, ``append``: a draft step
   of the edge) and ``xcosd torch`` (:class:`TransformersModel`, the same loop).
2. **ar on a llama.cpp target**: xcosd's ``ar`` over ZeroMQ (the cloud drawing every
   token) against llama.cpp's own generation of as many tokens, tokens/s.
3. **End to end**, each backend on both sides: ``ar``, ``xcosd``, ``xcosd-e``
   (default settings, unseeded: the draft length fitted to the measured costs) and
   ``xcosd-e seeded``, over ZeroMQ; per row tokens/s, target calls and round trips per
   token, acceptance, the edge's compute per token, bytes per token, and tokens/s
   modeled for the deployment the methods are for: the measured edge compute, a
   GPU-like cloud at :data:`GPU_CALL_S` per target call, 100 Mbit/s each way and an
   RTT of 5, 20, 50 or 100 ms. Where the modeled xcosd-e beats ``ar``, drafting pays.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from xcosd.bench.real_pair import DRAFT, PROMPTS, TARGET, _free_port, pair_main
from xcosd.bench.report import machine, table
from xcosd.models.llama_cpp_model import LlamaCppModel, own_llama

HEADING = "## The edge's runtime: llama.cpp"
OUT_NAME = "edge_runtime.json"
GPU_CALL_S = 0.004
RTTS_MS = (5, 20, 50, 100)
LINK_BPS = 100e6
#: the goals: the layer's step against llama.cpp's own loop and against torch's; ar
#: through xcosd against llama.cpp's own generation
GOAL_OWN, GOAL_TORCH, GOAL_AR = 1.1, 1 / 3, 0.95
#: (row, method, seeded)
ROWS: tuple[tuple[str, str, bool], ...] = (
    ("ar", "ar", False), ("xcosd", "xcosd", False), ("xcosd-e", "xcosd-e", False),
    ("xcosd-e seeded", "xcosd-e", True))
EDGE_CORE, CLOUD_CORE = 0, 1


def _pin(core: int) -> None:
    """Run on ``core`` alone, where the machine has it (else anywhere)."""
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def _llama(spec: str, **kw: Any) -> LlamaCppModel:
    from xcosd.models import load_model

    m = load_model(spec, threads=1, **kw)
    assert isinstance(m, LlamaCppModel)
    return m


def _start(m: LlamaCppModel) -> list[int]:
    """The start token llama.cpp's own loop is given first (xcosd's ``start`` adds it)."""
    bos = m.vocab.roles.get("bos")
    return [bos] if bos is not None and m.add_bos else []


def _own_loop(llm: Any, prompt_ids: list[int], tokens: int, seed: int,
              whole: bool = False) -> float:
    """Seconds per token of llama.cpp's own generation loop after ``prompt_ids``, in
    its C API with nothing between the calls: ``llama_decode`` of one token, then
    ``llama_sampler_sample`` with the dist sampler alone (T = 1 over the whole row,
    what xcosd's draw does). ``whole``: the prompt's evaluation counted too (a whole
    generation, as ``ar`` through xcosd is timed)."""
    import llama_cpp as L

    ctx = llm._ctx.ctx
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed))
    try:
        t0 = time.perf_counter()
        arr = (L.llama_token * len(prompt_ids))(*prompt_ids)
        if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(prompt_ids))) != 0:
            raise RuntimeError("llama_decode failed on the prompt")
        if not whole:
            t0 = time.perf_counter()
        one = (L.llama_token * 1)()
        for _ in range(tokens):
            one[0] = L.llama_sampler_sample(chain, ctx, -1)
            if L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("llama_decode failed")
        return (time.perf_counter() - t0) / tokens
    finally:
        L.llama_sampler_free(chain)


def _layer_loop(m: Any, prompt_ids: list[int], tokens: int, seed: int) -> float:
    """Seconds per token of xcosd's layer: a draft step (one row scored, drawn, appended)."""
    from xcosd.sampling import sample_index

    rng = np.random.default_rng(seed)
    s = m.start(prompt_ids)
    m.score([(s, [])])  # the prompt, not counted
    m.append(s, [sample_index(m.score([(s, [])])[0][-1], rng)])
    t0 = time.perf_counter()
    for _ in range(tokens):
        row = m.score([(s, [])])[0][-1]
        m.append(s, [sample_index(row, rng)])
    took = (time.perf_counter() - t0) / tokens
    m.end(s)
    return took


def draft_steps(prompts: list[str], tokens: int, passes: int) -> list[dict[str, Any]]:
    """Part 1, per model: ms per step of each loop, and the ratios within each pass."""
    import torch

    from xcosd.models import load_model

    torch.set_num_threads(1)
    out = []
    for spec in (DRAFT, TARGET):
        lm = _llama(f"{spec}@llama.cpp", context=1024, sequences=2)
        tm = load_model(spec, threads=1)
        own = own_llama(lm.path)
        start = _start(lm)
        ids = [start + lm.tokenize(p) for p in prompts]
        per: dict[str, list[float]] = {"own": [], "llama": [], "torch": []}
        loops = {"own": own, "llama": lm, "torch": tm}
        for p in range(passes):
            names = list(loops)
            k = p % len(names)
            for name in names[k:] + names[:k]:
                per[name].append(statistics.mean(
                    _own_loop(own, ids[i], tokens, 100 * p + i) if name == "own"
                    else _layer_loop(loops[name], ids[i][len(start):], tokens, 100 * p + i)
                    for i in range(len(ids))))
            print(f"  {spec} pass {p + 1}: " + ", ".join(
                f"{n} {v[-1] * 1e3:.1f} ms" for n, v in per.items()), flush=True)
        own.close()
        lm.close()
        out.append({"model": spec, **{f"{n}_ms": 1e3 * statistics.median(v) for n, v in per.items()},
                    "vs_own": statistics.median(a / b for a, b in zip(per["llama"], per["own"],
                                                                      strict=True)),
                    "vs_torch": statistics.median(a / b for a, b in zip(per["llama"], per["torch"],
                                                                        strict=True)),
                    "passes": {n: v for n, v in per.items()}})
        del tm
    return out


def _serve(target: str, endpoint: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "xcosd", "serve", "--target", target,
                             "--threads", "1", "--bind", endpoint], env=env,
                            stdout=subprocess.DEVNULL,
                            preexec_fn=lambda: _pin(CLOUD_CORE))


async def _rows(draft: Any, endpoint: str, prompts: list[str], tokens: int, passes: int,
                ar_own: tuple[Any, Any] | None) -> dict[str, Any]:
    """Parts 2 and 3 for one backend: each row once per pass, rotated."""
    from xcosd.nodes import EdgeNode
    from xcosd.nodes.stats import merge

    names = [r[0] for r in ROWS] + (["llama.cpp own"] if ar_own is not None else [])
    spec = {r[0]: r for r in ROWS}
    totals: dict[str, dict[str, Any]] = {n: {"passes": [], "stats": []} for n in names}
    async with EdgeNode(draft, endpoint, connect_timeout_s=600.0, silence_timeout_s=300.0) as edge:
        for n in names[: len(ROWS)]:  # warm-up, untimed
            await edge.generate(prompts[0], max_new_tokens=4, method=spec[n][1],
                                seed=99 if spec[n][2] else None)
        for p in range(passes):
            k = p % len(names)
            for n in names[k:] + names[:k]:
                done, wall = 0, 0.0
                for i, prompt in enumerate(prompts):
                    if n == "llama.cpp own" and ar_own is not None:
                        # in a thread: the edge keeps answering the cloud's heartbeats
                        per = await asyncio.to_thread(_own_loop, ar_own[0], ar_own[1](prompt),
                                                      tokens, i, True)
                        wall += per * tokens
                        done += tokens
                        continue
                    t0 = time.perf_counter()
                    r = await edge.generate(prompt, max_new_tokens=tokens, method=spec[n][1],
                                            seed=i if spec[n][2] else None, ignore_eos=True)
                    wall += time.perf_counter() - t0
                    done += r.stats.tokens
                    totals[n]["stats"].append(r.stats)
                totals[n]["passes"].append(done / wall)
                print(f"  pass {p + 1} {n}: {done / wall:.2f} tok/s", flush=True)
    rows = {}
    for n in names:
        row: dict[str, Any] = {"tok_s": statistics.median(totals[n]["passes"]),
                               "tok_s_passes": totals[n]["passes"]}
        if totals[n]["stats"]:
            st = merge(totals[n]["stats"])
            trips = st.rounds + st.extra_round_trips
            row.update(tokens=st.tokens, rounds=st.rounds, round_trips=trips,
                       target_calls=st.target_calls, drafted=st.drafted, accepted=st.accepted,
                       up_bytes=st.uplink_bytes, down_bytes=st.downlink_bytes,
                       edge_compute_s=st.draft_compute_s, cloud_compute_s=st.cloud_compute_s)
            link_s = (st.uplink_bytes + st.downlink_bytes) * 8 / LINK_BPS
            row["modeled_tok_s"] = {
                str(rtt): st.tokens / (st.draft_compute_s + st.target_calls * GPU_CALL_S
                                       + trips * rtt / 1000 + link_s) for rtt in RTTS_MS}
        rows[n] = row
    return rows


def end_to_end(prompts: list[str], tokens: int, passes: int) -> dict[str, Any]:
    """Parts 2 and 3: per backend, the cloud in its own process on its own core."""
    from xcosd.models import load_model

    out: dict[str, Any] = {}
    for backend, suffix in (("llama.cpp", "@llama.cpp"), ("torch", "")):
        draft = load_model(DRAFT + suffix, threads=1)
        ar_own = None
        if backend == "llama.cpp":
            target = _llama(TARGET + suffix, context=512, sequences=1)
            own = own_llama(target.path)
            start = _start(target)
            ar_own = (own, lambda text, t=target, s=start: s + t.tokenize(text))
        endpoint = f"tcp://127.0.0.1:{_free_port()}"
        cloud = _serve(TARGET + suffix, endpoint)
        try:
            rows = asyncio.run(_rows(draft, endpoint, prompts, tokens, passes, ar_own))
        finally:
            cloud.terminate()
            cloud.wait(30)
        if ar_own is not None:
            own_passes = rows["llama.cpp own"]["tok_s_passes"]
            rows["ar"]["vs_own"] = statistics.median(
                a / b for a, b in zip(rows["ar"]["tok_s_passes"], own_passes, strict=True))
            ar_own[0].close()
        out[backend] = rows
        del draft
    return out


def run(prompts: int, tokens: int, passes: int = 3) -> dict[str, Any]:
    _pin(EDGE_CORE)
    chosen = (PROMPTS * (prompts // len(PROMPTS) + 1))[:prompts]
    t0 = time.perf_counter()
    steps = draft_steps(chosen, tokens, passes)
    e2e = end_to_end(chosen, tokens, passes)
    return {"schema_version": 1, "draft": DRAFT, "target": TARGET, "prompts": prompts,
            "tokens_per_prompt": tokens, "passes": passes, "threads_per_side": 1,
            "pinned": (os.cpu_count() or 1) >= 2, "gpu_call_s": GPU_CALL_S,
            "link_bps": LINK_BPS, "rtts_ms": list(RTTS_MS), "steps": steps,
            "end_to_end": e2e, "wall_s": time.perf_counter() - t0, "machine": machine()}


def format_steps(rep: dict[str, Any], markdown: bool = False) -> str:
    rows = [[s["model"], f"{s['own_ms']:.1f}", f"{s['llama_ms']:.1f}", f"{s['torch_ms']:.1f}",
             f"{s['vs_own']:.2f}x", f"{s['vs_torch']:.2f}x"] for s in rep["steps"]]
    return table(rows, ["model", "llama.cpp own (ms)", "xcosd llama.cpp (ms)",
                        "xcosd torch (ms)", "layer / own", "layer / torch"], markdown=markdown)


def format_end_to_end(rep: dict[str, Any], markdown: bool = False) -> str:
    out = []
    for backend, rows in rep["end_to_end"].items():
        for name, r in rows.items():
            t = max(r.get("tokens", 0), 1)
            model = r.get("modeled_tok_s", {})
            out.append([backend, name, f"{r['tok_s']:.2f}",
                        f"{r['target_calls'] / t:.2f}" if "target_calls" in r else "",
                        f"{r['round_trips'] / t:.2f}" if "round_trips" in r else "",
                        f"{r['accepted'] / r['drafted']:.2f}" if r.get("drafted") else "",
                        f"{1e3 * r['edge_compute_s'] / t:.1f}" if "edge_compute_s" in r else "",
                        f"{(r['up_bytes'] + r['down_bytes']) / t:.0f}" if "up_bytes" in r else "",
                        *(f"{model[str(x)]:.1f}" if model else "" for x in rep["rtts_ms"])])
    return table(out, ["backend", "row", "tok/s", "target calls/token", "round trips/token",
                       "acceptance", "edge ms/token", "bytes/token",
                       *(f"modeled tok/s RTT {x} ms" for x in rep["rtts_ms"])], markdown=markdown)


def format_report(rep: dict[str, Any], markdown: bool = False) -> str:
    return format_steps(rep, markdown) + "\n\n" + format_end_to_end(rep, markdown)


def goals(rep: dict[str, Any]) -> list[str]:
    """One markdown item per goal (met or not, with the figure), then where drafting
    pays in the modeled deployment."""
    lines = []
    for st in rep["steps"]:
        line = (f"- {st['model']}: a step through xcosd's layer on llama.cpp costs "
                f"{st['vs_own']:.2f}x llama.cpp's own loop (goal <= {GOAL_OWN}x: "
                f"{'met' if st['vs_own'] <= GOAL_OWN else 'not met'}) and {st['vs_torch']:.2f}x "
                "the torch layer's")
        if st["model"] == rep["draft"]:
            line += f" (goal for the draft <= 1/3: {'met' if st['vs_torch'] <= GOAL_TORCH else 'not met'})"
        lines.append(line + ".")
    ar = rep["end_to_end"].get("llama.cpp", {}).get("ar", {})
    if "vs_own" in ar:
        lines.append(f"- ar through xcosd on the llama.cpp target: {ar['vs_own']:.2f}x "
                     f"llama.cpp's own generation of as many tokens (goal >= {GOAL_AR}x: "
                     f"{'met' if ar['vs_own'] >= GOAL_AR else 'not met'}).")
    for backend, rows in rep["end_to_end"].items():
        base = rows.get("ar", {}).get("modeled_tok_s")
        for name in ("xcosd-e", "xcosd-e seeded"):
            m = rows.get(name, {}).get("modeled_tok_s")
            if not (base and m):
                continue
            pays = [x for x in rep["rtts_ms"] if m[str(x)] > base[str(x)]]
            lines.append(f"- {backend}, modeled {name} / ar: "
                         + ", ".join(f"RTT {x} ms {m[str(x)] / base[str(x)]:.2f}x"
                                     for x in rep["rtts_ms"])
                         + (f"; drafting pays from RTT {min(pays)} ms." if pays
                            else "; drafting does not pay at these RTTs."))
    return lines


def section_lines(rep: dict[str, Any] | None) -> list[str]:
    if rep is None:
        return []
    return [HEADING, "",
            f"From `python -m xcosd.bench.edge_runtime` (bench/out/{OUT_NAME}): {rep['draft']} "
            f"and {rep['target']} from the packages' GGUF files, one thread per side"
            + (", the edge and the cloud each pinned to a core of its own" if rep["pinned"]
               else "") + f", {rep['prompts']} prompts x {rep['tokens_per_prompt']} tokens, T=1, "
            f"{rep['passes']} passes in rotated order (ratios are medians of within-pass "
            "ratios). The draft step: ms per token after the prompt; `llama.cpp own` is "
            "llama.cpp's own loop in its C API (`llama_decode` of one token, then "
            "`llama_sampler_sample` with the dist sampler: T=1), the xcosd columns score one "
            "row as probabilities, draw it and append it.", "",
            format_steps(rep, markdown=True), "",
            "End to end over ZeroMQ, each backend on both sides, the cloud in its own "
            "process. Unseeded rows fit their draft length to the costs they measure "
            "(here the loopback, where a round trip is the cloud's compute and little else), "
            "seeded rows draft with the fixed default cost. Modeled: the measured edge "
            f"compute, a GPU-like cloud at {rep['gpu_call_s'] * 1000:g} ms per target call, "
            f"{rep['link_bps'] / 1e6:g} Mbit/s each way and the RTT of the column, one after "
            "the other (no draft step overlapped with a round trip). `llama.cpp own` is the "
            "target's own generation of as many tokens (its dist sampler sorts the whole "
            "row each token, which xcosd's draw does not), in the edge's process.", "",
            format_end_to_end(rep, markdown=True), "", *goals(rep), ""]


def main(argv: list[str] | None = None) -> int:
    return pair_main(argv, "xcosd.bench.edge_runtime", __doc__, 3,
                     "every row once per pass, in rotated order (medians reported)",
                     OUT_NAME, run, format_report)


if __name__ == "__main__":
    raise SystemExit(main())
