"""The real pair end to end: SmolLM2-135M-Instruct drafting for Gemma-3-270m, against
what a user would otherwise run.

    .venv/bin/python -m xcosd.bench.real_pair [--prompts 3] [--tokens 32] [--passes 3]

Every row generates the same prompts at T = 1 (no top-k, no top-p) with the same
weights and one torch thread per side, once per pass, the rows' order rotated from
pass to pass (the machine is noisy and drifts: compare the ratios, not the rates;
each ratio is the median over passes of the ratio within a pass):

* ``target-generate``: Gemma-3 alone, transformers' ``generate``.
* ``usd``: transformers' own cross-tokenizer assisted generation (universal
  speculative decoding: ``assistant_model`` with both tokenizers), its defaults
  (up to 20 drafts, stop below confidence 0.4) with the assistant's head left
  whole: ``generate`` would prune it to the tokens both vocabularies share, which
  is not lossless (the bench makes the unpruned translator first, and ``generate``
  finds it in its cache).
* ``ar``, ``xcosd``, ``xcosd-e``: xcosd over ZeroMQ loopback with default settings,
  unseeded as a user runs them (so the adaptive draft length fits itself to the
  measured draft-step and round times), and ``xcosd-e seeded``: seeded
  generations, whose draft length uses the fixed default cost instead (a seeded
  output must not depend on timing). The cloud runs in its own process
  (``xcosd serve``), as it would on its own machine; the draft runs in this one.

Reported per row: tokens/s (wall), its ratio to ``usd`` and to ``target-generate``,
target calls per token, acceptance (accepted / drafted) and, for xcosd, bytes per
token and a modeled tokens/s for the deployment the method is for: the measured
edge compute, the link at 100 Mbit/s each way with a 20 ms RTT, and a GPU-like
cloud whose every target call costs :data:`GPU_CALL_S` whatever its rows (a small
model's decode step on a datacenter GPU is bound by launches and weight reads, not
by the handful of rows a round verifies).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xcosd.bench.report import OUT_DIR, machine, table, write_json

DRAFT = "smollm2-135m"
TARGET = "gemma3-270m"
PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a short recipe for a simple tomato soup:",
    "The three laws of thermodynamics state that",
    "Once upon a time, in a village by the sea,",
    "To install the package, run the following command:",
]
#: the modeled cloud's cost of one target call (see the module docstring)
GPU_CALL_S = 0.004
MODEL_LINK: dict[str, Any] = {"up_bps": 100e6, "down_bps": 100e6, "rtt_s": 0.020}
#: (row, method, seeded): the defaults as a user runs them (unseeded: the draft
#: length fitted to measured costs), and xcosd-e seeded (the fixed default cost)
XCOSD_ROWS: tuple[tuple[str, str, bool], ...] = (
    ("ar", "ar", False), ("xcosd", "xcosd", False), ("xcosd-e", "xcosd-e", False),
    ("xcosd-e seeded", "xcosd-e", True))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _hf_row(name: str, draft: Any, target: Any, prompts: list[str], tokens: int) -> dict[str, Any]:
    """``target-generate`` or ``usd`` over ``prompts`` (timed; each prompt seeded by
    its index)."""
    import torch

    tt, dt = target.tokenizer, draft.tokenizer
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                "max_new_tokens": tokens, "pad_token_id": tt.eos_token_id}
    extra = ({"assistant_model": draft.model, "tokenizer": tt, "assistant_tokenizer": dt}
             if name == "usd" else {})
    out_tokens, wall = 0, 0.0
    for i, prompt in enumerate(prompts):
        enc = tt(prompt, return_tensors="pt")
        torch.manual_seed(i)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = target.model.generate(**enc, **sampling, **extra)
            wall += time.perf_counter() - t0
        out_tokens += int(out.shape[1] - enc["input_ids"].shape[1])
    return {"row": name, "tokens": out_tokens, "wall_s": wall}


def _prepare_usd(draft: Any, target: Any) -> None:
    """generate() asks for a translator that prunes the assistant's head (in place) to
    the tokens both vocabularies share; one made first, unpruned, is the one it finds."""
    from transformers.generation.candidate_generator import AssistantVocabTranslatorCache

    AssistantVocabTranslatorCache.get_translator(
        target.tokenizer, draft.tokenizer, target.model.config.get_text_config().vocab_size,
        assistant_model=draft.model, assistant_prune_lm_head=False)


async def _xcosd_row(edge: Any, name: str, method: str, seeded: bool, prompts: list[str],
                     tokens: int) -> dict[str, Any]:
    """One xcosd row over ``prompts`` (timed), with its generations' stats."""
    from xcosd.nodes.stats import merge

    stats, wall = [], 0.0
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        r = await edge.generate(prompt, max_new_tokens=tokens, method=method,
                                seed=i if seeded else None)
        wall += time.perf_counter() - t0
        stats.append(r.stats)
    st = merge(stats)
    return {"row": name, "tokens": st.tokens, "wall_s": wall, "stats": st}


