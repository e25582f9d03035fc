"""Multi-turn chats through the OpenAI API: what reusing prefixes saves a turn.

    .venv/bin/python -m xcosd.bench.chat_turns [--turns 8] [--devices 16] \\
        [--system-tokens 400] [--turn-tokens 150] [--max-tokens 16]

SmolLM2-135M drafting for Gemma-3-270m, llama.cpp on both sides, one thread each.
The cloud's event loop runs in a thread of this process pinned to one core (its
scoring thread, made there, inherits the core), the edge, its HTTP API and the
``openai`` client on the other, so the counters of both models can be read
directly. Two parts, each run with prefix reuse on and off (``prefix_reuse`` on
both models; everything else equal):

1. **One chat, turn by turn.** A system prompt of about ``--system-tokens`` target
   tokens, then ``--turns`` user turns of about ``--turn-tokens`` each (paragraphs
   of CPython's own documentation), each answered through
   ``POST /v1/chat/completions`` with ``"stream": true``, seeded (the same answers
   in both arms: llama.cpp's rows do not depend on the cache they come from).
   Per turn: the time to the first streamed text, the prompt's tokens, the
   positions each side computed and took from cache, the edge's uplink bytes.
2. **Devices sharing a system prompt.** ``--devices`` edge nodes (a connection
   each) open their first turn at once, one system prompt and a question of their
   own: the positions the cloud computed, against the system prompt's length
   times the devices. (The devices share one draft model in this process, so its
   counts are not a device's and are left out.)

Goals: the first token of turn 8 at most 1.5x turn 1's with reuse; the shared
system prompt computed once; uplink bytes per turn in proportion to the new turn.
Prints and writes ``bench/out/chat_turns.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from xcosd.bench.real_pair import DRAFT, TARGET
from xcosd.bench.report import OUT_DIR, machine, table, write_json

HEADING = "## Multi-turn chats"
OUT_NAME = "chat_turns.json"
OUT = OUT_DIR / OUT_NAME
EDGE_CORE, CLOUD_CORE = 0, 1
#: the goal: turn 8's time to first token against turn 1's, with reuse
GOAL_TURN, GOAL_RATIO = 8, 1.5


def _pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def _paragraphs() -> list[str]:
    """Prose from CPython's own documentation (``pydoc_data.topics``)."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            text = " ".join(para.split())
            if len(text) > 200 and not text.startswith(("*", "-", ">>>")):
                out.append(text)
    return out


def _text_of(tokens: int, target: Any, paras: list[str], start: int) -> tuple[str, int]:
    """Paragraphs from ``start`` joined until about ``tokens`` target tokens; the
    text and the next paragraph's index."""
    text, i = "", start
    while len(target.tokenize(text)) < tokens:
        text = (text + " " + paras[i % len(paras)]).strip()
        i += 1
    ids = target.tokenize(text)[:tokens]
    return target.vocab.decode(ids).decode("utf-8", "replace"), i


