"""``xcosd bench trees``: draft trees next to chains and ``ar``, through the protocol.

Each (pair, warper, row) generates the same seeded prompts through the edge's and the
cloud's state machines in process (:class:`~xcosd.nodes.pump.Pump`: every message in
its wire form and metered as it would cross a ZeroMQ link, the cloud's scheduler
scoring a tree with ``score_tree``, the edge's :class:`~xcosd.nodes.drafter.Drafter`
drafting it). The rows, in one run:

* ``ar``: the target alone;
* ``chain``: the chain policy, what a session runs by default (``tree=None``: the
  draft length of ``xcosd/policies/draft_length.py`` at its default cost);
* ``auto``: the tree policy as a session runs it (``tree="auto"``: ``RankRates`` and
  its default costs, ``xcosd/policies/tree_policy.py``);
* fixed shapes (``chain:D``, ``W1xW2x...``, ``spine:W1xW2x...``);
* ``chain:measured`` and ``auto:measured``: both policies given the costs this run
  measured for the GPU-like deployment (below), as ``draft_cost="auto"`` would
  measure them on such a link.

Per row: tokens per round trip and round trips per token (a round trip is a target
call, i.e. a round's verdict, or a follow-up), target calls per token, wire bytes up
and down per round and per token, the edge's measured compute per round (drafting,
packing, settling) and the cloud's per call, and modeled tokens/s (the link model of
``xcosd bench methods`` over each generation's message sequence, plus the measured
compute) at every rate and RTT; the GPU-like column replaces the cloud's measured
time with a fixed cost per target call at ``gpu_rtt_ms``. Each round's shape, walk,
uplink bytes and compute are noted as the messages pass (the block carries its
parents, the verdict's count names the node the walk stopped at): the per-rank
acceptance the tree policy estimates, and what a node costs (least squares over the
rounds: the edge's compute against depth and nodes, the uplink bytes against nodes
and committed rows), from which :meth:`~xcosd.policies.tree_policy.TreeCosts.measured`
gives the measured rows' costs.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..methods import get_method
from ..methods.tree import DEFAULT_ROW_CODEC, TreeShape
from ..models.base import LanguageModel
from ..nodes.pump import Generation, Pump
from ..nodes.stats import merge
from ..policies.draft_length import DEFAULT_COST
from ..policies.tree_policy import (
    NODE_BYTES,
    RANKS,
    TreeCosts,
    best_shape,
    candidate_shapes,
    expected_tokens,
    round_cost,
    walk_ranks,
)
from ..protocol import Message, VerdictMsg
from ..protocol.edge import EdgeSession
from ..sampling import SamplingParams
from ..transport import sequence_latency
from ..vocab import VocabMap
from .grid import RATES_MBPS, WARPERS
from .report import OUT_DIR, machine, table

HEADING = "## Draft trees"
OUT = OUT_DIR / "trees.json"
#: the RTTs the modeled tokens/s are given at (ms)
RTTS_MS = (5.0, 20.0, 50.0, 100.0)
PROMPTS = (
    "The cloud server verifies a block of drafted tokens in one pass, and",
    "def merge_sorted(a, b):\n    ",
    "In the morning the market opened with",
    "Speculative decoding works because",
    "The history of the city begins",
    "To install the package, run",
    "She looked at the map and said",
    "A list of the largest rivers:",
)
#: the session policies among the rows (the rest are fixed shapes)
POLICIES = ("chain", "auto")
SHAPES = ("chain", "auto", "chain:2", "chain:4", "chain:8", "2", "4", "2x1x1", "4x1",
          "spine:4x2x2", "8x1")
#: the rows with the measured costs, run after the rest (they need their measurements)
MEASURED = ("chain:measured", "auto:measured")


@dataclass
class TreesConfig:
    pairs: list[str] = field(default_factory=lambda: ["embedded"])
    shapes: list[str] = field(default_factory=lambda: list(SHAPES))
    warpers: list[str] = field(default_factory=lambda: ["T=1"])
    method: str = "xcosd-e"
    #: the branching rows' codec (the draft proposes from the row it commits)
    row_codec: str = DEFAULT_ROW_CODEC
    prompts: int = 8
    tokens: int = 64
    real_prompts: int = 3
    real_tokens: int = 32
    rates_mbps: list[float] = field(default_factory=lambda: list(RATES_MBPS))
    rtts_ms: list[float] = field(default_factory=lambda: list(RTTS_MS))
    #: the GPU-like cloud: this many ms a target call, at ``gpu_rtt_ms``
    gpu_call_ms: float = 4.0
    gpu_rtt_ms: float = 50.0
    #: run the policies with this run's measured costs too (:data:`MEASURED`)
    measured: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        from .methods import PAIRS

        for s in self.shapes:
            if s not in POLICIES:
                TreeShape.parse(s)
        for w in self.warpers:
            if w not in WARPERS:
                raise ValueError(f"unknown warper {w!r}; known: {', '.join(WARPERS)}")
        for p in self.pairs:
            if p not in PAIRS:
                raise ValueError(f"unknown pair {p!r}; known: {', '.join(PAIRS)}")
        get_method(self.method)


@dataclass
class _Round:
    """One round as its messages showed it."""

    depth: int
    nodes: int
    rows: int
    up: int
    edge_s: float
    cloud_s: float


class _Watch(Pump):
    """The pump, noting each round's shape and walk (from the block's parents and the
    verdict's count), its block's wire bytes and both sides' compute."""

    def __init__(self, target: LanguageModel, draft: LanguageModel, vmap: VocabMap) -> None:
        super().__init__(target, draft, vmap=vmap)
        self.rounds: list[_Round] = []
        self.walks: list[tuple[int, bool]] = []
        self._edge_s = 0.0

    def next_draft(self, es: EdgeSession) -> Message:
        st = self._stats
        t0 = st.draft_compute_s
        msg = super().next_draft(es)
        self._edge_s = st.draft_compute_s - t0
        return msg

    def to_cloud(self, msg: Message) -> list[Message]:
        block = getattr(msg, "draft", None)
        if block is None:  # not a round's block: a follow-up, a close, the handshake
            return super().to_cloud(msg)
        st = self._stats
        up, edge, cloud = st.uplink_bytes, st.draft_compute_s, st.cloud_compute_s
        replies = super().to_cloud(msg)
        # a chain's shape is chain:d, and it sends no rows (q(x) alone tests a draft)
        shape = block.shape
        rows = 0 if block.stays_in_context else len(block.rows)
        self.rounds.append(_Round(shape.depth, shape.size, rows, st.uplink_bytes - up,
                                  self._edge_s + st.draft_compute_s - edge,
                                  st.cloud_compute_s - cloud))
        for m in replies:
            if isinstance(m, VerdictMsg):
                n = m.accepted
                self.walks += walk_ranks(shape, block.path(n))
        return replies