def _add(total: dict[str, Any], r: dict[str, Any]) -> None:
    """Sum row ``r`` of one pass into ``total`` (tokens, wall, the generation stats)."""
    from xcosd.nodes.stats import merge

    total["tokens"] = total.get("tokens", 0) + r["tokens"]
    total["wall_s"] = total.get("wall_s", 0.0) + r["wall_s"]
    total.setdefault("passes", []).append(r["tokens"] / r["wall_s"])
    if "stats" in r:
        total["stats"] = merge([total["stats"], r["stats"]]) if "stats" in total else r["stats"]


def _finish(name: str, total: dict[str, Any]) -> dict[str, Any]:
    row = {"row": name, "tokens": total["tokens"], "wall_s": total["wall_s"],
           "tok_s": total["tokens"] / total["wall_s"], "tok_s_passes": total["passes"]}
    st = total.get("stats")
    if st is not None:
        link_s = st.modeled_s - st.draft_compute_s - st.cloud_compute_s
        gpu_s = st.draft_compute_s + st.target_calls * GPU_CALL_S + link_s
        row.update(rounds=st.rounds, target_calls=st.target_calls, drafted=st.drafted,
                   accepted=st.accepted, bytes=st.uplink_bytes + st.downlink_bytes,
                   edge_compute_s=st.draft_compute_s, cloud_compute_s=st.cloud_compute_s,
                   modeled_gpu_tok_s=st.tokens / gpu_s if gpu_s > 0 else None)
    return row


async def _passes(draft: Any, target: Any, endpoint: str, prompts: list[str], tokens: int,
                  passes: int) -> list[dict[str, Any]]:
    """Every row once per pass, the order rotated from pass to pass, so that a drift of
    the machine's speed over the minutes of the run falls on every row alike."""
    from xcosd.nodes import EdgeNode
    from xcosd.transport import LinkSpec

    names = ["target-generate", "usd", *(r[0] for r in XCOSD_ROWS)]
    spec = {r[0]: r for r in XCOSD_ROWS}
    totals: dict[str, dict[str, Any]] = {n: {} for n in names}
    async with EdgeNode(draft, endpoint, connect_timeout_s=600.0, silence_timeout_s=120.0,
                        model_link=LinkSpec.of(**MODEL_LINK)) as edge:
        # warm-up, untimed: each path once, on a short generation
        for n in names:
            if n in spec:
                await edge.generate(prompts[0], max_new_tokens=4, method=spec[n][1],
                                    seed=99 if spec[n][2] else None)
            else:  # in a thread: the edge keeps answering the cloud's heartbeats
                await asyncio.to_thread(_hf_row, n, draft, target, prompts[:1], 4)
        for p in range(passes):
            k = p % len(names)
            for n in names[k:] + names[:k]:
                if n in spec:
                    r = await _xcosd_row(edge, n, spec[n][1], spec[n][2], prompts, tokens)
                else:
                    r = await asyncio.to_thread(_hf_row, n, draft, target, prompts, tokens)
                _add(totals[n], r)
                print(f"  pass {p + 1} {n}: {r['tokens'] / r['wall_s']:.2f} tok/s", flush=True)
    return [_finish(n, totals[n]) for n in names]


