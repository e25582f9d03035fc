"""The pair report: what a draft/target pair can gain, measured before deploying it.

A user learns whether a pair pays from four facts, each measured here on sample
text (the target's own generations by default, since that is the text the draft
must predict):

* **where the target's mass sits**: on V_C (where a draft token can be accepted),
  on ids of strings the target spells twice that V_C does not hold, and on V_O
  strings the draft spells as two tokens, three or more, or not at all;
* **the acceptance ceiling** per warper: ``sum over V_C of min(p, q)`` at each
  position, ``p`` the warped target row and ``q`` the draft's warped row restricted
  to V_C (TLI): the chance that a drafted token is accepted, exactly, for every
  lossless method (``bytes_ceiling`` verifies against every target id with the
  draft token's bytes instead, the most a pairing could give);
* **the draft step**, measured on the draft model;
* from those, **the predicted round trips per token** (chains at the draft-length
  policy's length, and the tree policy's shape for its rank rates) and the modeled
  tok/s against ``ar`` at the round-trip times and cloud cost per call given.

The prediction for chains walks each sample sequence with its own per-position
ceilings (a round of ``k`` drafts at position ``i`` accepts ``j`` with probability
``a_i ... a_{i+j-1} (1 - a_{i+j})``), so it keeps how acceptance clusters rather
than assuming one mean rate. :func:`measure` runs seeded ``xcosd-e`` generations
through the protocol state machines on the same prompts, so a report can be checked
against what the pair does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import VocabError
from ..nodes.drafter import tli_row
from ..policies.draft_length import DEFAULT_CAP, DEFAULT_COST, DraftLength, best_length
from ..policies.tree_policy import best_shape, expected_tokens, round_cost
from ..sampling import SamplingParams, warp
from ..vocab import VocabMap
from .real_pair import PROMPTS as REAL_PAIR_PROMPTS

#: the warpers a report looks at
WARPERS: dict[str, SamplingParams] = {
    "T=1": SamplingParams(),
    "T=0.7 top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "greedy": SamplingParams(temperature=0.0),
}
#: sample prompts when no text is given (the target continues each): the real-pair
#: benches' prompts, and two where numbers and punctuation are dense
PROMPTS = [*REAL_PAIR_PROMPTS,
           "In 1969, the population of the city was 12,345; by 2020,",
           "Q: What is 17 times 23?\nA:"]
Progress = Callable[[str, int, int], None]


@dataclass
class Sample:
    """One sample sequence: the target ids of its prompt and of its text."""

    prompt: list[int]
    text: list[int]


def _quiet(phase: str, done: int, total: int) -> None:
    return None


def target_samples(target: Any, prompts: Sequence[str], tokens: int, seed: int,
                   params: SamplingParams | None = None,
                   progress: Progress = _quiet) -> list[Sample]:
    """The target's own continuations of ``prompts`` under ``params`` (seeded): the
    text the draft has to predict in use, which differs by warper (greedy text is
    the most predictable)."""
    params = params or SamplingParams()
    rng = np.random.default_rng(seed)
    out = []
    for k, prompt in enumerate(prompts):
        ids = target.tokenize(prompt)
        s = target.start(ids)
        text: list[int] = []
        row = target.score([(s, [])])[0][-1]
        stop = set(target.vocab.roles.values())
        for _ in range(tokens):
            p = np.asarray(warp(row, params), dtype=np.float64)
            t = int(rng.choice(p.shape[0], p=p / p.sum()))
            if t in stop:
                break
            text.append(t)
            row = target.score([(s, [t])])[0][-1]
        target.end(s)
        out.append(Sample(ids, text))
        progress("sampling", k + 1, len(prompts))
    return out


def text_samples(target: Any, text: str, tokens: int, count: int) -> list[Sample]:
    """Windows of a user's text: ``count`` windows of ``tokens`` target tokens, each
    after 16 tokens of its own context."""
    ids = target.tokenize(text)
    span = tokens + 16
    if len(ids) < span:
        return [Sample(ids[:1], ids[1:])] if len(ids) > 1 else []
    starts = np.linspace(0, len(ids) - span, num=max(1, count)).astype(int)
    return [Sample(ids[a:a + 16], ids[a + 16:a + span]) for a in sorted(set(starts.tolist()))]


@dataclass
class Rows:
    """The target's and the draft's rows at every position of one sample."""

    p: np.ndarray  # (n, |V_T|)
    q: np.ndarray  # (n, |V_D|)


def score_sample(draft: Any, target: Any, vmap: VocabMap, sample: Sample) -> Rows:
    """One forward a side: the target's rows before each text token, the draft's
    rows at the same points of its own spelling of the context."""
    s = target.start(sample.prompt)
    p = target.score([(s, sample.text)])[0][:len(sample.text)]
    target.end(s)
    dprompt = draft.tokenize(vmap.target.decode(sample.prompt).decode("utf-8", "replace"))
    spelled = [vmap.draft_spelling(t) for t in sample.text]
    flat = [d for ds in spelled for d in ds]
    s = draft.start(dprompt)
    rows = draft.score([(s, flat)])[0]
    draft.end(s)
    at = np.cumsum([0, *[len(ds) for ds in spelled[:-1]]]) if spelled else np.zeros(0, int)
    return Rows(np.asarray(p, dtype=np.float32), np.asarray(rows[at], dtype=np.float32))


def _duplicate_other(vmap: VocabMap) -> np.ndarray:
    """Target ids of strings the target spells twice that V_C does not hold."""
    out = [i for ids in vmap.target.duplicates.values() for i in ids if not vmap.common_mask[i]]
    return np.array(sorted(out), dtype=np.int64)


def _spelling_classes(vmap: VocabMap) -> np.ndarray:
    """Per target id: 0 in V_C, 1 a V_O string the draft spells as one token, 2 as
    two, 3 as three or more, 4 not at all (and -1 for specials / unused)."""
    cls = np.full(vmap.target.size, -1, dtype=np.int8)
    cls[vmap.common_mask] = 0
    for t in np.flatnonzero(vmap.other_mask).tolist():
        if t in vmap.target.special_ids:
            cls[t] = 4
            continue
        try:
            n = len(vmap.draft.encode_bytes(vmap.target.token_bytes(t)))
        except VocabError:
            n = 0
        cls[t] = 4 if n == 0 else min(n, 3)
    return cls


def ceilings(vmap: VocabMap, rows: Rows, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Per position: ``sum_{V_C} min(p, q)`` (the acceptance of a drafted token) and
    the same against every target id with the draft token's bytes."""
    ct = vmap.common_target_ids
    groups = [(vmap.target.byte_index.get(b), ids) for b, ids in vmap.target.duplicates.items()]
    merge = [(w, [i for i in ids if i != w]) for w, ids in groups
             if w is not None and vmap.common_mask[w]]
    acc, by_bytes = [], []
    for p_row, q_row in zip(rows.p, rows.q, strict=True):
        p = np.asarray(warp(p_row, params), dtype=np.float64)
        got = tli_row(q_row, vmap, params)  # the proposal the edge drafts from
        if got is None:  # the draft puts no mass on V_C: nothing can be accepted
            acc.append(0.0)
            by_bytes.append(0.0)
            continue
        q = got[0].astype(np.float64)
        pc = p[ct]
        acc.append(float(np.minimum(pc, q).sum()))
        pm = p.copy()
        for w, others in merge:
            pm[w] += pm[others].sum()
        by_bytes.append(float(np.minimum(pm[ct], q).sum()))
    return np.array(acc), np.array(by_bytes)