def _link(rate_mbps: float, rtt_ms: float) -> Any:
    from .methods import link_for

    return link_for(rate_mbps, rtt_ms)


def run_row(pump: _Watch, label: str, params: SamplingParams, cfg: TreesConfig, prompts: int,
            tokens: int, costs: dict[str, Any] | None = None) -> tuple[dict[str, Any],
                                                                        list[_Round]]:
    """One row over the prompts (one untimed generation first, as ``bench methods``
    does: the first call of each code path pays for cold caches). Its summary, and its
    rounds (for the cost fit)."""
    method = "ar" if label == "ar" else cfg.method
    policy = label.split(":")[0] if label in MEASURED else label
    tree: TreeShape | str | None = (None if label == "ar" or policy == "chain" else
                                    "auto" if policy == "auto" else TreeShape.parse(label))
    draft_cost = DEFAULT_COST if costs is None or label not in MEASURED else costs["step"]

    def generate(prompt: str, n: int, seed: int) -> Generation:
        es = pump.session(method, prompt=prompt, max_new_tokens=n, params=params, seed=seed,
                          tree=tree, tree_row_codec=cfg.row_codec, draft_cost=draft_cost)
        if costs is not None and label in MEASURED:
            es.tree_rates.costs = TreeCosts(costs["node"], costs["row"])
        return pump.drive(es)

    generate(PROMPTS[0], min(8, tokens), cfg.seed * 1000 + 999)
    pump.rounds, pump.walks = [], []
    gens = [generate(p, tokens, cfg.seed * 1000 + i) for i, p in enumerate(PROMPTS[:prompts])]
    return _summary(label, gens, pump, cfg), pump.rounds


