"""What a cloud serving more sessions than its llama.cpp target keeps caches for pays.

    .venv/bin/python -m xcosd.bench.slots [--slots 4,8,12] [--sessions 12]
        [--prompt-tokens 96] [--tokens 6] [--threads 1] [--json PATH]

Gemma-3-270m (Q4_K_M) on llama.cpp is the target of a :class:`~xcosd.nodes.CloudNode`
in this process with ``--slots`` sequences that keep a cache (``xcosd serve --slots``);
``--sessions`` generations run at once against it over ZeroMQ on loopback, one edge
each, each from a prompt of its own of ``--prompt-tokens`` target ids. The method is
``ar`` (greedy, the end token ignored, so every session generates ``--tokens``): a
round feeds the target one token of a session whose cache stayed resident, so the
tokens fed above the floor (every prompt once, one per generated token) are
re-evaluations of evicted sessions, and the draft (a synthetic model over the target's
vocabulary) is never asked for a row: the run measures the target alone. Every
slot count is one run over the same prompts, one after the other; compare the rows
with the one whose slots hold every session (the ratios in the last columns).

Reported per slot count: sessions evicted, tokens fed to the target per generated
token and that over the floor, the cloud's mean batch, the target's ms and tokens fed
per call once every session has had its prompt evaluated (a round: the batch holds
every session, so a device waits about one call per token), and tokens/s over all
sessions, wall clock, prompts included.

Prints a table and writes ``bench/out/slots.json``; docs/RESULTS.md's section comes
from :func:`section_lines`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from xcosd.bench.report import OUT_DIR, machine, table, write_json
from xcosd.models.base import ModelWrapper, Session

HEADING = "## Sessions past the target's slots"
OUT_NAME = "slots.json"
TARGET = "gemma3-270m"
#: prompt ids are drawn from here: ordinary tokens of Gemma-3's vocabulary
IDS = (1000, 200_000)


class _Calls(ModelWrapper):
    """The target, each :meth:`score` call recorded as ``(seconds, tokens fed,
    sessions, whether a session had its first call in it)``: calls without a first
    one are rounds after every prompt's evaluation (or re-evaluations)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls: list[tuple[float, int, int, bool]] = []
        self._seen: set[int] = set()

    def score(self, batch: Any) -> list[np.ndarray]:
        sessions: list[Session] = [s for s, _ in batch]
        first = any(id(s) not in self._seen for s in sessions)
        self._seen.update(id(s) for s in sessions)
        inner: Any = self.inner
        fed, t0 = inner.tokens_fed, time.perf_counter()
        out = inner.score(batch)
        self.calls.append((time.perf_counter() - t0, inner.tokens_fed - fed, len(sessions),
                           first))
        return out


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(i) for i in rng.integers(*IDS, size=length)] for _ in range(n)]


async def _run_one(slots: int, prompts: list[list[int]], tokens: int, threads: int,
                   context: int) -> dict[str, Any]:
    from xcosd.config import GenerationConfig
    from xcosd.models import load_model
    from xcosd.models.llama_cpp_model import LlamaCppModel
    from xcosd.models.synthetic import SyntheticModel
    from xcosd.nodes import CloudNode, EdgeNode
    from xcosd.vocab import VocabMap

    target = load_model(f"{TARGET}@llama.cpp", threads=threads, context=context,
                        sequences=slots)
    assert isinstance(target, LlamaCppModel)
    draft = SyntheticModel(target.vocab, name="no-draft")
    vmap = VocabMap(draft.vocab, target.vocab)
    cfg = GenerationConfig(method="ar", max_new_tokens=tokens, do_sample=False,
                                 ignore_eos=True)
    timed = _Calls(target)
    try:
        async with contextlib.AsyncExitStack() as stack:
            cloud = await stack.enter_async_context(CloudNode(
                target=timed, bind="tcp://127.0.0.1:0", max_sessions=4 * len(prompts)))
            edges = [await stack.enter_async_context(EdgeNode(
                draft=draft, connect=cloud.endpoint, vocab_map=vmap, config=cfg))
                for _ in prompts]
            await edges[0].generate(prompts[0][:8], max_new_tokens=2)  # warm: first decode
            t = target  # the counters: decodes, tokens fed, sessions evicted
            before = (t.decodes, t.tokens_fed, t.evictions)
            timed.calls.clear()
            t0 = time.perf_counter()
            results = await asyncio.gather(*[e.generate(p) for e, p in
                                             zip(edges, prompts, strict=True)])
            wall = time.perf_counter() - t0
    finally:
        target.close()
    decodes, fed, evicted = (t.decodes - before[0], t.tokens_fed - before[1],
                             t.evictions - before[2])
    generated = sum(len(r.token_ids) for r in results)
    floor = sum(len(p) for p in prompts) + generated
    rounds = [c for c in timed.calls if not c[3]]
    return {"slots": slots, "sessions": len(prompts), "wall_s": wall, "generated": generated,
            "tokens_per_s": generated / wall, "decodes": decodes, "tokens_fed": fed,
            "fed_per_token": fed / generated, "floor_per_token": floor / generated,
            "over_floor": fed / floor, "evictions": evicted,
            "calls": len(timed.calls),
            "mean_batch": statistics.fmean(c[2] for c in timed.calls),
            "rounds": len(rounds),
            "round_ms": 1000 * statistics.fmean(c[0] for c in rounds) if rounds else 0.0,
            "round_fed": statistics.fmean(c[1] for c in rounds) if rounds else 0.0,
            "kv_bytes_per_cell": target.kv_bytes_per_cell}