def chain_trips(alphas: np.ndarray, k: int) -> float:
    """Expected rounds to emit the whole sequence whose position ``i`` accepts a
    draft with probability ``alphas[i]``, ``k`` drafts a round (a round ends at the
    first rejection with the resolved token, or after ``k`` with the bonus)."""
    n = alphas.shape[0]
    if k <= 0:
        return float(n)
    rounds = np.zeros(n + 1)
    for i in range(n - 1, -1, -1):
        total, run = 1.0, 1.0
        for j in range(k + 1):
            if i + j >= n:
                break
            nxt = min(n, i + j + 1)
            if j == k:
                total += run * rounds[nxt]
                break
            a = alphas[i + j]
            total += run * (1.0 - a) * rounds[nxt]
            run *= a
        rounds[i] = total
    return float(rounds[0])


def policy_trips(alphas: np.ndarray, *, step_cost: float, cap: int, runs: int,
                 rng: np.random.Generator) -> float:
    """Expected rounds to emit the sequence under the draft-length policy itself
    (:class:`~xcosd.policies.draft_length.DraftLength`, seeded generations' set
    cost): its length follows its acceptance estimate round by round, so runs of
    low acceptance cost shorter rounds, which :func:`chain_trips` at one ``k``
    misses. Monte Carlo over ``runs`` walks; a round drafts at most one token
    fewer than are left, as a session does."""
    n = alphas.shape[0]
    total = 0
    for _ in range(runs):
        policy = DraftLength(cost=step_cost, cap=cap)
        pos = 0
        while pos < n:
            k = min(policy.ceiling, n - pos - 1)
            j = 0
            u = rng.random(k) if k else ()
            while j < k and u[j] < alphas[pos + j]:
                j += 1
            policy.settled(k, j)
            pos += j + 1
            total += 1
    return total / runs