def _summary(label: str, gens: list[Generation], pump: _Watch, cfg: TreesConfig
             ) -> dict[str, Any]:
    st = merge([g.stats for g in gens])
    tok, rounds = max(1, st.tokens), max(1, st.rounds)
    trips = st.target_calls + st.extra_round_trips
    tested, accepted = [0] * RANKS, [0] * RANKS
    for i, ok in pump.walks:
        k = min(i, RANKS - 1)
        tested[k] += 1
        accepted[k] += ok
    modeled = {}
    for rate in cfg.rates_mbps:
        for rtt in cfg.rtts_ms:
            secs = sum(g.modeled_s(_link(rate, rtt)) for g in gens)
            modeled[f"{rate:g}@{rtt:g}"] = st.tokens / secs if secs > 0 else 0.0
    gpu_link = _link(cfg.rates_mbps[0], cfg.gpu_rtt_ms)
    gpu_s = 0.0
    for g in gens:
        trace: Any = g.trace  # (direction, bytes), the directions "up" and "down"
        gpu_s += (g.stats.draft_compute_s + g.stats.target_calls * cfg.gpu_call_ms / 1e3
                  + sequence_latency(trace, gpu_link))
    shapes = sorted({r.nodes for r in pump.rounds})
    return {"shape": label, "generations": len(gens), "tokens": st.tokens,
            "rounds": st.rounds, "target_calls": st.target_calls,
            "extra_round_trips": st.extra_round_trips, "trips": trips,
            "drafted": st.drafted, "accepted": st.accepted,
            "uplink_bytes": st.uplink_bytes, "downlink_bytes": st.downlink_bytes,
            "edge_s": st.draft_compute_s, "cloud_s": st.cloud_compute_s,
            "rank_tested": tested, "rank_accepted": accepted,
            "nodes_per_round": sum(r.nodes for r in pump.rounds) / max(1, len(pump.rounds)),
            "node_counts": shapes,
            "tokens_per_trip": st.tokens / max(1, trips),
            "trips_per_token": trips / tok,
            "calls_per_token": st.target_calls / tok,
            "up_per_round": st.uplink_bytes / rounds, "down_per_round": st.downlink_bytes / rounds,
            "up_per_token": st.uplink_bytes / tok, "down_per_token": st.downlink_bytes / tok,
            "acceptance": st.accepted / max(1, st.drafted),
            "edge_ms_per_round": 1e3 * st.draft_compute_s / rounds,
            "cloud_ms_per_call": 1e3 * st.cloud_compute_s / max(1, st.target_calls),
            "modeled_tok_s": modeled,
            "gpu_tok_s": st.tokens / gpu_s if gpu_s > 0 else 0.0}


def fit_costs(rounds: list[_Round], cfg: TreesConfig) -> dict[str, Any]:
    """What a node costs, from the rounds that drafted (least squares, each
    coefficient at least 0): the edge's seconds a round against its depth and its
    nodes beyond one a depth, the uplink bytes against its nodes and committed rows;
    and the policies' costs for the GPU-like deployment (its fixed part the RTT plus
    a call, which costs the same whatever its rows, so a node costs the cloud
    nothing there)."""
    drafted = [r for r in rounds if r.nodes]
    fixed_s = (cfg.gpu_rtt_ms + cfg.gpu_call_ms) / 1e3
    if not drafted:
        return {"step_s": 0.0, "node_s": 0.0, "node_bytes": float(NODE_BYTES),
                "row_bytes": 0.0, "step": DEFAULT_COST, "node": DEFAULT_COST, "row": 0.0,
                "rounds": 0, "fixed_s": fixed_s}

    def lstsq(cols: list[list[float]], y: list[float]) -> list[float]:
        a = np.array(cols, dtype=np.float64).T
        used = [j for j in range(a.shape[1]) if np.ptp(a[:, j]) > 0 or j == 0]
        sol = np.linalg.lstsq(a[:, used], np.array(y), rcond=None)[0]
        out = [0.0] * a.shape[1]
        for j, v in zip(used, sol, strict=True):
            out[j] = max(0.0, float(v))
        return out

    one = [1.0] * len(drafted)
    _, step_s, node_s = lstsq([one, [r.depth for r in drafted],
                               [r.nodes - r.depth for r in drafted]],
                              [r.edge_s for r in drafted])
    if not any(r.nodes > r.depth for r in drafted):
        node_s = step_s  # no tree measured: a node as a step (TreeCosts.default)
    _, node_b, row_b = lstsq([one, [r.nodes for r in drafted], [r.rows for r in drafted]],
                             [float(r.up) for r in drafted])
    costs = TreeCosts.measured(fixed_s=fixed_s, draft_node_s=node_s, node_bytes=node_b,
                               row_bytes=row_b, up_bps=cfg.rates_mbps[0] * 1e6)
    return {"step_s": step_s, "node_s": node_s, "node_bytes": node_b, "row_bytes": row_b,
            "step": step_s / fixed_s, "node": costs.node, "row": costs.row,
            "rounds": len(drafted), "fixed_s": fixed_s}