def run(prompts: int, tokens: int, passes: int = 3) -> dict[str, Any]:
    import statistics

    import torch

    from xcosd.models import load_model

    torch.set_num_threads(1)
    chosen = (PROMPTS * (prompts // len(PROMPTS) + 1))[:prompts]
    t0 = time.perf_counter()
    draft, target = load_model(DRAFT), load_model(TARGET)
    _prepare_usd(draft, target)
    print(f"models loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cloud = subprocess.Popen([sys.executable, "-m", "xcosd", "serve", "--target", TARGET,
                              "--bind", endpoint], env=env, stdout=subprocess.DEVNULL)
    try:
        rows = asyncio.run(_passes(draft, target, endpoint, chosen, tokens, passes))
    finally:
        cloud.terminate()
        cloud.wait(30)
    base = {r["row"]: r["tok_s_passes"] for r in rows}
    for r in rows:
        # the median over passes of the ratio within a pass (both from the same minutes)
        for key, ref in (("vs_usd", "usd"), ("vs_target", "target-generate")):
            r[key] = statistics.median(a / b for a, b in
                                       zip(r["tok_s_passes"], base[ref], strict=True))
    return {"schema_version": 2, "draft": DRAFT, "target": TARGET, "prompts": prompts,
            "tokens_per_prompt": tokens, "passes": passes, "torch_threads_per_side": 1,
            "gpu_call_s": GPU_CALL_S, "model_link": MODEL_LINK, "rows": rows,
            "machine": machine()}


def format_report(rep: dict[str, Any], markdown: bool = False) -> str:
    out = []
    for r in rep["rows"]:
        t = max(r["tokens"], 1)
        out.append([r["row"], f"{r['tok_s']:.2f}", f"{r['vs_usd']:.2f}x",
                    f"{r['vs_target']:.2f}x",
                    f"{r['target_calls'] / t:.2f}" if "target_calls" in r else "",
                    f"{r['accepted'] / r['drafted']:.2f}" if r.get("drafted") else "",
                    f"{r['bytes'] / t:.0f}" if "bytes" in r else "",
                    f"{r['modeled_gpu_tok_s']:.1f}" if r.get("modeled_gpu_tok_s") else ""])
    return table(out, ["row", "tok/s", "vs usd", "vs target", "target calls/token",
                       "acceptance", "bytes/token", "modeled tok/s (GPU cloud)"],
                 markdown=markdown)


def pair_main(argv: list[str] | None, prog: str, doc: str | None, passes: int,
              passes_help: str, out: str, run_bench: Callable[[int, int, int], dict[str, Any]],
              report: Callable[[dict[str, Any]], str]) -> int:
    """A real-pair bench's command line: prompts, tokens per prompt, passes and the
    JSON path; runs ``run_bench(prompts, tokens, passes)``, prints ``report`` of
    it and writes the JSON."""
    ap = argparse.ArgumentParser(prog=prog, description=(doc or "").splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--passes", type=int, default=passes, help=passes_help)
    ap.add_argument("--json", type=Path, default=OUT_DIR / out)
    a = ap.parse_args(argv)
    rep = run_bench(a.prompts, a.tokens, a.passes)
    print(report(rep))
    write_json(a.json, rep)
    return 0


def main(argv: list[str] | None = None) -> int:
    return pair_main(argv, "xcosd.bench.real_pair", __doc__, 3,
                     "every row once per pass, in rotated order (medians reported)",
                     "real_pair.json", run, format_report)


if __name__ == "__main__":
    raise SystemExit(main())
