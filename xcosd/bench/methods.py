"""``xcosd bench methods``: every resampling method x codec x warper on real models.

For each (pair, method, codec, warper) the same prompts and seeds run through the
real edge and cloud state machines wired in process (:mod:`xcosd.nodes.pump`),
which gives acceptance, cloud target calls, wire bytes up and down (per token and
per rejection), follow-up round trips and the measured compute of each side. From
the recorded message sequence the link model (``RTT/2 + 8 * bytes / rate`` per
message, plus the measured compute) gives tokens/s at every downlink rate in one
run. The TV distance of the output to the target is *measured*
(:mod:`xcosd.bench.tv`). A subset also runs live, through a real
:class:`~xcosd.nodes.CloudNode` and :class:`~xcosd.nodes.EdgeNode` over ZeroMQ on
loopback with the link emulator, as a check of the model against reality.

Pairs: ``embedded`` (the default n-gram pair, o200k draft -> Llama 3 target) and
``real`` (SmolLM2-135M -> Gemma-3-270M, when their packages are installed).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import GenerationConfig, method_option_names
from ..methods import METHODS
from ..models.base import LanguageModel
from ..nodes.pump import Generation, Pump
from ..nodes.stats import merge
from ..policies.draft_length import DEFAULT_CONFIDENCE, DEFAULT_COST
from ..transport import LinkSpec
from ..vocab import VocabMap, Vocabulary
from .grid import CODECS, RATES_MBPS, RTT_MS, WARPERS, all_methods, codecs_for
from .report import machine, table
from .tv import context_rows, measure_tv

PROMPTS = (
    "The cloud server verifies a block of drafted tokens in one pass, and",
    "Once upon a time there was a",
    "Return a new list containing all items from the iterable in ascending order. A custom",
    "def merge_sorted(a, b):\n    ",
    "The history of the city begins in the",
    "In mathematics, a group is a set with an operation that",
    "She opened the door and saw",
    "The function returns",
)

#: the keys every record carries (``--json``), beyond its own extras
RECORD_KEYS = ("pair", "method", "codec", "warper", "acceptance_rate", "mean_acceptance_length",
               "uplink_bytes_per_token", "downlink_bytes_per_token",
               "downlink_bytes_per_rejection", "cloud_calls_per_token", "tv_to_target",
               "modeled_tokens_per_s")

PAIRS = {"embedded": "default_pair: ngram o200k/3 -> ngram llama3/4",
         "real": "smollm2-135m -> gemma3-270m",
         "real-llama.cpp": "smollm2-135m -> gemma3-270m, both on llama.cpp"}


@dataclass
class MethodsConfig:
    pairs: list[str] = field(default_factory=lambda: ["embedded"])
    methods: list[str] = field(default_factory=all_methods)
    codecs: list[str] = field(default_factory=lambda: list(CODECS))
    warpers: list[str] = field(default_factory=lambda: list(WARPERS))
    prompts: int = 4
    tokens: int = 48
    real_tokens: int = 16
    draft_len: int = 4
    #: the default draft-length policy (False: ``draft_len`` every round)
    adaptive_draft: bool = True
    draft_cost: float = DEFAULT_COST
    draft_confidence: float = DEFAULT_CONFIDENCE
    rates_mbps: list[float] = field(default_factory=lambda: list(RATES_MBPS))
    rtt_ms: float = RTT_MS
    tv_trials: int = 2000
    tv_contexts: int = 3
    tv_resolve: int = 100
    live_rate_mbps: float = 200.0
    #: "f32": each method with f32 at the first warper; "all"; "none"
    live: str = "f32"
    live_prompts: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        # each point of the grid is one generation's settings: GenerationConfig checks
        # them (method name, each (method, codec) pair, draft length, lengths) as it
        # does for EdgeNode and the CLI, instead of a second copy of those checks here
        for m in self.methods:
            method_option_names(m)  # an unknown method, named before codecs_for looks it up
            for c in codecs_for(m, self.codecs):
                GenerationConfig(method=m, codec=c, draft_len=self.draft_len,
                                 max_new_tokens=max(self.tokens, self.real_tokens))
        for w in self.warpers:
            if w not in WARPERS:
                raise ValueError(f"unknown warper {w!r}; known: {', '.join(WARPERS)}")
        for p in self.pairs:
            if p not in PAIRS:
                raise ValueError(f"unknown pair {p!r}; known: {', '.join(PAIRS)}")
        if self.live not in ("f32", "all", "none"):
            raise ValueError(f"live must be f32, all or none, got {self.live!r}")

    def generation(self, method: str, codec: str, warper: str, tokens: int) -> GenerationConfig:
        """The GenerationConfig of one point of the grid: the live runs pass it to
        ``EdgeNode.generate``, the in-process runs take its pieces
        (:meth:`~GenerationConfig.sampling_params`, ``draft_len``), so both run the
        same settings."""
        params = WARPERS[warper]
        return GenerationConfig(method=method, codec=codec, draft_len=self.draft_len,
                                adaptive_draft=self.adaptive_draft, draft_cost=self.draft_cost,
                                draft_confidence=self.draft_confidence,
                                temperature=params.temperature, top_k=params.top_k,
                                top_p=params.top_p, max_new_tokens=tokens)


def load_pair(name: str) -> tuple[LanguageModel, LanguageModel]:
    """``(draft, target)`` of a named pair (raises ModelError when not installed)."""
    from ..models import default_pair, load_model

    if name == "embedded":
        return default_pair()
    suffix = "@llama.cpp" if name == "real-llama.cpp" else ""
    draft = load_model("smollm2-135m" + suffix)
    draft.vocab = distinct_roles(draft.vocab)
    return draft, load_model("gemma3-270m" + suffix)


def distinct_roles(vocab: Vocabulary) -> Vocabulary:
    """``vocab`` with at most one role per special token.

    SmolLM2's tokenizer names ``<|im_end|>`` both ``eos`` and ``pad``; Gemma-3 has two
    tokens for them, so :class:`~xcosd.vocab.VocabMap` pairs one draft id with two
    target ids and the cloud refuses that map. Keeping only the first role of each
    id (``eos`` before ``pad``) gives a valid one-to-one map.
    """
    seen: set[int] = set()
    roles: dict[str, int] = {}
    for role in sorted(vocab.roles, key=lambda r: (r != "eos", r != "bos", r)):
        i = vocab.roles[role]
        if i not in seen:
            roles[role] = i
            seen.add(i)
    if len(roles) == len(vocab.roles):
        return vocab
    return Vocabulary(vocab.name, vocab.tokens, special=vocab.special_ids, roles=roles,
                      encoder=getattr(vocab, "_encoder", None))


def link_for(rate_mbps: float, rtt_ms: float) -> LinkSpec:
    """The modeled link: the same rate both ways (the downlink is what the methods
    differ in; a symmetric link keeps sd-uplink's uplink honest too)."""
    return LinkSpec.of(up_bps=rate_mbps * 1e6, down_bps=rate_mbps * 1e6, rtt_s=rtt_ms / 1e3)


def _record(pair: str, method: str, codec: str, warper: str, gens: list[Generation],
            cfg: MethodsConfig) -> dict[str, Any]:
    tot = merge([g.stats for g in gens])
    tok = max(1, tot.tokens)
    modeled = {}
    for rate in cfg.rates_mbps:
        link = link_for(rate, cfg.rtt_ms)
        secs = sum(g.modeled_s(link) for g in gens)
        modeled[f"{rate:g}"] = tot.tokens / secs if secs > 0 else 0.0
    m = METHODS[method]
    return {
        "pair": pair, "method": method, "codec": codec, "warper": warper,
        "lossless": m.lossless, "codec_applies_to": m.codec_applies_to,
        "generations": len(gens), "tokens": tot.tokens, "rounds": tot.rounds,
        "drafted": tot.drafted, "accepted": tot.accepted, "rejections": tot.rejections,
        "acceptance_rate": tot.accepted / tot.drafted if tot.drafted else 0.0,
        "mean_acceptance_length": 1.0 + tot.accepted / tot.rounds if tot.rounds else 0.0,
        "tokens_per_round": tot.tokens / tot.rounds if tot.rounds else 0.0,
        "uplink_bytes": tot.uplink_bytes, "downlink_bytes": tot.downlink_bytes,
        "uplink_bytes_per_token": tot.uplink_bytes / tok,
        "downlink_bytes_per_token": tot.downlink_bytes / tok,
        "uplink_bytes_per_rejection": (tot.rejection_uplink_bytes / tot.rejections
                                       if tot.rejections else None),
        "downlink_bytes_per_rejection": (tot.rejection_downlink_bytes / tot.rejections
                                         if tot.rejections else None),
        "target_calls": tot.target_calls,
        "cloud_calls_per_token": tot.target_calls / tok,
        "extra_round_trips": tot.extra_round_trips,
        "extra_round_trips_per_token": tot.extra_round_trips / tok,
        "sr_dv_trials": tot.trials, "fallbacks": tot.fallbacks,
        "messages": tot.messages,
        "edge_compute_ms_per_token": 1e3 * tot.draft_compute_s / tok,
        "cloud_compute_ms_per_token": 1e3 * tot.cloud_compute_s / tok,
        "modeled_tokens_per_s": modeled,
        "rtt_ms": cfg.rtt_ms,
        "tv_to_target": None, "tv_stderr": None, "tv_commit": None, "tv_trials": 0,
        "live": None,
    }


async def _live(draft: LanguageModel, target: LanguageModel, runs: list[dict[str, Any]],
                cfg: MethodsConfig, prompts: list[str], tokens: int) -> None:
    """Run ``runs`` (records) through a real cloud and edge over ZeroMQ with the link
    emulator on the edge, and attach wall and modeled tokens/s to each record."""
    from ..nodes import CloudNode, EdgeNode

    link = link_for(cfg.live_rate_mbps, cfg.rtt_ms)
    cloud = CloudNode(target, bind="tcp://127.0.0.1:0", max_batch=1)
    async with cloud:
        edge = EdgeNode(draft, cloud.endpoint, link=link, target_vocab=target.vocab,
                        draft_len=cfg.draft_len)
        async with edge:
            for rec in runs:
                gen = cfg.generation(rec["method"], rec["codec"], rec["warper"], tokens)
                n, wall, modeled, up, down = 0, 0.0, 0.0, 0, 0
                for i, prompt in enumerate(prompts):
                    res = await edge.generate(prompt, config=gen, seed=cfg.seed * 1000 + i)
                    st = res.stats
                    n += st.tokens
                    wall += st.wall_s
                    modeled += st.modeled_s
                    up += st.uplink_bytes
                    down += st.downlink_bytes
                rec["live"] = {"rate_mbps": cfg.live_rate_mbps, "rtt_ms": cfg.rtt_ms,
                               "prompts": len(prompts), "tokens": n, "wall_s": wall,
                               "tokens_per_s": n / wall if wall > 0 else 0.0,
                               "modeled_tokens_per_s": n / modeled if modeled > 0 else 0.0,
                               "uplink_bytes_per_token": up / max(1, n),
                               "downlink_bytes_per_token": down / max(1, n)}


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


async def run_methods(cfg: MethodsConfig, *, progress: bool | None = None) -> dict[str, Any]:
    """Run the grid and return ``{"records": [...], "config": ..., ...}``.

    A coroutine, so a caller inside an event loop awaits it there: the live runs
    (a real cloud and edge) run in that loop, and the CPU-bound rest (model loading,
    the in-process grid, the TV estimates) in a worker thread, so the loop's other
    tasks keep running meanwhile. :func:`run_methods_sync` is the entry without a
    loop."""
    from ..errors import ModelError

    show = sys.stderr.isatty() if progress is None else progress
    records: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    timings: dict[str, float] = {}
    t_all = time.perf_counter()
    for pair in cfg.pairs:
        t0 = time.perf_counter()
        try:
            draft, target = await asyncio.to_thread(load_pair, pair)
        except (ModelError, ImportError) as e:
            skipped[pair] = str(e)
            _say(show, f"pair {pair} skipped: {e}")
            continue
        timings[f"{pair}: load"] = time.perf_counter() - t0
        vmap = VocabMap(draft.vocab, target.vocab)
        link = Pump(target, draft, vmap=vmap)
        n_tokens = cfg.tokens if pair == "embedded" else cfg.real_tokens
        prompts = list(PROMPTS[: cfg.prompts])
        for wi, w in enumerate(cfg.warpers):
            t0 = time.perf_counter()
            recs, live_runs = await asyncio.to_thread(
                _grid, cfg, pair, w, wi, draft, target, vmap, link, prompts, n_tokens, show)
            records += recs
            if live_runs:
                _say(show, f"[{pair} {w}] live runs at {cfg.live_rate_mbps:g} Mbps")
                await _live(draft, target, live_runs, cfg, prompts[: cfg.live_prompts], n_tokens)
            timings[f"{pair}: {w}"] = time.perf_counter() - t0
    return {"kind": "methods", "config": asdict(cfg), "pairs": {p: PAIRS[p] for p in cfg.pairs},
            "skipped": skipped, "records": records, "timings_s": timings,
            "elapsed_s": time.perf_counter() - t_all, "machine": machine()}


def _grid(cfg: MethodsConfig, pair: str, w: str, wi: int, draft: LanguageModel,
          target: LanguageModel, vmap: VocabMap, link: Pump, prompts: list[str], n_tokens: int,
          show: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The in-process records of one (pair, warper), and those of them to run live."""
    params = WARPERS[w]
    contexts = ([context_rows(draft, target, vmap, PROMPTS[i % len(PROMPTS)], params)
                 for i in range(cfg.tv_contexts)] if cfg.tv_trials > 0 else [])
    grid = [(m, c) for m in cfg.methods for c in codecs_for(m, cfg.codecs)]
    records: list[dict[str, Any]] = []
    live_runs: list[dict[str, Any]] = []
    for k, (m, c) in enumerate(grid):
        _say(show, f"[{pair} {w}] {k + 1}/{len(grid)} {m} {c}")
        gen = cfg.generation(m, c, w, n_tokens)
        # one untimed generation first: the first call of each code path pays for
        # lazily built tables and cold caches, which would be charged to whichever
        # record ran first (T=1's, say) and skew the compute per token of short runs
        link.generate(m, prompt=prompts[0], max_new_tokens=min(8, gen.max_new_tokens),
                      codec=c, params=gen.sampling_params(), draft_len=gen.draft_len,
                      adaptive_draft=gen.adaptive_draft, draft_cost=gen.draft_cost,
                      draft_confidence=gen.draft_confidence, seed=cfg.seed * 1000 + 999)
        gens = [link.generate(m, prompt=p, max_new_tokens=gen.max_new_tokens, codec=c,
                              params=gen.sampling_params(), draft_len=gen.draft_len,
                              adaptive_draft=gen.adaptive_draft, draft_cost=gen.draft_cost,
                      draft_confidence=gen.draft_confidence, seed=cfg.seed * 1000 + i)
                for i, p in enumerate(prompts)]
        rec = _record(pair, m, c, w, gens, cfg)
        if contexts:
            est = measure_tv(m, c, contexts, link.space, trials=cfg.tv_trials,
                             resolve=cfg.tv_resolve, seed=cfg.seed + 17 * k)
            rec.update(tv_to_target=est.tv, tv_stderr=est.stderr,
                       tv_commit=est.tv_commit, tv_trials=est.trials)
        records.append(rec)
        if cfg.live_rate_mbps > 0 and (cfg.live == "all" or (
                cfg.live == "f32" and wi == 0 and c == "f32")):
            live_runs.append(rec)
    return records, live_runs


def run_methods_sync(cfg: MethodsConfig, *, progress: bool | None = None) -> dict[str, Any]:
    """:func:`run_methods` in a fresh event loop (the CLI's entry); inside a running
    loop it refuses, pointing at ``await run_methods(...)``."""
    from .load.run import no_running_loop

    no_running_loop("run_methods_sync", "await run_methods(cfg)")
    return asyncio.run(run_methods(cfg, progress=progress))


HEADER = ["method", "codec", "acc", "L", "calls/tok", "up B/tok", "down B/tok", "down B/rej",
          "extra RT/tok", "TV (±se)"]


def _fmt_bytes(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def record_row(r: dict[str, Any], rates: list[str]) -> list[Any]:
    tv = "-" if r["tv_to_target"] is None else f"{r['tv_to_target']:.3f} ±{r['tv_stderr']:.3f}"
    row: list[Any] = [r["method"], r["codec"], f"{r['acceptance_rate']:.3f}",
                      f"{r['mean_acceptance_length']:.2f}", f"{r['cloud_calls_per_token']:.3f}",
                      _fmt_bytes(r["uplink_bytes_per_token"]),
                      _fmt_bytes(r["downlink_bytes_per_token"]),
                      _fmt_bytes(r["downlink_bytes_per_rejection"]),
                      f"{r['extra_round_trips_per_token']:.3f}", tv]
    row += [f"{r['modeled_tokens_per_s'].get(x, 0.0):.1f}" for x in rates]
    live = r.get("live")
    row.append(f"{live['tokens_per_s']:.1f}" if live else "-")
    return row


def format_report(rep: dict[str, Any], *, markdown: bool = False) -> str:
    """One table per (pair, warper)."""
    out = []
    rates = [f"{x:g}" for x in rep["config"]["rates_mbps"]]
    live_rate = rep["config"]["live_rate_mbps"]
    header = [*HEADER, *(f"tok/s @{x}M" for x in rates), f"live tok/s @{live_rate:g}M"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rep["records"]:
        groups.setdefault((r["pair"], r["warper"]), []).append(r)
    for (pair, w), rows in groups.items():
        out.append(f"{pair} ({rep['pairs'].get(pair, pair)}), {w}:" if not markdown
                   else f"**{pair}, {w}**\n")
        out.append(table([record_row(r, rates) for r in rows], header, markdown=markdown))
        out.append("")
    for p, why in rep.get("skipped", {}).items():
        out.append(f"pair {p} skipped: {why}")
    return "\n".join(out)


def plot_report(rep: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Tokens/s against downlink rate per method (f32), and downlink bytes per token
    per method and codec (log scale), per (pair, warper)."""
    from .plots import bytes_plot, rate_plot

    paths = []
    seen = {(r["pair"], r["warper"]) for r in rep["records"]}
    for pair, w in sorted(seen):
        slug = f"{pair}_{w}".replace(" ", "").replace("=", "").replace(".", "")
        codec_of = {m: "f32" for m in METHODS}
        paths.append(rate_plot(rep["records"], Path(out_dir) / f"methods_rate_{slug}.png",
                               pair=pair, warper=w, codec_of=codec_of))
        paths.append(bytes_plot(rep["records"], Path(out_dir) / f"methods_bytes_{slug}.png",
                                pair=pair, warper=w))
    return paths


def merge_reports(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs (e.g. different grids per warper) as one report; ``runs`` keeps
    each run's config and command line."""
    if not reps:
        raise ValueError("nothing to merge")
    out = dict(reps[0])
    out["records"] = [r for rep in reps for r in rep["records"]]
    out["runs"] = [{"config": rep["config"], "command": rep.get("command"),
                    "elapsed_s": rep.get("elapsed_s"), "timings_s": rep.get("timings_s"),
                    "skipped": rep.get("skipped", {})} for rep in reps]
    out["pairs"] = {k: v for rep in reps for k, v in rep["pairs"].items()}
    out["skipped"] = {k: v for rep in reps for k, v in rep.get("skipped", {}).items()}
    out["elapsed_s"] = sum(rep.get("elapsed_s", 0.0) for rep in reps)
    return out


__all__ = ["HEADER", "PROMPTS", "RECORD_KEYS", "MethodsConfig", "format_report", "link_for",
           "load_pair", "merge_reports", "plot_report", "run_methods", "run_methods_sync"]