def run_trees(cfg: TreesConfig, *, progress: bool = True) -> dict[str, Any]:
    from .methods import load_pair

    records: list[dict[str, Any]] = []
    fits: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for pair in cfg.pairs:
        if pair != "embedded":
            import torch

            torch.set_num_threads(1)  # one thread a model, as bench real_pair runs them
        draft, target = load_pair(pair)
        vmap = VocabMap(draft.vocab, target.vocab)
        pump = _Watch(target, draft, vmap)
        real = pair != "embedded"
        n_p, n_t = (cfg.real_prompts, cfg.real_tokens) if real else (cfg.prompts, cfg.tokens)
        for w in cfg.warpers:
            params = WARPERS[w]
            rounds: list[_Round] = []
            rows = []
            for label in ["ar", *cfg.shapes]:
                row, got = run_row(pump, label, params, cfg, n_p, n_t)
                rows.append(row)
                rounds += got
                _say(progress, pair, w, row)
            costs = fit_costs(rounds, cfg)
            if cfg.measured:
                for label in MEASURED:
                    row, _ = run_row(pump, label, params, cfg, n_p, n_t, costs)
                    rows.append(row)
                    _say(progress, pair, w, row)
            records += [{"pair": pair, "warper": w, **r} for r in rows]
            fits.append({"pair": pair, "warper": w, **costs,
                         "rates": _rates(rows)})
    return {"config": asdict(cfg), "machine": machine(), "records": records, "costs": fits,
            "elapsed_s": time.perf_counter() - t_all}


def _rates(rows: list[dict[str, Any]]) -> list[float]:
    """The per-rank acceptance over every row's walks (the tree policy's estimate, had
    it seen them all), up to the last rank tested."""
    tested = [sum(r["rank_tested"][k] for r in rows) for k in range(RANKS)]
    accepted = [sum(r["rank_accepted"][k] for r in rows) for k in range(RANKS)]
    last = max((k for k in range(RANKS) if tested[k]), default=0)
    return [a / n if n else 0.0 for a, n in zip(accepted[: last + 1], tested[: last + 1],
                                                strict=True)]


def _say(progress: bool, pair: str, w: str, r: dict[str, Any]) -> None:
    if progress:
        print(f"  {pair} {w} {r['shape']}: {r['trips_per_token']:.3f} trips/token, "
              f"{r['calls_per_token']:.3f} calls/token, {r['nodes_per_round']:.1f} nodes/round",
              flush=True)


HEADER = ["pair", "warper", "row", "nodes/round", "tok/trip", "trips/tok", "calls/tok", "acc",
          "up B/round", "down B/round", "up B/tok", "down B/tok", "edge ms/round",
          "cloud ms/call"]


def _row(r: dict[str, Any], keys: list[str]) -> list[Any]:
    return [r["pair"], r["warper"], r["shape"], f"{r['nodes_per_round']:.1f}",
            f"{r['tokens_per_trip']:.2f}", f"{r['trips_per_token']:.3f}",
            f"{r['calls_per_token']:.3f}", f"{r['acceptance']:.2f}",
            f"{r['up_per_round']:.0f}", f"{r['down_per_round']:.0f}",
            f"{r['up_per_token']:.0f}", f"{r['down_per_token']:.1f}",
            f"{r['edge_ms_per_round']:.2f}", f"{r['cloud_ms_per_call']:.2f}",
            ] + [f"{r['modeled_tok_s'][k]:.0f}" for k in keys]


