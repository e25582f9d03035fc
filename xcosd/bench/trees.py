"""``xcosd bench trees``: draft trees next to chains on real models, in one run.

Each (pair, warper, shape) generates the same seeded prompts with tree rounds
(:func:`xcosd.simulate.simulate_tree_round`: the device's draws from its model's TLI
rows, the committed branching rows, the cloud's walk over the target's rows from
:func:`~xcosd.models.tree_scoring.score_tree`, the method's own rejection exchange
with its follow-ups); a chain is the tree ``chain:D``, so both run the same code. Per
shape: tokens per round trip (a round's verdict and every follow-up each count one),
target calls per token, payload bytes up and down per round, the edge's measured
draft compute per round and the cloud's per call, and modeled tokens/s (each
message ``RTT/2 + 8 * bytes / rate`` plus the measured compute) at every rate and
RTT, with ``ar`` (one target call and one round trip a token) beside them. A second
model replaces the cloud's measured time with a GPU-like fixed cost per call.

This is the methods' round in process (the session protocol carries chains only):
the bytes are payload bytes before framing, and the round trips are the ones the
protocol would make for the same messages.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidDistribution
from ..methods import Space, get_method
from ..methods.tli import restrict_kept_support, restrict_to_common
from ..methods.tree import TreeShape
from ..models.base import LanguageModel
from ..models.tree_scoring import rows_after, score_tree
from ..protocol.tree_shape import RANKS, best_shape, walk_ranks
from ..sampling import SamplingParams, sample_index, warp, warp_kept
from ..simulate import simulate_tree_round
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
SHAPES = ("chain:1", "chain:2", "chain:4", "4", "8", "4x1", "4x2", "8x1", "spine:4x2x2")


@dataclass
class TreesConfig:
    pairs: list[str] = field(default_factory=lambda: ["embedded"])
    shapes: list[str] = field(default_factory=lambda: list(SHAPES))
    warpers: list[str] = field(default_factory=lambda: ["T=1"])
    method: str = "xcosd-e"
    #: the branching rows' codec (the draft proposes from the row it commits)
    row_codec: str = "topk:32"
    prompts: int = 8
    tokens: int = 64
    real_prompts: int = 3
    real_tokens: int = 32
    rates_mbps: list[float] = field(default_factory=lambda: list(RATES_MBPS))
    rtts_ms: list[float] = field(default_factory=lambda: list(RTTS_MS))
    #: the GPU-like cloud: this many ms a target call, at ``gpu_rtt_ms``
    gpu_call_ms: float = 4.0
    gpu_rtt_ms: float = 50.0
    seed: int = 0

    def __post_init__(self) -> None:
        for s in self.shapes:
            TreeShape.parse(s)
        for w in self.warpers:
            if w not in WARPERS:
                raise ValueError(f"unknown warper {w!r}; known: {', '.join(WARPERS)}")
        get_method(self.method)


@dataclass
class _Tally:
    tokens: int = 0
    rounds: int = 0
    trips: int = 0
    messages: int = 0
    up: int = 0
    down: int = 0
    draft_s: float = 0.0
    cloud_s: float = 0.0
    accepted: int = 0
    drafted: int = 0
    #: per sibling rank: children tested there, and accepted
    rank_tested: list[int] = field(default_factory=lambda: [0] * RANKS)
    rank_accepted: list[int] = field(default_factory=lambda: [0] * RANKS)


class _Side:
    """One prompt's generation: the target's and the draft's sessions, kept in step
    with the emitted target tokens."""

    def __init__(self, draft: LanguageModel, target: LanguageModel, vmap: VocabMap,
                 params: SamplingParams, prompt: str, shape: TreeShape) -> None:
        self.draft, self.target, self.vmap, self.params = draft, target, vmap, params
        self.shape = shape
        self.t_sess = target.start(target.tokenize(prompt))
        self.d_sess = draft.start(draft.tokenize(prompt))
        self.draft_s = 0.0
        self.cloud_s = 0.0

    def draft_ids(self, tid: int) -> list[int]:
        d = int(self.vmap.target_to_draft[tid])
        if d >= 0:
            return [d]
        data = self.vmap.target.piece(tid)
        return self.vmap.draft.encode_bytes(data) if data else []

    def tli(self, row: np.ndarray) -> np.ndarray:
        try:
            if self.params.identity:
                return restrict_to_common(row, self.vmap.common_draft_index)
            return restrict_kept_support(warp_kept(row, self.params), self.vmap.common_draft_ids,
                                         self.vmap.draft_to_common)[0]
        except InvalidDistribution:
            return warp(restrict_to_common(row, self.vmap.common_draft_index), self.params)

    def draft_rows(self, nodes: list[int], ids: list[int]) -> list[np.ndarray]:
        """A depth's rows in one call (one forward for a transformers draft)."""
        t0 = time.perf_counter()
        spelled = [self.draft_ids(t) for t in ids]
        rows = rows_after(self.draft, self.d_sess, self.shape.parents, spelled, nodes)
        out = [self.tli(row) for row in rows]
        self.draft_s += time.perf_counter() - t0
        return out

    def target_rows(self, ids: list[int]) -> np.ndarray:
        t0 = time.perf_counter()
        rows = warp(score_tree(self.target, self.t_sess, self.shape.parents, ids), self.params)
        self.cloud_s += time.perf_counter() - t0
        return rows

    def emitted(self, tokens: list[int]) -> None:
        self.target.append(self.t_sess, tokens)
        self.draft.append(self.d_sess, [d for t in tokens for d in self.draft_ids(t)])

    def end(self) -> None:
        self.target.end(self.t_sess)
        self.draft.end(self.d_sess)