def predict(alphas: Sequence[np.ndarray], second: float, *, step_cost: float, cap: int,
            seed: int = 0) -> dict[str, Any]:
    """Round trips per token for chains under the draft-length policy
    (:func:`policy_trips`; ``draft_len`` is its length at the mean ceiling) and for
    the tree policy's pick at rank rates ``(mean, second)``."""
    mean = float(np.mean(np.concatenate(alphas))) if alphas else 0.0
    k = best_length(mean, step_cost, cap, lo=0)
    tokens = sum(a.shape[0] for a in alphas)
    rng = np.random.default_rng(seed)
    trips = sum(policy_trips(a, step_cost=step_cost, cap=cap, runs=200, rng=rng)
                for a in alphas)
    rates = [mean, second]
    shape = best_shape(rates, step_cost)
    e = expected_tokens(shape, rates)
    return {"mean_ceiling": mean, "draft_len": k,
            "trips_per_token": trips / max(1, tokens),
            "trips_per_token_fixed_len": sum(chain_trips(a, k) for a in alphas) / max(1, tokens),
            "tree": {"shape": shape.label, "rank_rates": rates,
                     "trips_per_token": 1.0 / e,
                     "cost_per_token": round_cost(shape, step_cost) / e}}


def second_rank_rate(vmap: VocabMap, rows: Rows, params: SamplingParams) -> float:
    """A second sibling's acceptance: ``sum_{V_C} min(r, q)`` with ``r`` the residual
    ``norm(max(p - q, 0))`` after the first was rejected (siblings i.i.d.), averaged
    with the first's rejection as weight."""
    num = den = 0.0
    ct = vmap.common_target_ids
    for p_row, q_row in zip(rows.p, rows.q, strict=True):
        p = np.asarray(warp(p_row, params), dtype=np.float64)
        got = tli_row(q_row, vmap, params)
        if got is None:
            continue
        q = got[0].astype(np.float64)
        res = p.copy()
        res[ct] = np.maximum(p[ct] - q, 0.0)
        z = res.sum()
        if z <= 1e-12:
            continue
        num += z * float(np.minimum(res[ct] / z, q).sum())
        den += z
    return num / den if den > 0 else 0.0


def draft_step_s(draft: Any, prompt_ids: Sequence[int], steps: int = 16) -> float:
    """Seconds of one draft step (score one token after the context), the median."""
    s = draft.start(list(prompt_ids))
    draft.score([(s, [])])
    times = []
    tok = int(prompt_ids[-1]) if prompt_ids else 0
    for _ in range(steps):
        t0 = time.perf_counter()
        draft.score([(s, [tok])])
        times.append(time.perf_counter() - t0)
    draft.end(s)
    return float(np.median(times))


def model_speed(trips_per_token: float, draft_len: float, rtt_s: float, cloud_s: float,
                step_s: float) -> float:
    """Modeled tok/s: a round costs a round trip, a cloud call and its draft steps."""
    tokens_per_round = 1.0 / max(trips_per_token, 1e-9)
    return tokens_per_round / (rtt_s + cloud_s + draft_len * step_s)


