"""Many concurrent streams through one edge's HTTP API: every one complete and exact.

    xcosd bench http-streams [--streams 1000] [--tokens 32] [--pair ngram]
    .venv/bin/python -m xcosd.bench.http_streams ...

One edge in this process serves the OpenAI-compatible API (uvicorn on loopback,
``max_in_flight`` and the connection caps raised to the number of streams); its
cloud runs in a process of its own over ZeroMQ loopback (one of
``xcosd.bench.http_api``'s pairs); a client process of its own opens every stream at
once (``POST /v1/completions``, ``"stream": true``, each prompt with its own seed and
``ignore_eos``, so each runs its full length) and reads them all through with
httpx. Then the edge generates each seed's text in process with
``EdgeNode.generate``, and every stream's text must equal it.

Reported: streams that failed (an HTTP status other than 200, an error event, no
``[DONE]``, a broken connection) and texts that differ from ``generate``'s; each
stream's time to first text and tokens/s (tokens over its whole time) as
percentiles; the whole pass's tokens/s; and the edge process's resident memory
(sampled every 50 ms) before, at its peak and after, with the peak's growth per
stream. The process holds the edge and its HTTP server (the cloud and the client
are elsewhere), so its growth is what the streams cost the edge.
Prints and writes ``bench/out/http_streams.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from xcosd.bench.http_api import CLOUD_START_S, PAIRS, PROMPTS, _pair, over_http, stop_cloud
from xcosd.bench.report import OUT_DIR, machine, table, write_json

OUT = OUT_DIR / "http_streams.json"
HEADING = "## Concurrent streams through one edge"
#: the goals: no stream lost or wrong, and what HTTP holds of the edge's memory, beyond
#: what the same generations take in process, bounded per stream
GOALS = {"errors": 0, "mismatched": 0, "http_rss_kib_per_stream": 256.0}


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ------------------------------------------------------------------ the client


async def _one(client: Any, model: str, prompt: str, tokens: int, seed: int
               ) -> dict[str, Any]:
    """One stream, read through: its text, tokens and times, or its error."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    n = 0
    done = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"seed": seed, "error": f"status {r.status_code}: "
                                               f"{(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return {"seed": seed, "error": chunk["error"]["message"]}
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if first is None:
                        first = time.perf_counter() - t0
                    parts.append(chunk["choices"][0]["text"])
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
    except Exception as e:  # a broken connection counts against the server
        return {"seed": seed, "error": f"{type(e).__name__}: {e}"}
    total = time.perf_counter() - t0
    if not done:
        return {"seed": seed, "error": "the stream ended without [DONE]"}
    return {"seed": seed, "text": "".join(parts), "tokens": n, "ttft_s": first or total,
            "total_s": total}


async def _client(url: str, model: str, streams: int, tokens: int, seed0: int
                  ) -> dict[str, Any]:
    """Every stream at once, from this (client) process."""
    import httpx

    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        await _one(client, model, PROMPTS[0], 2, seed0 - 1)  # warm: imports, one connection
        t0 = time.perf_counter()
        out = await asyncio.gather(*[_one(client, model, PROMPTS[i % len(PROMPTS)], tokens,
                                          seed0 + i) for i in range(streams)])
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "streams": out}


# ------------------------------------------------------------------ the edge


async def _cloud(pair: str, streams: int) -> None:
    """The cloud (internal ``--cloud``), with sessions for every stream; prints
    ``cloud <endpoint>`` and serves until its stdin closes."""
    from xcosd.nodes import CloudNode

    _, target = _pair(pair)
    async with CloudNode(target=target, bind="tcp://127.0.0.1:0", max_sessions=2 * streams + 64,
                         max_sessions_per_peer=streams + 64) as cloud:
        print("cloud", cloud.endpoint, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)