def run_shape(draft: LanguageModel, target: LanguageModel, vmap: VocabMap, shape: TreeShape,
              params: SamplingParams, cfg: TreesConfig, prompts: int, tokens: int
              ) -> dict[str, Any]:
    """One shape over the prompts: the tally and what it gives per token and round."""
    space = Space.from_vocab_map(vmap)
    method = get_method(cfg.method)
    t = _Tally()
    for i, prompt in enumerate(PROMPTS[:prompts]):
        rng = np.random.default_rng([cfg.seed, i])
        side = _Side(draft, target, vmap, params, prompt, shape)
        made = 0
        while made < tokens:
            res = simulate_tree_round(method, shape, side.target_rows, side.draft_rows, space,
                                      rng, row_codec=cfg.row_codec)
            side.emitted(res.tokens)
            made += len(res.tokens)
            t.rounds += 1
            t.trips += res.round_trips
            t.messages += len(res.messages)
            t.up += res.uplink_bytes
            t.down += res.downlink_bytes
            t.accepted += res.accepted
            t.drafted += res.drafted
            for i, ok in walk_ranks(shape, res.path):
                k = min(i, RANKS - 1)
                t.rank_tested[k] += 1
                t.rank_accepted[k] += ok
        t.tokens += made
        t.draft_s += side.draft_s
        t.cloud_s += side.cloud_s
        side.end()
    return _summary(shape.label, t, cfg, shape.depth)


def run_ar(target: LanguageModel, params: SamplingParams, cfg: TreesConfig, prompts: int,
           tokens: int) -> dict[str, Any]:
    """``ar``: the target alone, one call and one round trip a token (its id down, 4
    bytes; the device's ask up, 1 byte)."""
    t = _Tally()
    for i, prompt in enumerate(PROMPTS[:prompts]):
        rng = np.random.default_rng([cfg.seed, i])
        sess = target.start(target.tokenize(prompt))
        for _ in range(tokens):
            t0 = time.perf_counter()
            row = warp(target.score([(sess, [])])[0][-1], params)
            t.cloud_s += time.perf_counter() - t0
            target.append(sess, [sample_index(row, rng)])
            t.tokens += 1
            t.rounds += 1
            t.trips += 1
            t.messages += 2
            t.up += 1
            t.down += 4
        target.end(sess)
    return _summary("ar", t, cfg, 0)


def _modeled(t: _Tally, rate_mbps: float, rtt_ms: float, cloud_s: float) -> float:
    secs = (t.messages * rtt_ms / 2e3 + 8.0 * (t.up + t.down) / (rate_mbps * 1e6)
            + t.draft_s + cloud_s)
    return t.tokens / secs if secs > 0 else 0.0


def _summary(label: str, t: _Tally, cfg: TreesConfig, depth: int) -> dict[str, Any]:
    tok, rounds = max(1, t.tokens), max(1, t.rounds)
    modeled = {f"{rate:g}@{rtt:g}": _modeled(t, rate, rtt, t.cloud_s)
               for rate in cfg.rates_mbps for rtt in cfg.rtts_ms}
    gpu = _modeled(t, cfg.rates_mbps[0], cfg.gpu_rtt_ms, t.rounds * cfg.gpu_call_ms / 1e3)
    return {"shape": label, "tally": asdict(t), "depth": depth,
            "tokens_per_trip": t.tokens / max(1, t.trips),
            "trips_per_token": t.trips / tok,
            "calls_per_token": t.rounds / tok,
            "up_per_round": t.up / rounds, "down_per_round": t.down / rounds,
            "down_per_token": t.down / tok,
            "acceptance": t.accepted / max(1, t.drafted),
            "draft_ms_per_round": 1e3 * t.draft_s / rounds,
            "cloud_ms_per_call": 1e3 * t.cloud_s / rounds,
            "modeled_tok_s": modeled, "gpu_tok_s": gpu}