def _keys(cfg: dict[str, Any]) -> list[str]:
    return [f"{cfg['rates_mbps'][0]:g}@{rtt:g}" for rtt in cfg["rtts_ms"]]


def format_report(rep: dict[str, Any], *, markdown: bool = False) -> str:
    keys = _keys(rep["config"])
    head = HEADER + [f"tok/s {k} ms" for k in keys] + ["GPU-like tok/s"]
    return table([[*_row(r, keys), f"{r['gpu_tok_s']:.0f}"] for r in rep["records"]], head,
                 markdown=markdown)


def _find(rep: dict[str, Any], pair: str, warper: str, shape: str) -> dict[str, Any] | None:
    return next((r for r in rep["records"] if r["pair"] == pair and r["warper"] == warper
                 and r["shape"] == shape), None)


def _best(rep: dict[str, Any], pair: str, warper: str, chain: bool, key: str
          ) -> dict[str, Any] | None:
    """The fixed shape (a chain's, or a tree's) best by ``key``."""
    rows = [r for r in rep["records"] if r["pair"] == pair and r["warper"] == warper
            and r["shape"] not in ("ar", *POLICIES, *MEASURED)
            and r["shape"].startswith("chain:") == chain]
    if not rows:
        return None
    if key == "trips_per_token":
        return min(rows, key=lambda r: r[key])
    return max(rows, key=lambda r: r[key])


#: the goals the section judges: (pair, bound on round trips per token)
TRIP_GOALS = {"embedded": 0.20, "real": 0.50}
#: the GPU-like speed-up over ``ar`` the real pair should reach
GPU_GOAL = 1.5


def _goal_lines(rep: dict[str, Any]) -> list[str]:
    """Each goal, judged from the records: met or not, with the numbers."""
    out: list[str] = []
    cfg = rep["config"]
    for pair in cfg["pairs"]:
        bound = TRIP_GOALS.get("real" if pair.startswith("real") else pair)
        if bound is None:
            continue
        rows = [r for r in rep["records"] if r["pair"] == pair and r["warper"] == "T=1"
                and r["shape"] != "ar"]
        if not rows:
            continue
        best = min(rows, key=lambda r: r["trips_per_token"])
        auto, chain = _find(rep, pair, "T=1", "auto"), _find(rep, pair, "T=1", "chain")
        got = [f"`{r['shape']}` {r['trips_per_token']:.3f}" for r in (chain, auto) if r]
        met = best["trips_per_token"] <= bound
        out.append(
            f"- {pair}, T=1, at most {bound:.2f} round trips per token: "
            f"{'**met**' if met else '**not met**'}; the policies {', '.join(got)}, the "
            f"fewest of any row `{best['shape']}` {best['trips_per_token']:.3f} "
            f"({best['nodes_per_round']:.1f} nodes a round).")
    for real in [p for p in cfg["pairs"] if p.startswith("real")]:
        ar = _find(rep, real, "T=1", "ar")
        rows = [r for r in rep["records"] if r["pair"] == real and r["warper"] == "T=1"
                and r["shape"] != "ar"]
        if ar and rows:
            base = max(ar["gpu_tok_s"], 1e-9)
            best = max(rows, key=lambda r: r["gpu_tok_s"])
            pol = [r for r in (_find(rep, real, "T=1", s) for s in MEASURED) if r]
            ratios = ", ".join(f"`{r['shape']}` {r['gpu_tok_s'] / base:.2f}x" for r in pol)
            met = best["gpu_tok_s"] >= GPU_GOAL * base
            out.append(
                f"- {real}, T=1, GPU-like cloud ({cfg['gpu_call_ms']:g} ms a call) at RTT "
                f"{cfg['gpu_rtt_ms']:g} ms, at least {GPU_GOAL:g}x `ar` with the edge's "
                f"measured compute: {'**met**' if met else '**not met**'}; `ar` "
                f"{ar['gpu_tok_s']:.1f} tok/s, {ratios}, the best row `{best['shape']}` "
                f"{best['gpu_tok_s'] / base:.2f}x." + _breakeven(rep, real, "T=1"))
    for pair in cfg["pairs"]:
        for w in cfg["warpers"]:
            chain = _find(rep, pair, w, "chain")
            if chain is None:
                continue
            trees = [r for r in rep["records"] if r["pair"] == pair and r["warper"] == w
                     and r["shape"] not in ("ar", "chain", "chain:measured")
                     and not r["shape"].startswith("chain:")]
            worse = ", ".join(f"`{r['shape']}` {r['down_per_token']:.1f}" for r in trees
                              if r["down_per_token"] > chain["down_per_token"])
            ups = ", ".join(f"`{r['shape']}` {r['up_per_round']:.0f} B" for r in trees)
            out.append(
                f"- {pair}, {w}, downlink per token no more than the chain policy's "
                f"({chain['down_per_token']:.1f} B): "
                + (f"**not met** by {worse}" if worse else "**met** by every tree row")
                + f"; uplink per round: the chain policy {chain['up_per_round']:.0f} B, "
                f"{ups}.")
    return out