async def _run(pair: str, streams: int, tokens: int, seed0: int) -> dict[str, Any]:
    from xcosd.api import OpenAIApp, RequestLimits
    from xcosd.http import ConnectionLimits, HttpServer
    from xcosd.nodes import EdgeNode

    draft, _ = _pair(pair)
    cloud = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "xcosd.bench.http_streams", "--cloud", pair,
        "--streams", str(streams), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    try:
        assert cloud.stdout is not None
        line = (await asyncio.wait_for(cloud.stdout.readline(), CLOUD_START_S)).decode()
        if not line.startswith("cloud "):
            raise RuntimeError(f"the {pair} cloud did not start ({cloud.returncode})")
        async with EdgeNode(draft=draft, connect=line.split()[1]) as edge:
            api = OpenAIApp(edge, max_in_flight=streams,
                            limits=RequestLimits(max_tokens=max(tokens, 4096)))
            limits = ConnectionLimits(max_connections=streams + 16,
                                      max_per_address=streams + 16)
            async with HttpServer(api, limits=limits) as http:
                # warmed first (the pair's tables, the first streams' buffers), so the
                # memory measured is what the streams hold
                await _over_http(http.url, api.model, 16, tokens, seed0 - 100)
                rss0 = _rss_mib()
                # each seed's text as the edge's own generate gives it, all at once: the
                # memory the same generations take without HTTP
                own, inproc_peak = await _peak_rss(asyncio.gather(*[edge.generate(
                    PROMPTS[i % len(PROMPTS)], max_new_tokens=tokens, seed=seed0 + i,
                    ignore_eos=True) for i in range(streams)]))
                inproc_after = _rss_mib()
                got, http_peak = await _peak_rss(
                    _over_http(http.url, api.model, streams, tokens, seed0))
                rss_after = _rss_mib()
                refused = http.slots.refused
    finally:
        await stop_cloud(cloud)
    errors = [s for s in got["streams"] if "error" in s]
    done = [s for s in got["streams"] if "error" not in s]
    mismatched = [s["seed"] for s in done if s["text"] != own[s["seed"] - seed0].text]
    ttft = [s["ttft_s"] * 1e3 for s in done]
    rate = [s["tokens"] / s["total_s"] for s in done if s["total_s"] > 0]
    total_tokens = sum(s["tokens"] for s in done)
    return {
        "pair": pair, "streams": streams, "tokens_per_stream": tokens,
        "errors": len(errors), "error_samples": [e["error"] for e in errors[:5]],
        "mismatched": len(mismatched), "mismatched_seeds": mismatched[:20],
        "refused_connections": refused,
        "wall_s": got["wall_s"], "tok_s": total_tokens / got["wall_s"],
        "tokens": total_tokens,
        "ttft_ms": {q: _pct(ttft, p) for q, p in (("p50", .5), ("p90", .9), ("p99", .99),
                                                   ("max", 1.0))} if ttft else {},
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
        "stream_tok_s": {q: _pct(rate, p) for q, p in (("p10", .1), ("p50", .5),
                                                       ("p90", .9))} if rate else {},
        # the edge process's memory: before, at the peak of the streams in process,
        # after them, at the peak of the same streams through HTTP, after those
        "rss_mib": {"before": rss0, "inproc_peak": inproc_peak, "inproc_after": inproc_after,
                    "http_peak": http_peak, "after": rss_after},
        "rss_kib_per_stream": (max(inproc_peak, http_peak) - rss0) * 1024 / streams,
        # what HTTP held beyond the generations' own (the allocator keeps what the
        # in-process pass freed, so the HTTP pass reuses it)
        "http_rss_kib_per_stream": max(0.0, http_peak - max(inproc_peak, inproc_after))
        * 1024 / streams,
        "per_stream": [{"seed": s["seed"], "ttft_ms": round(s["ttft_s"] * 1e3, 2),
                        "tok_s": round(s["tokens"] / s["total_s"], 2), "tokens": s["tokens"]}
                       for s in done],
        "goals": GOALS,
    }


async def _peak_rss(work: Any) -> tuple[Any, float]:
    """``work``'s result and this process's peak resident MiB while it ran (sampled
    every 50 ms)."""
    peak = _rss_mib()
    task = asyncio.ensure_future(work)
    while not task.done():
        peak = max(peak, _rss_mib())
        await asyncio.wait({task}, timeout=0.05)
    return task.result(), max(peak, _rss_mib())


async def _over_http(url: str, model: str, streams: int, tokens: int, seed0: int
                     ) -> dict[str, Any]:
    return await over_http(url, model, streams, tokens, seed0, client="xcosd.bench.http_streams")


# ------------------------------------------------------------------ reporting