def run_trees(cfg: TreesConfig, *, progress: bool = True) -> dict[str, Any]:
    from .methods import load_pair

    records: list[dict[str, Any]] = []
    policies: list[dict[str, Any]] = []
    for pair in cfg.pairs:
        if pair != "embedded":
            import torch

            torch.set_num_threads(1)  # one thread a model, as bench real_pair runs them
        draft, target = load_pair(pair)
        vmap = VocabMap(draft.vocab, target.vocab)
        real = pair != "embedded"
        n_p, n_t = (cfg.real_prompts, cfg.real_tokens) if real else (cfg.prompts, cfg.tokens)
        for w in cfg.warpers:
            params = WARPERS[w]
            rows = [run_ar(target, params, cfg, n_p, n_t)]
            shapes = [TreeShape.parse(s) for s in cfg.shapes]
            for shape in shapes:
                rows.append(run_shape(draft, target, vmap, shape, params, cfg, n_p, n_t))
                _say(progress, pair, w, rows[-1])
            pick, rates, node_cost = policy_pick(rows, cfg)
            if pick.parents not in {s.parents for s in shapes}:
                rows.append(run_shape(draft, target, vmap, pick, params, cfg, n_p, n_t))
                _say(progress, pair, w, rows[-1])
            for r in rows:
                records.append({"pair": pair, "warper": w, **r,
                                "policy": r["shape"] == pick.label})
            policies.append({"pair": pair, "warper": w, "rates": rates,
                             "node_cost": node_cost, "pick": pick.label})
    return {"config": asdict(cfg), "machine": machine(), "records": records,
            "policies": policies}


def _say(progress: bool, pair: str, w: str, r: dict[str, Any]) -> None:
    if progress:
        print(f"  {pair} {w} {r['shape']}: {r['trips_per_token']:.3f} trips/token, "
              f"{r['calls_per_token']:.3f} calls/token", flush=True)


def policy_pick(rows: list[dict[str, Any]], cfg: TreesConfig
                ) -> tuple[TreeShape, list[float], float]:
    """The shape :func:`~xcosd.protocol.tree_shape.best_shape` picks from what the
    run measured: the per-rank acceptance pooled over every tree run, and a node's
    cost (the edge's measured draft time per node) over a round's fixed part (the
    RTT of ``gpu_rtt_ms`` plus the GPU-like cloud's call, whose time per node is taken
    as nothing beside it)."""
    tested, accepted = [0] * RANKS, [0] * RANKS
    per_node: list[float] = []
    for r in rows:
        if r["shape"] == "ar":
            continue
        t = r["tally"]
        for k in range(RANKS):
            tested[k] += t["rank_tested"][k]
            accepted[k] += t["rank_accepted"][k]
        nodes = t["drafted"] / max(1, t["rounds"])
        if nodes:
            per_node.append(r["draft_ms_per_round"] / nodes)
    rates = [a / n if n else 0.0 for a, n in zip(accepted, tested, strict=True)]
    last = max((k for k in range(RANKS) if tested[k]), default=0)
    rates = rates[: last + 1]
    fixed = cfg.gpu_rtt_ms + cfg.gpu_call_ms
    node_cost = float(np.median(per_node)) / fixed if per_node else 0.0
    return best_shape(rates, 0.0, node_cost), rates, node_cost


HEADER = ["pair", "warper", "shape", "tok/trip", "trips/tok", "calls/tok", "acc",
          "up B/round", "down B/round", "down B/tok", "draft ms/round", "cloud ms/call"]


def _row(r: dict[str, Any], keys: list[str]) -> list[Any]:
    return [r["pair"], r["warper"], r["shape"], f"{r['tokens_per_trip']:.2f}",
            f"{r['trips_per_token']:.3f}", f"{r['calls_per_token']:.3f}",
            f"{r['acceptance']:.2f}", f"{r['up_per_round']:.0f}", f"{r['down_per_round']:.0f}",
            f"{r['down_per_token']:.1f}", f"{r['draft_ms_per_round']:.2f}",
            f"{r['cloud_ms_per_call']:.2f}"] + [f"{r['modeled_tok_s'][k]:.0f}" for k in keys]


def format_report(rep: dict[str, Any], *, markdown: bool = False) -> str:
    cfg = rep["config"]
    keys = [f"{cfg['rates_mbps'][0]:g}@{rtt:g}" for rtt in cfg["rtts_ms"]]
    head = HEADER + [f"tok/s {k} ms" for k in keys]
    return table([_row(r, keys) for r in rep["records"]], head, markdown=markdown)