def _breakeven(rep: dict[str, Any], pair: str, warper: str) -> str:
    """How cheap a draft step would have to be for the policy's model, at the ranks
    measured, to reach :data:`GPU_GOAL` over ``ar`` on the GPU-like cloud (a node
    costing the edge what it measured beside a step, the cloud nothing)."""
    c = next((c for c in rep.get("costs", []) if c["pair"] == pair and c["warper"] == warper),
             None)
    if c is None:
        return ""
    share = c["node_s"] / c["step_s"] if c["step_s"] > 0 else 1.0
    shapes = candidate_shapes()

    def most(step: float) -> float:
        return max(expected_tokens(sh, c["rates"]) / round_cost(sh, step, share * step, c["row"])
                   for sh in shapes)

    if most(0.0) < GPU_GOAL:
        return (f" At the ranks measured the model's best is {most(0.0):.2f}x `ar` even with "
                "a free draft.")
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if most(mid) >= GPU_GOAL else (lo, mid)
    return (f" At the ranks measured the model reaches {GPU_GOAL:g}x `ar` only with a draft "
            f"step of at most {1e3 * lo * c['fixed_s']:.1f} ms ({lo:.3f} of a round; "
            f"{1e3 * c['step_s']:.1f} ms measured here).")


def section_lines(rep: Any) -> list[str]:
    """The RESULTS section, every sentence computed from the JSON."""
    if rep is None:
        return [HEADING, "", "No `bench/out/trees.json` yet: run `xcosd bench trees`.", ""]
    cfg = rep["config"]
    sizes = []
    if "embedded" in cfg["pairs"]:
        sizes.append(f"embedded pair {cfg['prompts']} prompts x {cfg['tokens']} tokens")
    for real in [p for p in cfg["pairs"] if p.startswith("real")]:
        backend = " on llama.cpp, one thread a side" if real == "real-llama.cpp" else ""
        sizes.append(f"{real} pair{backend} {cfg['real_prompts']} x {cfg['real_tokens']}")
    commands = "`" + rep.get("command", "xcosd bench trees").replace("; ", "`; `") + "`"
    out = [HEADING, "",
           f"{commands}: seeded `{cfg['method']}`, branching rows as `{cfg['row_codec']}`; "
           f"{', '.join(sizes)}. Every row generates through the edge's and the cloud's "
           "state machines (`xcosd/nodes/pump.py`, wire bytes as on a ZeroMQ link; "
           "`xcosd/bench/trees.py`): `chain` is the chain policy (the default), `auto` the "
           "tree policy as a session runs it, `*:measured` the policies given this run's "
           "measured costs for the GPU-like deployment, the rest fixed shapes. A round "
           "trip is a target call or a follow-up. Modeled tok/s at "
           f"{cfg['rates_mbps'][0]:g} Mbit/s with the measured compute of both sides; the "
           f"GPU-like column takes {cfg['gpu_call_ms']:g} ms a target call at RTT "
           f"{cfg['gpu_rtt_ms']:g} ms with the edge's measured compute.", ""]
    keys = _keys(cfg)
    head = HEADER + [f"tok/s RTT {k.split('@')[1]}" for k in keys] + ["GPU-like tok/s"]
    rows = [[*_row(r, keys), f"{r['gpu_tok_s']:.0f}"] for r in rep["records"]]
    out += table(rows, head, markdown=True).splitlines()
    out.append("")
    rates = [f"{x:g}" for x in cfg["rates_mbps"]]
    out.append(f"Modeled tok/s of the policies and `ar` at every rate ({', '.join(rates)} "
               "Mbit/s) and RTT (ms), with the measured compute:")
    out.append("")
    grid_keys = [f"{x}@{rtt:g}" for x in rates for rtt in cfg["rtts_ms"]]
    pol_rows = [[r["pair"], r["warper"], r["shape"]]
                + [f"{r['modeled_tok_s'][k]:.0f}" for k in grid_keys]
                for r in rep["records"] if r["shape"] in ("ar", *POLICIES, *MEASURED)]
    out += table(pol_rows, ["pair", "warper", "row", *grid_keys], markdown=True).splitlines()
    out.append("")
    out.append("The goals:")
    out.append("")
    out += _goal_lines(rep)
    out.append("")
    for c in rep.get("costs", []):
        out += _cost_lines(c)
    out.append("")
    return out