def format_report(rep: dict[str, Any]) -> str:
    t, r, m = rep["ttft_ms"], rep["stream_tok_s"], rep["rss_mib"]
    rows = [[rep["pair"], rep["streams"], rep["tokens_per_stream"], rep["errors"],
             rep["mismatched"], f"{rep['tok_s']:.0f}", f"{t.get('p50', 0):.0f}",
             f"{t.get('p90', 0):.0f}", f"{t.get('p99', 0):.0f}", f"{r.get('p10', 0):.1f}",
             f"{r.get('p50', 0):.1f}",
             f"{m['before']:.0f} / {m['inproc_peak']:.0f} / {m['http_peak']:.0f} / "
             f"{m['after']:.0f}", f"{rep['rss_kib_per_stream']:.0f}",
             f"{rep['http_rss_kib_per_stream']:.0f}"]]
    return table(rows, ["pair", "streams", "tokens each", "errors", "mismatched", "tok/s",
                        "TTFT p50 ms", "p90", "p99", "stream tok/s p10", "p50",
                        "edge RSS MiB: before / peak in process / peak HTTP / after",
                        "KiB a stream", "HTTP's KiB a stream"], markdown=True)


def met(rep: dict[str, Any]) -> bool:
    return (rep["errors"] == 0 and rep["mismatched"] == 0
            and rep["http_rss_kib_per_stream"] <= GOALS["http_rss_kib_per_stream"])


def section_lines(rep: dict[str, Any] | None) -> list[str]:
    """The RESULTS.md section (empty without a report)."""
    if rep is None:
        return []
    m = rep["rss_mib"]
    return [HEADING, "",
            "From `xcosd bench http-streams` (bench/out/http_streams.json): "
            f"{rep['streams']} streams opened at once through one edge's OpenAI-compatible "
            "API (`POST /v1/completions`, `stream: true`, each with its own seed and "
            f"`ignore_eos`, {rep['tokens_per_stream']} tokens each), read by httpx in a "
            "client process of its own, the cloud in another (`" + rep["pair"] + "` pair, "
            "ZeroMQ loopback); every stream's text compared with `EdgeNode.generate`'s for "
            "its seed. TTFT is each stream's time from its request to its first text, "
            "stream tok/s its tokens over its whole time. The edge's RSS is its process's "
            "(the edge and its HTTP server), sampled every 50 ms: after a warm-up of 16 "
            "streams, at its peak while the same generations run in process (all at once, "
            "`EdgeNode.generate`), then at its peak while they run through HTTP, and after. "
            "*KiB a stream* is the highest peak's growth over the streams; *HTTP's* is the "
            "HTTP pass's peak over the in-process pass's (the allocator keeps what the first "
            "pass freed and the second reuses it, so what is left is what HTTP held).", "",
            format_report(rep), "",
            f"The edge's memory at the peak, {rep['rss_kib_per_stream']:.0f} KiB a stream, is "
            f"the generations' own: {m['inproc_peak'] - m['before']:.0f} MiB over the "
            f"{rep['streams']} in process, {m['http_peak'] - m['before']:.0f} MiB through "
            f"HTTP. Every stream is opened at once: the times to first text are those of "
            f"{rep['streams']} first rounds sharing the machine's cores with the cloud and "
            "the client.", "",
            f"Goals: no stream failed ({rep['errors']} did), none differed from `generate` "
            f"({rep['mismatched']} did), HTTP held at most "
            f"{GOALS['http_rss_kib_per_stream']:g} KiB of the edge's memory a stream beyond "
            f"the generations' own ({rep['http_rss_kib_per_stream']:.0f} KiB): "
            f"{'met' if met(rep) else 'not met'}. The HTTP pass took "
            f"{rep['wall_s']:.1f} s on the machine above, all "
            f"{rep['streams']} streams sharing its two cores with the cloud and the client.",
            ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.http_streams",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--pair", default="ngram", choices=PAIRS)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--json", default=str(OUT))
    # the client and the cloud processes (internal)
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cloud", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cloud is not None:
        asyncio.run(_cloud(args.cloud, args.streams))
        return 0
    if args.client is not None:
        print(json.dumps(asyncio.run(_client(args.client, args.model, args.streams,
                                             args.tokens, args.seed))))
        return 0
    rep = asyncio.run(_run(args.pair, args.streams, args.tokens, args.seed))
    rep["machine"] = machine()
    rep["command"] = "xcosd bench http-streams " + " ".join(argv or sys.argv[1:])
    print(format_report(rep))
    write_json(Path(args.json), rep)
    return 0 if met(rep) else 1


if __name__ == "__main__":
    raise SystemExit(main())