def _best(rep: dict[str, Any], pair: str, warper: str, chain: bool) -> dict[str, Any] | None:
    rows = [r for r in rep["records"] if r["pair"] == pair and r["warper"] == warper
            and r["shape"] != "ar" and r["shape"].startswith("chain:") == chain]
    return min(rows, key=lambda r: r["trips_per_token"]) if rows else None


def section_lines(rep: Any) -> list[str]:
    """The RESULTS section, every sentence computed from the JSON."""
    if rep is None:
        return [HEADING, "", "No `bench/out/trees.json` yet: run `xcosd bench trees`.", ""]
    cfg = rep["config"]
    sizes = []
    if "embedded" in cfg["pairs"]:
        sizes.append(f"embedded pair {cfg['prompts']} prompts x {cfg['tokens']} tokens")
    if "real" in cfg["pairs"]:
        sizes.append(f"real pair {cfg['real_prompts']} x {cfg['real_tokens']}")
    commands = "`" + rep.get("command", "xcosd bench trees").replace("; ", "`; `") + "`"
    out = [HEADING, "",
           f"{commands}: seeded `{cfg['method']}`, branching "
           f"rows as `{cfg['row_codec']}`; {', '.join(sizes)}. "
           "Tree rounds run in process through the methods' round "
           "(`xcosd/bench/trees.py`); a round trip is a verdict or a follow-up. Modeled "
           f"tok/s at {cfg['rates_mbps'][0]:g} Mbit/s with the measured compute; the GPU-like "
           f"column takes {cfg['gpu_call_ms']:g} ms a target call at RTT "
           f"{cfg['gpu_rtt_ms']:g} ms.", ""]
    keys = [f"{cfg['rates_mbps'][0]:g}@{rtt:g}" for rtt in cfg["rtts_ms"]]
    head = HEADER + [f"tok/s RTT {k.split('@')[1]}" for k in keys] + ["GPU-like tok/s"]
    rows = [[*_row(r, keys), f"{r['gpu_tok_s']:.0f}"] for r in rep["records"]]
    out += table(rows, head, markdown=True).splitlines()
    out.append("")
    for pair in cfg["pairs"]:
        for w in cfg["warpers"]:
            tree, chain = _best(rep, pair, w, False), _best(rep, pair, w, True)
            ar = next((r for r in rep["records"] if r["pair"] == pair and r["warper"] == w
                       and r["shape"] == "ar"), None)
            if tree is None or chain is None or ar is None:
                continue
            base = max(ar["gpu_tok_s"], 1e-9)
            out.append(
                f"- {pair}, {w}: fewest round trips per token with a tree "
                f"`{tree['shape']}` {tree['trips_per_token']:.3f}, with a chain "
                f"`{chain['shape']}` {chain['trips_per_token']:.3f}; GPU-like cloud: the tree "
                f"{tree['gpu_tok_s'] / base:.2f}x `ar`, the chain "
                f"{chain['gpu_tok_s'] / base:.2f}x.")
    for pol in rep.get("policies", []):
        rates = ", ".join(f"{b:.2f}" for b in pol["rates"])
        out.append(f"- {pol['pair']}, {pol['warper']}: per-rank acceptance measured "
                   f"({rates}; rank 1 is a chain's), a node costing {pol['node_cost']:.3f} of "
                   f"a GPU-like round: the policy picks `{pol['pick']}`.")
    out.append("")
    return out


def load_reports(out_dir: Path = OUT.parent) -> dict[str, Any] | None:
    """Every ``trees*.json`` in ``out_dir`` as one report (a pair may be run on its own,
    ``--json bench/out/trees_real.json``): records and policies in file order, the
    pairs named once, the first file's settings otherwise."""
    reps = [json.loads(p.read_text()) for p in sorted(out_dir.glob("trees*.json"))]
    if not reps:
        return None
    merged = dict(reps[0])
    merged["config"] = dict(reps[0]["config"])
    merged["records"] = [r for rep in reps for r in rep["records"]]
    merged["policies"] = [p for rep in reps for p in rep.get("policies", [])]
    pairs: list[str] = []
    for rep in reps:
        pairs += [p for p in rep["config"]["pairs"] if p not in pairs]
        for k in ("prompts", "tokens", "real_prompts", "real_tokens"):
            if "real" in rep["config"]["pairs"] and k.startswith("real"):
                merged["config"][k] = rep["config"][k]
    merged["config"]["pairs"] = pairs
    merged["command"] = "; ".join(str(rep.get("command", "xcosd bench trees")) for rep in reps)
    return merged


def write_report(rep: dict[str, Any], path: Path = OUT) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rep, indent=1))
    return path


__all__ = ["HEADING", "OUT", "TreesConfig", "format_report", "load_reports", "run_trees",
           "section_lines", "write_report"]