def report(draft: Any, target: Any, samples: dict[str, list[Sample]], *,
           rtts_ms: Sequence[float], cloud_ms: float, step_cost: float = DEFAULT_COST,
           cap: int = DEFAULT_CAP, progress: Progress = _quiet) -> dict[str, Any]:
    """The whole report (JSON-ready). ``samples``: per warper of :data:`WARPERS`, the
    text its ceilings are measured on (the same list for all, for a user's text);
    where the mass sits is measured on the first."""
    vmap = VocabMap(draft.vocab, target.vocab)
    dup_t, dup_d = target.vocab.duplicates, draft.vocab.duplicates

    def how(v: Any, b: bytes, ids: tuple[int, ...], side: str) -> dict[str, Any]:
        w = v.byte_index[b]
        pair = int(vmap.target_to_draft[w] if side == "target" else vmap.draft_to_target[w])
        return {"bytes": b.decode("utf-8", "backslashreplace"), "ids": list(ids),
                "written": w, "written_by_tokenizer": w in v.spelled, "paired_with": pair}

    scored: dict[int, list[Rows]] = {}
    total = sum(len(v) for v in samples.values())
    for lst in samples.values():
        if id(lst) not in scored:
            scored[id(lst)] = [score_sample(draft, target, vmap, smp) for smp in lst if smp.text]
        progress("scoring", sum(len(s) for s in scored.values()), total)
    rows = scored[id(next(iter(samples.values())))]
    cls = _spelling_classes(vmap)
    dup_other = _duplicate_other(vmap)
    mass = np.zeros(5)
    dup_mass = 0.0
    n = 0
    for r in rows:
        p = r.p.astype(np.float64)
        for c in range(5):
            mass[c] += p[:, cls == c].sum()
        dup_mass += p[:, dup_other].sum() if dup_other.shape[0] else 0.0
        n += p.shape[0]
    n = max(n, 1)
    warpers: dict[str, Any] = {}
    step_s = draft_step_s(draft, draft.tokenize(PROMPTS[0]))
    for name, params in WARPERS.items():
        alphas, by_bytes = [], []
        warper_rows = scored[id(samples[name])]
        for r in warper_rows:
            a, b = ceilings(vmap, r, params)
            alphas.append(a)
            by_bytes.append(b)
        second = (float(np.mean([second_rank_rate(vmap, r, params) for r in warper_rows]))
                  if warper_rows else 0.0)
        pred = predict(alphas, second, step_cost=step_cost, cap=cap)
        pred["bytes_ceiling"] = float(np.mean(np.concatenate(by_bytes))) if by_bytes else 0.0
        speeds = {}
        for rtt in rtts_ms:
            ar = 1.0 / ((rtt + cloud_ms) / 1e3)
            chain = model_speed(pred["trips_per_token"], pred["draft_len"], rtt / 1e3,
                                cloud_ms / 1e3, step_s)
            speeds[f"{rtt:g}"] = {"ar_tok_s": ar, "xcosd_tok_s": chain, "speedup": chain / ar}
        pred["modeled"] = speeds
        warpers[name] = pred
        progress("ceilings", len(warpers), len(WARPERS))
    return {
        "draft": draft.name, "target": target.name,
        "vocab": {**vmap.summary(),
                  "duplicated": {"target": [how(target.vocab, b, ids, "target")
                                            for b, ids in dup_t.items()],
                                 "draft": [how(draft.vocab, b, ids, "draft")
                                           for b, ids in dup_d.items()]}},
        "sample": {"sequences": len(rows), "positions": int(n),
                   "per_warper": {k: sum(len(s.text) for s in v) for k, v in samples.items()}},
        "mass": {"v_c": mass[0] / n, "duplicate_not_in_v_c": dup_mass / n,
                 "v_o_draft_one_token": mass[1] / n, "v_o_draft_two_tokens": mass[2] / n,
                 "v_o_draft_three_or_more": mass[3] / n, "v_o_draft_cannot_spell": mass[4] / n},
        "draft_step_ms": step_s * 1e3,
        "cloud_ms": cloud_ms,
        "step_cost": step_cost,
        "warpers": warpers,
    }