class _Cloud:
    """A :class:`~xcosd.nodes.CloudNode` on an event loop of its own, in a thread
    pinned to the cloud's core."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.endpoint = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="bench-cloud", daemon=True)

    def _run(self) -> None:
        _pin(CLOUD_CORE)
        asyncio.run(self._main())

    async def _main(self) -> None:
        from xcosd.nodes import CloudNode

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with CloudNode(target=self.target, bind="tcp://127.0.0.1:0",
                             max_sessions=256) as cloud:
            self.endpoint = cloud.endpoint
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> _Cloud:
        self._thread.start()
        if not self._ready.wait(600):
            raise RuntimeError("the cloud did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)


def _prompt_bytes(edge: Any) -> int:
    """The uplink bytes that carried prompts: render requests and opens."""
    return sum(t.wire for k, t in edge.meter.up.items() if k in ("render", "open"))


async def _one_chat(draft: Any, target: Any, endpoint: str, system: str, turns: list[str],
                    max_tokens: int) -> list[dict[str, Any]]:
    import openai

    from xcosd.api import OpenAIApp
    from xcosd.http import HttpServer
    from xcosd.nodes import EdgeNode

    rows = []
    async with EdgeNode(draft, endpoint, connect_timeout_s=600.0, silence_timeout_s=600.0) as edge, \
            HttpServer(OpenAIApp(edge)) as http:
        client = openai.AsyncOpenAI(base_url=f"{http.url}/v1", api_key="none",
                                    timeout=600.0, max_retries=0)
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        for k, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            before = (target.tokens_fed, target.reused_tokens, draft.tokens_fed,
                      draft.reused_tokens, edge.meter.up_bytes, edge.meter.down_bytes,
                      _prompt_bytes(edge))
            t0 = time.perf_counter()
            first = None
            text = []
            usage = None
            req: dict[str, Any] = {
                "model": TARGET, "messages": messages, "max_tokens": max_tokens, "stream": True,
                "seed": 1000 + k, "temperature": 0.7, "stream_options": {"include_usage": True}}
            stream: Any = await client.chat.completions.create(**req)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter() - t0
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
            total = time.perf_counter() - t0
            answer = "".join(text)
            messages.append({"role": "assistant", "content": answer})
            rows.append({
                "turn": k + 1, "ttft_s": first if first is not None else total,
                "total_s": total,
                "prompt_tokens": usage.prompt_tokens if usage else None,
                "completion_tokens": usage.completion_tokens if usage else None,
                "cloud_computed": target.tokens_fed - before[0],
                "cloud_reused": target.reused_tokens - before[1],
                "edge_computed": draft.tokens_fed - before[2],
                "edge_reused": draft.reused_tokens - before[3],
                "up_bytes": edge.meter.up_bytes - before[4],
                "down_bytes": edge.meter.down_bytes - before[5],
                "prompt_up_bytes": _prompt_bytes(edge) - before[6],
                "answer_chars": len(answer)})
            print(f"  turn {k + 1}: ttft {rows[-1]['ttft_s']:.2f} s, prompt "
                  f"{rows[-1]['prompt_tokens']}, cloud computed {rows[-1]['cloud_computed']}, "
                  f"up {rows[-1]['up_bytes']} B", flush=True)
        await client.close()
    return rows


async def _devices(draft: Any, target: Any, endpoint: str, system: str, questions: list[str],
                   max_tokens: int) -> dict[str, Any]:
    from xcosd.nodes import EdgeNode

    edges = [EdgeNode(draft, endpoint, connect_timeout_s=600.0, silence_timeout_s=600.0)
             for _ in questions]
    for e in edges:
        await e.start()
    try:
        before = target.tokens_fed, target.reused_tokens
        t0 = time.perf_counter()

        async def one(edge: EdgeNode, q: str, i: int) -> float:
            ids = await edge.chat_prompt([{"role": "system", "content": system},
                                          {"role": "user", "content": q}])
            t = time.perf_counter()
            first: list[float] = []
            await edge.generate(ids, max_new_tokens=max_tokens, seed=i, temperature=0.7,
                                on_text=lambda _s: first.append(time.perf_counter()) if not first
                                else None)
            return (first[0] if first else time.perf_counter()) - t

        ttfts = await asyncio.gather(*[one(e, q, i) for i, (e, q) in
                                       enumerate(zip(edges, questions, strict=True))])
        wall = time.perf_counter() - t0
        return {"devices": len(edges), "cloud_computed": target.tokens_fed - before[0],
                "cloud_reused": target.reused_tokens - before[1], "wall_s": wall,
                "ttft_median_s": statistics.median(ttfts)}
    finally:
        for e in edges:
            await e.close()


def run(turns: int, devices: int, system_tokens: int, turn_tokens: int,
        max_tokens: int, context: int | None = None) -> dict[str, Any]:
    from xcosd.models import load_model

    _pin(EDGE_CORE)
    paras = _paragraphs()
    arms: dict[str, Any] = {}
    for reuse in (True, False):
        label = "reuse" if reuse else "no reuse"
        print(f"{label}:", flush=True)
        t0 = time.perf_counter()
        slots = max(8, min(64, devices + 2))
        sized: dict[str, Any] = {} if context is None else {"context": context}
        target = load_model(f"{TARGET}@llama.cpp", threads=1, sequences=slots,
                            prefix_reuse=reuse, **sized)
        draft = load_model(f"{DRAFT}@llama.cpp", threads=1, sequences=slots,
                           prefix_reuse=reuse, **sized)
        system, at = _text_of(system_tokens, target, paras, 0)
        chat_turns = []
        for _ in range(turns):
            t, at = _text_of(turn_tokens, target, paras, at)
            chat_turns.append(t)
        questions = [f"In one sentence: what is topic number {i}?" for i in range(devices)]
        with _Cloud(target) as cloud:
            rows = asyncio.run(_one_chat(draft, target, cloud.endpoint, system, chat_turns,
                                         max_tokens))
            # the shared prompt of part 2 is cached nowhere yet: another system prompt
            system2, _ = _text_of(system_tokens, target, paras, at + 7)
            shared = asyncio.run(_devices(draft, target, cloud.endpoint, system2, questions,
                                          max_tokens))
        shared["system_tokens"] = len(target.tokenize(system2))
        arms[label] = {"turns": rows, "shared": shared, "took_s": time.perf_counter() - t0,
                       "kv_context": getattr(target, "context", None),
                       "sequences": slots}
    on, off = arms["reuse"]["turns"], arms["no reuse"]["turns"]
    k = min(GOAL_TURN, len(on)) - 1
    ratio_on = on[k]["ttft_s"] / on[0]["ttft_s"]
    ratio_off = off[k]["ttft_s"] / off[0]["ttft_s"]
    return {"schema_version": 1, "draft": DRAFT, "target": TARGET, "backend": "llama.cpp",
            "threads_per_side": 1, "turns": turns, "devices": devices,
            "system_tokens": system_tokens, "turn_tokens": turn_tokens,
            "max_tokens": max_tokens, "arms": arms,
            "goal": {"turn": k + 1, "ratio_reuse": ratio_on, "ratio_no_reuse": ratio_off,
                     "ttft_speedup_at_turn": off[k]["ttft_s"] / on[k]["ttft_s"],
                     "target": GOAL_RATIO, "met": ratio_on <= GOAL_RATIO},
            "machine": machine()}


def report(rep: dict[str, Any]) -> str:
    on, off = rep["arms"]["reuse"]["turns"], rep["arms"]["no reuse"]["turns"]
    rows = []
    for a, b in zip(on, off, strict=True):
        rows.append([a["turn"], a["prompt_tokens"], f"{a['ttft_s']:.2f}", f"{b['ttft_s']:.2f}",
                     f"{b['ttft_s'] / a['ttft_s']:.1f}x", a["cloud_computed"],
                     b["cloud_computed"], a["edge_computed"], b["edge_computed"],
                     a["prompt_up_bytes"], 4 * a["prompt_tokens"], a["up_bytes"]])
    out = [table(rows, ["turn", "prompt", "TTFT reuse s", "TTFT none s", "speedup",
                        "cloud computed", "(none)", "edge computed", "(none)",
                        "prompt up B", "whole ids B", "all up B"], markdown=True)]
    out.append("(prompt up B: the render request and the open, by reference to the "
               "previous turn in both arms; whole ids B: what the prompt's ids alone cost an "
               "open that sends them whole, 4 bytes each, before the chat's text that a whole "
               "render sends too; all up B: the turn's every uplink message.)")
    g = rep["goal"]
    out.append(f"\nTurn {g['turn']}'s first token against turn 1's: {g['ratio_reuse']:.2f}x "
               f"with reuse, {g['ratio_no_reuse']:.2f}x without (goal at most "
               f"{g['target']}x: {'met' if g['met'] else 'not met'}); against turn 1 without "
               f"reuse (the first turn of a cold process is the slower one here): "
               f"{on[g['turn'] - 1]['ttft_s'] / off[0]['ttft_s']:.2f}x.")
    for label in ("reuse", "no reuse"):
        s = rep["arms"][label]["shared"]
        out.append(f"{s['devices']} devices opening at once with one system prompt of "
                   f"{s['system_tokens']} tokens, {label}: the cloud computed "
                   f"{s['cloud_computed']} positions, {s['cloud_computed'] - s['system_tokens']} "
                   "beyond one system prompt (each device's question, drafts and answer; "
                   f"{s['devices'] * s['system_tokens']} would be the prompt once a device), "
                   f"took {s['cloud_reused']} from cache; median first token "
                   f"{s['ttft_median_s']:.2f} s.")
    return "\n".join(out)


def section_lines(rep: dict[str, Any] | None) -> list[str]:
    """The RESULTS.md section."""
    if rep is None:
        return []
    return [HEADING, "",
            f"From `python -m xcosd.bench.chat_turns` (bench/out/{OUT_NAME}): "
            f"{rep['draft']} drafting for {rep['target']} on {rep['backend']}, "
            f"{rep['threads_per_side']} thread a side (the cloud's loop in a thread pinned to "
            "one core, the edge, its HTTP API and the `openai` client on the other). One chat: "
            f"a system prompt of {rep['system_tokens']} tokens, then {rep['turns']} user turns "
            f"of {rep['turn_tokens']} tokens, each answered streamed (`max_tokens` "
            f"{rep['max_tokens']}, seeded: the same answers in both arms), with prefix reuse "
            "on and off on both models. `TTFT`: the request to its first streamed text; "
            "`computed`: the positions each side's model computed for the turn (prompt, "
            "drafts and verification); `prompt up B`: the render request and the open on the "
            "uplink.", "", report(rep), ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--devices", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--turn-tokens", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--context", type=int, default=None,
                    help="positions per session on both models (default: the models' own)")
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args(argv)
    rep = run(args.turns, args.devices, args.system_tokens, args.turn_tokens, args.max_tokens,
              args.context)
    print(HEADING)
    print(report(rep))
    write_json(args.json, rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