def run(slots: list[int], sessions: int, prompt_tokens: int, tokens: int,
        threads: int) -> dict[str, Any]:
    prompts = _prompts(sessions, prompt_tokens)
    context = prompt_tokens + tokens + 16  # every session fits: only the slots differ
    rows = []
    for s in slots:
        row = asyncio.run(_run_one(s, prompts, tokens, threads, context))
        rows.append(row)
        print(f"  {s:2d} slots: {row['evictions']:5d} evictions, {row['fed_per_token']:6.1f} "
              f"fed per token, {row['round_ms']:7.1f} ms per round, "
              f"{row['tokens_per_s']:6.1f} tok/s", flush=True)
    return {"schema_version": 1, "model": f"{TARGET}@llama.cpp", "sessions": sessions,
            "prompt_tokens": prompt_tokens, "tokens": tokens, "threads": threads,
            "context": context, "rows": rows, "machine": machine()}


def _reference(rep: dict[str, Any]) -> dict[str, Any]:
    """The row whose slots hold every session (else the one with the most slots)."""
    fits = [r for r in rep["rows"] if r["slots"] >= rep["sessions"]]
    return min(fits, key=lambda r: r["slots"]) if fits else max(rep["rows"],
                                                                key=lambda r: r["slots"])


def format_report(rep: dict[str, Any], markdown: bool = False) -> str:
    ref = _reference(rep)
    rows = [[r["slots"], r["evictions"], f"{r['fed_per_token']:.1f}", f"{r['over_floor']:.2f}",
             f"{r['mean_batch']:.1f}", f"{r['round_fed']:.0f}", f"{r['round_ms']:.0f}",
             f"{r['tokens_per_s']:.2f}", f"{r['round_ms'] / ref['round_ms']:.1f}x",
             f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x"] for r in rep["rows"]]
    return table(rows, ["slots", "evictions", "fed/token", "fed/floor", "batch", "fed/round",
                        "ms/round", "tok/s", f"round vs {ref['slots']}",
                        f"tok/s vs {ref['slots']}"], markdown=markdown)


def section_lines(rep: dict[str, Any] | None) -> list[str]:
    if rep is None:
        return []
    ref = _reference(rep)
    short = sorted((r for r in rep["rows"] if r["slots"] < rep["sessions"]),
                   key=lambda r: r["slots"])
    kib = ref["kv_bytes_per_cell"] / 1024
    threads = f"{rep['threads']} thread{'s' * (rep['threads'] != 1)}"
    lines = [HEADING, "",
             f"From `python -m xcosd.bench.slots` (bench/out/{OUT_NAME}): {rep['model']}, "
             f"{threads}, the target of a cloud in the bench's process with `--slots` "
             f"sequences that keep a cache; {rep['sessions']} sessions at once, each from "
             f"{rep['prompt_tokens']} prompt tokens of its own, `ar` greedy for "
             f"{rep['tokens']} tokens each (a resident session feeds one token a round, so "
             "everything fed above the floor, the prompts once and one per token, is a "
             "session evaluated again after its eviction). `fed/round` and `ms/round`: the "
             "target's calls after every prompt's first evaluation (each call a round of "
             "every session: `batch`). One run per row over the same prompts.", "",
             format_report(rep, markdown=True), ""]
    for r in short:
        again = (r["round_fed"] - ref["round_fed"]) / (rep["prompt_tokens"] + rep["tokens"] / 2)
        lines.append(
            f"- {r['slots']} slots for {rep['sessions']} sessions: about {again:.0f} sessions "
            f"evaluated again each round ({r['round_fed']:.0f} tokens fed a round against "
            f"{ref['round_fed']:.0f}), a round {r['round_ms'] / ref['round_ms']:.0f}x as long, "
            f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x the tokens/s.")
    lines += ["", "The cloud's batch holds every session; the llama.cpp backend decodes it in "
              "groups of its slots, and each group evicts the least recently used sessions, the "
              "ones the next round's first group needs again. What a re-evaluation costs grows "
              "with each session's context, so the figures above (short prompts, to keep the "
              "run to minutes) are the least of it. A slot costs its context's KV cache up "
              f"front ({kib:.0f} KiB a position for this model): `xcosd serve --slots N` "
              "(1..64, default 8) and `--context` are the operator's trade between that "
              "memory and the re-evaluation, and the slots want to be at least the sessions "
              "the cloud serves at once.", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.slots", description=__doc__.splitlines()[0])
    ap.add_argument("--slots", default="4,8,12")
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=OUT_DIR / OUT_NAME)
    a = ap.parse_args(argv)
    rep = run([int(x) for x in a.slots.split(",")], a.sessions, a.prompt_tokens, a.tokens,
              a.threads)
    print(format_report(rep))
    write_json(a.json, rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