def measure(draft: Any, target: Any, samples: dict[str, list[Sample]], *, seed: int = 1,
            progress: Progress = _quiet) -> dict[str, dict[str, float]]:
    """Measured round trips per token per warper (and the follow-up trips among
    them): seeded ``xcosd-e`` generations of each sample's length from its prompt,
    through the protocol state machines."""
    from ..nodes.pump import Pump

    pump = Pump(target, draft)
    out: dict[str, dict[str, float]] = {}
    for name, params in WARPERS.items():
        trips = tokens = extra = 0
        for i, smp in enumerate(samples[name]):
            if not smp.text:
                continue
            g = pump.generate("xcosd-e", prompt=target.vocab.decode(smp.prompt).decode(
                "utf-8", "replace"), max_new_tokens=len(smp.text), params=params,
                seed=seed + i)
            trips += g.stats.rounds + g.stats.extra_round_trips
            extra += g.stats.extra_round_trips
            tokens += g.stats.tokens
            progress(f"measuring {name}", i + 1, len(samples[name]))
        out[name] = {"trips_per_token": trips / max(1, tokens),
                     "follow_up_trips_per_token": extra / max(1, tokens)}
    return out


HEADING = "## The pair report against measured runs"
OUT_NAME = "pair_report.json"
#: the goal: the predicted round trips per token within this of the measured, per warper
GOAL_REL = 0.10


def section_lines(rep: dict[str, Any] | None) -> list[str]:
    """RESULTS.md's section from ``xcosd pair ... --measure --json``'s output."""
    if rep is None or "measured" not in rep:
        return []
    from .report import table

    m = rep["mass"]
    rows, goal_lines = [], []
    for name, w in rep["warpers"].items():
        meas = rep["measured"][name]["trips_per_token"]
        rel = w["trips_per_token"] / meas - 1.0
        rows.append([name, f"{w['mean_ceiling']:.3f}", f"{w['bytes_ceiling']:.3f}",
                     str(w["draft_len"]), f"{w['trips_per_token']:.3f}", f"{meas:.3f}",
                     f"{100 * rel:+.1f} %", w["tree"]["shape"],
                     f"{w['tree']['trips_per_token']:.3f}"])
        goal_lines.append(f"- {name}: predicted {w['trips_per_token']:.3f}, measured {meas:.3f} "
                          f"round trips per token ({100 * rel:+.1f} %; goal within "
                          f"{100 * GOAL_REL:.0f} %: {'met' if abs(rel) <= GOAL_REL else 'not met'}).")
    s = rep["sample"]
    dup = rep["vocab"]["duplicated"]["target"]
    return [HEADING, "",
            f"From `xcosd pair {rep['draft']}@llama.cpp {rep['target']}@llama.cpp --measure "
            f"--json` (bench/out/{OUT_NAME}): {s['sequences']} sample sequences of the target's "
            f"own text per warper ({s['positions']} positions at T=1). The target spells "
            f"{len(dup)} strings twice; V_C pairs {sum(d['written_by_tokenizer'] for d in dup)} "
            "of them by the id its tokenizer writes. The target's mass on V_C: "
            f"{100 * m['v_c']:.2f} %; on a twice-spelled string's other id: "
            f"{m['duplicate_not_in_v_c']:.1e} of it; on V_O strings the draft spells as two "
            f"tokens {100 * m['v_o_draft_two_tokens']:.2f} %, three or more "
            f"{100 * m['v_o_draft_three_or_more']:.2f} %. Draft step "
            f"{rep['draft_step_ms']:.1f} ms. Measured: seeded xcosd-e through the protocol "
            "state machines on the same prompts and lengths (independent draws of the text).", "",
            table(rows, ["warper", "ceiling", "by bytes", "k", "predicted trips/token",
                         "measured", "error", "tree pick", "tree trips/token"], markdown=True),
            "", *goal_lines, *_trip_goal(rep), ""]


#: the goal for seeded xcosd-e at T=1 on the real pair, round trips per token
GOAL_TRIPS = 0.50


def _trip_goal(rep: dict[str, Any]) -> list[str]:
    got = rep["measured"].get("T=1", {}).get("trips_per_token")
    if got is None:
        return []
    return [f"- seeded xcosd-e at T=1, default settings: {got:.3f} round trips per token "
            f"(goal <= {GOAL_TRIPS:.2f}: {'met' if got <= GOAL_TRIPS else 'not met'})."]