def _cost_lines(c: dict[str, Any]) -> list[str]:
    """What one (pair, warper) measured of the costs and the ranks, what the policy
    picks from them, and the most its model lets any candidate emit a round."""
    rates = c["rates"]
    rates_s = ", ".join(f"{b:.2f}" for b in rates)
    pick = best_shape(rates, c["step"], c["node"], row_cost=c["row"])
    most = max(candidate_shapes(), key=lambda s: expected_tokens(s, rates))
    e = expected_tokens(most, rates)
    return [
        f"- {c['pair']}, {c['warper']}: per-rank acceptance over every walk ({rates_s}; "
        f"rank 1 is a chain's); from {c['rounds']} rounds a draft step costs the edge "
        f"{1e3 * c['step_s']:.2f} ms, a node beyond one a depth {1e3 * c['node_s']:.2f} ms, "
        f"{c['node_bytes']:.0f} B a node and {c['row_bytes']:.0f} B a committed row: over a "
        f"GPU-like round's {1e3 * c['fixed_s']:.0f} ms, a step {c['step']:.3f}, a node "
        f"{c['node']:.3f}, a row {c['row']:.4f}, and at these rates the policy picks "
        f"`{pick.label}`. Its model at these rates lets no candidate (at most 32 nodes) emit "
        f"more than {e:.2f} tokens a round (`{most.label}`): at least {1 / e:.3f} round "
        "trips per token where acceptance is as even as the model takes it."]


def load_reports(out_dir: Path = OUT.parent) -> dict[str, Any] | None:
    """Every ``trees*.json`` in ``out_dir`` as one report (a pair may be run on its own,
    ``--json bench/out/trees_real.json``): records and costs in file order, the pairs
    named once, the first file's settings otherwise."""
    reps = [json.loads(p.read_text()) for p in sorted(out_dir.glob("trees*.json"))]
    if not reps:
        return None
    merged = dict(reps[0])
    merged["config"] = dict(reps[0]["config"])
    merged["records"] = [r for rep in reps for r in rep["records"]]
    merged["costs"] = [c for rep in reps for c in rep.get("costs", [])]
    pairs: list[str] = []
    for rep in reps:
        pairs += [p for p in rep["config"]["pairs"] if p not in pairs]
        if any(p.startswith("real") for p in rep["config"]["pairs"]):
            for k in ("real_prompts", "real_tokens"):
                merged["config"][k] = rep["config"][k]
    merged["config"]["pairs"] = pairs
    merged["command"] = "; ".join(str(rep.get("command", "xcosd bench trees")) for rep in reps)
    return merged


def write_report(rep: dict[str, Any], path: Path = OUT) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rep, indent=1))
    return path


__all__ = ["HEADING", "MEASURED", "OUT", "POLICIES", "SHAPES", "TreesConfig", "fit_costs",
           "format_report", "load_reports", "run_row", "run_trees", "section_lines",
           "write_report"]
