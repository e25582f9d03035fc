"""The OpenAI-compatible API against the edge's own ``stream``, in one run.

    .venv/bin/python -m xcosd.bench.http_api [--tokens 64] [--passes 5]

One edge in this process, serving the HTTP API (uvicorn on loopback), and its cloud
in a process of its own, over ZeroMQ loopback, with each of :data:`PAIRS`. For 1 and
16 concurrent streams, the same seeded prompts run in process through
``EdgeNode.generate``, its text read from a queue as ``EdgeNode.stream`` hands it
over, and through ``POST /v1/completions`` with ``"stream": true`` from the official
``openai`` client in a process of its own (as an application would be; it is started
and warmed before its timing begins), alternating which goes first from pass to
pass. Reported: tokens/s (all streams' tokens over the wall time), the median time
to the first text, the ratios HTTP / in process (medians over passes of the ratio
within a pass), the client's own time to send its requests and the time to first
text from then, the 16-stream difference with the edge's opens unheld
(``arrivals.hold_s = 0``: each goes as soon as it is drafted) as a third arm in the
same passes, and the client process's CPU while it streams, as a fraction of a
core. Seeded, so both paths generate the same tokens, and with ``ignore_eos``, so
every stream runs its full length (a stream that ended after a few tokens would
time its first token alone).
Prints and writes ``bench/out/http_api.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import importlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

from xcosd.bench.report import OUT_DIR, machine, table, write_json

OUT = OUT_DIR / "http_api.json"
HEADING = "## OpenAI-compatible API"
#: how long a pair's cloud process may take to listen (the n-gram pair is built first)
CLOUD_START_S = 120.0
PROMPTS = ["The default value of the", "Return a new list", "If the argument is",
           "This module provides", "Raise an exception when", "The file object",
           "A string containing", "When the loop is"]


#: where the current stream's client notes when its request body was written (a
#: box set per stream, filled by the transport of :func:`_timed_transport`)
_SENT: contextvars.ContextVar[list[float]] = contextvars.ContextVar("sent")


def _timed_transport() -> Any:
    """An httpx transport that notes, in the calling stream's :data:`_SENT` box,
    when a request's body has been written: how long the client itself took to
    send what it was asked to (one client's concurrent requests are built one
    after another, and httpx writes a request's head and yields before its body)."""
    import openai

    # the HTTP package the openai client is built on (httpx, or its fork httpx2)
    hx = importlib.import_module(
        openai.DefaultAsyncHttpxClient.__mro__[1].__module__.partition(".")[0])

    class Noted(hx.AsyncByteStream):  # type: ignore[name-defined]
        def __init__(self, inner: Any, box: list[float]) -> None:
            self.inner, self.box = inner, box

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in self.inner:
                yield chunk
            self.box.append(time.perf_counter())  # the last chunk is written

    class Timed(hx.AsyncHTTPTransport):  # type: ignore[name-defined]
        async def handle_async_request(self, request: Any) -> Any:
            box = _SENT.get(None)
            if box is not None:
                request.stream = Noted(request.stream, box)
            return await super().handle_async_request(request)

    # the openai client's own pool limits
    return Timed(limits=hx.Limits(max_connections=1000, max_keepalive_connections=100))


class _Stream(NamedTuple):
    """One stream's times, in seconds from ``t0`` (when it was asked for)."""

    tokens: int
    first: float
    total: float
    #: until its request was written (0 in process: nothing to send)
    sent: float
    t0: float


async def _client(url: str, model: str, streams: int, tokens: int, seed0: int
                  ) -> dict[str, Any]:
    """The HTTP side of one setting, run in the client process."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(transport=_timed_transport()))
    # warmed as a running app's client is: a connection per stream in the pool, and
    # one streamed completion read through, so the client's first-use costs (its
    # lazy imports, its response types built) do not land on the first timed token
    await asyncio.gather(*[client.models.list() for _ in range(streams)])
    await _one_http(client, model, PROMPTS[0], 2, seed0 - 1)
    try:
        cpu0 = time.process_time()
        out = await _setting(lambda p, t, s: _one_http(client, model, p, t, s), streams,
                             tokens, seed0)
        # the client's own CPU over the timed streams: on two cores shared with a
        # pair that computes here, what it takes is what the models lose
        out["client_cpu_s"] = time.process_time() - cpu0
        return out
    finally:
        await client.close()


async def over_http(url: str, model: str, streams: int, tokens: int, seed0: int,
                    client: str = "xcosd.bench.http_api") -> dict[str, Any]:
    """One setting through HTTP, from a client process of its own (``python -m
    CLIENT --client URL ...``, which prints its report as its last line)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", client, "--client", url, "--model", model,
        "--streams", str(streams), "--tokens", str(tokens), "--seed", str(seed0),
        stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the HTTP client failed ({proc.returncode})")
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


async def _one_http(client: Any, model: str, prompt: str, tokens: int,
                    seed: int) -> _Stream:
    box: list[float] = []
    _SENT.set(box)
    t0 = time.perf_counter()
    first = None
    n = 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=tokens,
                                             seed=seed, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return _Stream(n, first or 0.0, time.perf_counter() - t0, (box[0] - t0) if box else 0.0,
                   t0)


async def _setting(run: Any, streams: int, tokens: int, seed0: int) -> dict[str, Any]:
    """One pass of ``streams`` concurrent streams, each a :class:`_Stream` of ``run``."""
    t0 = time.perf_counter()
    out: list[_Stream] = await asyncio.gather(*[run(PROMPTS[i % len(PROMPTS)], tokens, seed0 + i)
                                 for i in range(streams)])
    wall = time.perf_counter() - t0
    total = sum(r.tokens for r in out)
    return {"tok_s": total / wall, "tokens": total, "wall_s": wall,
            "ttft_ms": statistics.median(r.first for r in out) * 1e3,
            "ttft_mean_ms": statistics.fmean(r.first for r in out) * 1e3,
            "ttfts_ms": [round(r.first * 1e3, 2) for r in out],
            # how long the client took to send each request, and the time to first
            # text from then: what the server and the way back took
            "send_mean_ms": statistics.fmean(r.sent for r in out) * 1e3,
            "ttft_sent_ms": statistics.median(r.first - r.sent for r in out) * 1e3,
            "sends_ms": [round(r.sent * 1e3, 2) for r in out],
            # when the first request was written, after the first stream was asked for
            "first_send_ms": (min(r.t0 + r.sent for r in out) - min(r.t0 for r in out)) * 1e3}


#: the pairs measured: the embedded n-gram pair, whose cloud computes on this
#: machine's cores (the worst case for any overhead: the run is CPU-bound), and a
#: synthetic target that sleeps 20 ms a call plus 0.5 ms a row with a cost-free
#: synthetic draft, as a cloud on a machine of its own costs the edge no CPU
PAIRS = ("ngram", "remote")


def _pair(name: str) -> tuple[Any, Any]:
    """(draft, target) of one of :data:`PAIRS`."""
    from xcosd.models import default_pair
    from xcosd.models.synthetic import SyntheticModel

    if name == "ngram":
        return default_pair()
    target = SyntheticModel(256, a=0.020, b=0.0005, skew=1.1, name="synthetic-target")
    return SyntheticModel(256, skew=0.9, name="synthetic-draft"), target


async def _run(tokens: int, passes: int, concurrency: list[int],
               pairs: tuple[str, ...] = PAIRS) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for name in pairs:
        for row in await _run_pair(name, tokens, passes, concurrency):
            rows.append({"pair": name, **row})
    # the usage counts the tokens each HTTP stream generated: the same as in process
    return {"tokens_per_stream": tokens, "ignore_eos": True, "passes": passes, "rows": rows,
            "goals": {"ratio": 0.9, "ttft_delta_ms": 5.0}}


async def _run_pair(pair: str, tokens: int, passes: int,
                    concurrency: list[int]) -> list[dict[str, Any]]:
    from xcosd.nodes import EdgeNode

    draft, _ = _pair(pair)
    cloud = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "xcosd.bench.http_api", "--cloud", pair,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    try:
        assert cloud.stdout is not None
        line = (await asyncio.wait_for(cloud.stdout.readline(), CLOUD_START_S)).decode()
        if not line.startswith("cloud "):
            raise RuntimeError(f"the {pair} cloud did not start ({cloud.returncode})")
        async with EdgeNode(draft=draft, connect=line.split()[1]) as edge:
            return await _measure(edge, tokens, passes, concurrency)
    finally:
        await stop_cloud(cloud)


async def stop_cloud(cloud: asyncio.subprocess.Process) -> None:
    """End a cloud process started by this bench: its stdin closed is its signal to
    leave; killed if it has not within :data:`CLOUD_START_S`."""
    assert cloud.stdin is not None
    cloud.stdin.close()
    try:
        await asyncio.wait_for(cloud.wait(), CLOUD_START_S)
    except TimeoutError:
        cloud.kill()
        await cloud.wait()


async def _cloud(pair: str) -> None:
    """The cloud of one pair, in a process of its own (internal ``--cloud``), as a
    deployment's is: the edge's HTTP work does not share its event loop. It prints
    ``cloud <endpoint>`` once it listens and serves until its stdin closes."""
    from xcosd.nodes import CloudNode

    _, target = _pair(pair)
    async with CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud:
        print("cloud", cloud.endpoint, flush=True)
        # until the bench closes its end of the pipe, or dies (no cloud left behind)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)


async def _measure(edge: Any, tokens: int, passes: int,
                   concurrency: list[int]) -> list[dict[str, Any]]:
    """Every setting of one pair, through ``edge``."""
    from xcosd.api import OpenAIApp
    from xcosd.http import HttpServer

    rows: list[dict[str, Any]] = []
    api = OpenAIApp(edge)
    async with HttpServer(api) as http:

        async def inproc(p: str, t: int, s: int) -> _Stream:
            # as an application streams in process (EdgeNode.stream): the text
            # reaches the consumer through a queue, a turn of the loop after
            # the node commits it; generate's result gives the exact token count
            t0 = time.perf_counter()
            pieces: asyncio.Queue[str] = asyncio.Queue()
            task = asyncio.ensure_future(edge.generate(p, max_new_tokens=t, seed=s,
                                                       on_text=pieces.put_nowait,
                                                       ignore_eos=True))
            waiter = asyncio.ensure_future(pieces.get())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            first = time.perf_counter() - t0
            waiter.cancel()
            res = await task
            return _Stream(res.stats.tokens, first, time.perf_counter() - t0, 0.0, t0)

        # warm both paths (connections, caches) before measuring
        await _setting(inproc, 2, 8, 1)
        await over_http(http.url, api.model, 2, 8, 1)
        hold = edge.arrivals.hold_s
        for c in concurrency:
            per: dict[str, list[dict[str, Any]]] = {"inproc": [], "http": []}
            if c > 1:
                per["unheld"] = []
            for k in range(passes):
                order = list(per)
                if k % 2:
                    order.reverse()
                for name in order:
                    seed0 = 1000 * (k + 1)
                    if name == "inproc":
                        per[name].append(await _setting(inproc, c, tokens, seed0))
                        continue
                    # "unheld": every open goes as soon as it is drafted, not with
                    # those of the requests that arrived beside it (xcosd/nodes/arrivals.py)
                    edge.arrivals.hold_s = 0.0 if name == "unheld" else hold
                    try:
                        per[name].append(await over_http(http.url, api.model, c, tokens,
                                                          seed0))
                    finally:
                        edge.arrivals.hold_s = hold
            ratios = [h["tok_s"] / i["tok_s"] for h, i in zip(per["http"], per["inproc"],
                                                             strict=True)]
            ttft_d = [h["ttft_ms"] - i["ttft_ms"] for h, i in zip(per["http"], per["inproc"],
                                                                 strict=True)]
            sent_d = [h["ttft_sent_ms"] - i["ttft_ms"]
                      for h, i in zip(per["http"], per["inproc"], strict=True)]
            rows.append({
                "streams": c,
                "inproc_tok_s": statistics.median(r["tok_s"] for r in per["inproc"]),
                "http_tok_s": statistics.median(r["tok_s"] for r in per["http"]),
                "inproc_ttft_ms": statistics.median(r["ttft_ms"] for r in per["inproc"]),
                "http_ttft_ms": statistics.median(r["ttft_ms"] for r in per["http"]),
                "ratio": statistics.median(ratios),
                "ttft_delta_ms": statistics.median(ttft_d),
                # the client's own part of it: how long after a stream was asked
                # for its request had been sent (mean over streams)
                "send_ms": statistics.median(h["send_mean_ms"] for h in per["http"]),
                "first_send_ms": statistics.median(h["first_send_ms"] for h in per["http"]),
                # and the rest: from the request sent to its first text, against
                # the time to first text in process
                "ttft_delta_sent_ms": statistics.median(sent_d),
                # the fraction of a core the client process used while it streamed
                "client_cpu_share": statistics.median(
                    h["client_cpu_s"] / h["wall_s"] for h in per["http"]),
                **({"unheld_ttft_ms": statistics.median(r["ttft_ms"] for r in per["unheld"]),
                    "unheld_delta_ms": statistics.median(
                        u["ttft_ms"] - i["ttft_ms"]
                        for u, i in zip(per["unheld"], per["inproc"], strict=True))}
                   if "unheld" in per else {}),
                # how long a held open may wait now: the cloud's least recent call time
                "open_bound_ms": edge.arrivals.bound_s * 1e3,
                "passes": per})
    return rows


def format_report(rep: dict[str, Any], markdown: bool = False) -> str:
    head = ["pair", "streams", "in process tok/s", "HTTP tok/s", "ratio", "TTFT in process ms",
            "TTFT HTTP ms", "TTFT difference ms", "client's send ms",
            "difference once sent ms", "difference, opens unheld ms", "client CPU"]
    body = [[r.get("pair", "ngram"), r["streams"], f"{r['inproc_tok_s']:.1f}", f"{r['http_tok_s']:.1f}",
             f"{r['ratio']:.2f}x", f"{r['inproc_ttft_ms']:.1f}", f"{r['http_ttft_ms']:.1f}",
             f"{r['ttft_delta_ms']:+.1f}",
             f"{r['send_ms']:.1f}" if "send_ms" in r else "",
             f"{r['ttft_delta_sent_ms']:+.1f}" if "ttft_delta_sent_ms" in r else "",
             f"{r['unheld_delta_ms']:+.1f}" if "unheld_delta_ms" in r else "",
             f"{r['client_cpu_share']:.0%}" if "client_cpu_share" in r else ""]
            for r in rep["rows"]]
    return table(body, head, markdown=markdown)


def _client_cpu_lines(rep: dict[str, Any]) -> list[str]:
    """What the client's own CPU says about the CPU-bound pair's ratio."""
    shares = [(r["streams"], r["client_cpu_share"], r["ratio"]) for r in rep["rows"]
              if r.get("pair", "ngram") == "ngram" and "client_cpu_share" in r]
    if not shares:
        return []
    each = " and ".join(f"{s:.0%} of a core at {c} stream{'s' if c > 1 else ''} (ratio "
                        f"{q:.2f}x)" for c, s, q in shares)
    return ["On `ngram` the client process itself (the `openai` package reading and "
            f"parsing each chunk) used {each}. Both models compute on the same two cores, "
            "so that CPU is taken from them whatever the server does; with the cloud's "
            "compute elsewhere (`remote`) only the edge's drafting shares the cores with "
            "the client.", ""]


def _burst_lines(rep: dict[str, Any]) -> list[str]:
    """What the 16-stream rows say about one client's burst of requests."""
    rows = [r for r in rep["rows"] if r["streams"] > 1 and "send_ms" in r]
    if not rows:
        return []
    each = "; ".join(
        f"`{r.get('pair', 'ngram')}` {r['ttft_delta_ms']:+.1f} ms, of which the client's "
        f"send {r['send_ms']:.1f} ms (once sent {r['ttft_delta_sent_ms']:+.1f} ms"
        + (f"; opens unheld {r['unheld_delta_ms']:+.1f} ms" if "unheld_delta_ms" in r else "")
        + ")" for r in rows)
    bounds = ", ".join(f"{r['open_bound_ms']:.1f} ms on `{r.get('pair', 'ngram')}`"
                       for r in rows if "open_bound_ms" in r)
    first = ", ".join(f"{r['first_send_ms']:.1f} ms on `{r.get('pair', 'ngram')}`"
                      for r in rows if "first_send_ms" in r)
    return ["At 16 streams (each pass's per-stream times are in the JSON): " + each + ". In "
            "process every stream is asked for at once; one `openai` client builds its "
            "requests one after another and httpx writes each request's head and yields "
            "before its body, so no body leaves before every head is built"
            + (f" (the first body was written {first} after the first stream was asked for)"
               if first else "") + ". Without holding their opens the first request's open "
            "reaches the idle cloud alone and gets a target call of its own, and the others "
            "wait that whole call; held, they share the first call, and an early request's "
            "time once sent includes the wait for the later ones. The wait is bounded by the "
            "cloud's least recent call time, by its own account"
            + (f" ({bounds} at the end of the run)" if bounds else "") + ". On `ngram` the "
            "16 first rounds are drafted one after another in the edge's draft thread in "
            "both arms: through HTTP that chain starts only when the first body arrives, "
            "and the client's parsing and the server's work take their CPU from it on the "
            "same two cores.", ""]


def section_lines(rep: dict[str, Any] | None) -> list[str]:
    """The RESULTS.md section (empty without a report)."""
    if rep is None:
        return []
    goals = rep["goals"]

    def met(pair: str) -> str:
        rows = [r for r in rep["rows"] if r.get("pair", "ngram") == pair]
        if not rows:
            return "not measured"
        ok = all(r["ratio"] >= goals["ratio"] and r["ttft_delta_ms"] <= goals["ttft_delta_ms"]
                 for r in rows)
        return "met" if ok else "not met"

    return [HEADING, "",
            "From `python -m xcosd.bench.http_api` (bench/out/http_api.json): one edge "
            "serving the API, its cloud in a process of its own, over ZeroMQ loopback; the "
            "same seeded prompts streamed in process (`EdgeNode.generate`, its text read from "
            "a queue as `EdgeNode.stream` hands it over) and through `POST /v1/completions` "
            "(`stream: true`) from the official `openai` client in a process of its own, "
            "warmed as a running application's is (its connections open, one stream read "
            f"through), {rep['tokens_per_stream']} tokens a stream"
            + (" (`ignore_eos`: no stream ends early, so every pass times the same tokens)"
               if rep.get("ignore_eos") else "") + ", alternating over "
            f"{rep['passes']} passes (medians; the ratio and the differences are medians of "
            "those within a pass). *Client's send* is how long after a stream was asked for "
            "the client had written its request (the mean over streams, noted by the client's "
            "HTTP transport when the body's last byte is written). *Difference once sent* is "
            "the median time from a request's sending to its first text, against the time to "
            "first text in process: what the server, HTTP and the way back add. *Difference, "
            "opens unheld* is the TTFT difference of a third arm in the same passes, whose "
            "generations send their opens as soon as they are drafted rather than with those "
            "of the requests that arrived beside them (`EdgeNode.arrivals`, "
            "xcosd/nodes/arrivals.py). *Client CPU* is the client "
            "process's CPU time over its streams' wall time (the fraction of a core it used). "
            "Two pairs: `ngram`, the "
            "embedded pair, whose cloud computes on this machine's two cores beside the edge, "
            "the HTTP server and the client (CPU-bound: every microsecond of HTTP work is a "
            "microsecond the models lose); `remote`, a synthetic target sleeping 20 ms a call "
            "plus 0.5 ms a row and a cost-free synthetic draft, the shape of a deployment "
            "whose cloud runs on a machine of its own.", "",
            format_report(rep, markdown=True), "",
            *_burst_lines(rep),
            *_client_cpu_lines(rep),
            f"Goals: HTTP at least {goals['ratio']}x the in-process tokens/s and its time to "
            f"first token within {goals['ttft_delta_ms']:g} ms: {met('remote')} with the "
            f"cloud's compute elsewhere (`remote`), {met('ngram')} when it shares the two "
            "cores (`ngram`)." + _sent_goal(rep), ""]


def _sent_goal(rep: dict[str, Any]) -> str:
    """The time-to-first-token goal counted from each request's sending."""
    rows = [r for r in rep["rows"] if "ttft_delta_sent_ms" in r]
    if not rows:
        return ""
    limit = rep["goals"]["ttft_delta_ms"]
    within = [f"`{r.get('pair', 'ngram')}` {r['streams']}" for r in rows
              if r["ttft_delta_sent_ms"] <= limit]
    return (f" Counted from each request's sending, the difference is within {limit:g} ms "
            f"in {len(within)} of {len(rows)} rows" + (f" ({', '.join(within)})" if within
                                                       else "") + ".")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.http_api", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--pairs", default=",".join(PAIRS), help="comma list of " + ", ".join(PAIRS))
    ap.add_argument("--json", default=str(OUT))
    # the client process of one HTTP setting (internal)
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cloud", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--streams", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cloud is not None:
        asyncio.run(_cloud(args.cloud))
        return 0
    if args.client is not None:
        print(json.dumps(asyncio.run(_client(args.client, args.model, args.streams,
                                             args.tokens, args.seed))))
        return 0
    rep = asyncio.run(_run(args.tokens, args.passes,
                           [int(c) for c in args.concurrency.split(",")],
                           tuple(args.pairs.split(","))))
    rep["machine"] = machine()
    print(format_report(rep))
    write_json(Path(args.json), rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
