"""Model costs on this machine, and the default pair's acceptance.

    .venv/bin/python -m xcosd.bench.models [--rounds N] [--real] [--quick]

Prints a table and writes ``bench/out/models.json``:

* first-run training time of the default n-gram pair (corpus extraction included,
  in a fresh cache directory);
* per backend: ms per draft step (one ``score([(s, [])])`` after an ``append``) and
  ms per verification of ``d + 1`` positions (one ``score([(s, d drafts)])`` and
  the rollback a rejection costs);
* acceptance of the default pair under method ``xcosd`` at T=1, d=4, measured on
  text the target generates itself: whole generations through the real edge and
  cloud state machines, in process (:class:`xcosd.nodes.pump.Pump`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xcosd.bench.report import OUT_DIR
from xcosd.models import LanguageModel
from xcosd.nodes.pump import Pump
from xcosd.nodes.stats import GenerationStats, merge
from xcosd.vocab import VocabMap

D = 4
OUT = OUT_DIR / "models.json"


@dataclass
class Acceptance:
    """The pair's acceptance: the generations' counters (one
    :class:`~xcosd.nodes.stats.GenerationStats`, summed), plus what only this
    measurement asks about V_O."""

    stats: GenerationStats = field(default_factory=GenerationStats)
    other_tokens: int = 0  # emitted target tokens outside V_C
    other_resolved: int = 0  # rejections resolved to a V_O token
    samples: list[str] = field(default_factory=list)


def measure_acceptance(draft: LanguageModel, target: LanguageModel, *, rounds: int = 400,
                       d: int = D, method: str = "xcosd", seed: int = 0,
                       max_len: int = 120) -> Acceptance:
    """Acceptance of ``draft`` for ``target`` over at least ``rounds`` rounds: whole
    generations from empty prompts (each ends at EOS or after ``max_len`` tokens)
    through the real state machines in process (:class:`~xcosd.nodes.pump.Pump`)."""
    pump = Pump(target, draft)
    acc = Acceptance()
    other = pump.vmap.other_mask
    gens = []
    i = 0
    while acc.stats.rounds < rounds:
        g = pump.generate(method, prompt="", max_new_tokens=max_len, draft_len=d,
                          seed=seed * 100_003 + i)
        i += 1
        gens.append(g.stats)
        acc.stats = merge(gens)
        acc.other_tokens += sum(1 for t in g.token_ids if other[t])
        acc.other_resolved += sum(1 for t in g.resolved if other[t])
        if len(acc.samples) < 3:
            acc.samples.append(g.text[:160])
    return acc


def time_backend(model: LanguageModel, prompt: str, *, d: int = D,
                 reps: int = 20) -> dict[str, float]:
    """Median ms of one draft step and of one verification of ``d + 1`` positions."""
    ids = model.tokenize(prompt)
    s = model.start(ids)
    model.score([(s, [])])
    base = len(s.ids)
    step, verify = [], []
    rng = np.random.default_rng(0)
    for _ in range(reps):
        t0 = time.perf_counter()
        row = model.score([(s, [])])[0][0]
        step.append(time.perf_counter() - t0)
        model.append(s, [int(np.argmax(row))])
        model.rollback(s, base)
        new = [int(x) for x in rng.choice(ids, size=d)]
        t0 = time.perf_counter()
        model.score([(s, new)])
        model.rollback(s, base)
        verify.append(time.perf_counter() - t0)
    model.end(s)
    return {"draft_step_ms": 1e3 * statistics.median(step),
            "verify_ms": 1e3 * statistics.median(verify)}


def first_run_training() -> dict[str, float]:
    """Seconds to build the default pair from nothing: corpus extraction, vocabulary
    loading and training, in an empty cache directory."""
    from xcosd.models import default_pair

    old = os.environ.get("XCOSD_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XCOSD_CACHE"] = tmp
        try:
            t0 = time.perf_counter()
            default_pair()
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            default_pair()
            cached = time.perf_counter() - t0
        finally:
            if old is None:
                del os.environ["XCOSD_CACHE"]
            else:
                os.environ["XCOSD_CACHE"] = old
    return {"first_run_s": first, "cached_s": cached}


PROMPT = ("Return a new list containing all items from the iterable in ascending order. "
          "A custom key function can be supplied to customize the sort order, and the")


def time_vocab_map(draft: str, target: str, runs: int = 3) -> dict[str, Any]:
    """Milliseconds to build the V_C map between two real vocabularies (median): the
    edge pays it once per connection when it is not given a ready map."""
    from xcosd.vocab import Vocabulary

    d, t = Vocabulary.load(draft), Vocabulary.load(target)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        VocabMap(d, t)
        times.append(time.perf_counter() - t0)
    return {"draft": draft, "target": target, "runs": runs,
            "build_ms": 1e3 * statistics.median(times)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.models", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=400, help="rounds for the acceptance measurement")
    ap.add_argument("--real", action="store_true", help="also time SmolLM2 / Gemma-3 (installed)")
    ap.add_argument("--quick", action="store_true", help="skip first-run training and acceptance")
    args = ap.parse_args(argv)

    from xcosd.models import SyntheticModel, default_pair

    result: dict[str, Any] = {"d": D, "cpus": os.cpu_count()}
    if not args.quick:
        result["training"] = first_run_training()
    draft, target = default_pair()
    backends: dict[str, LanguageModel] = {
        draft.name + " (default draft)": draft,
        target.name + " (default target)": target,
        "synthetic:qwen": SyntheticModel("qwen"),
    }
    try:
        backends.update(_tiny_transformers())
    except ImportError as e:  # the models extra is not installed
        result["transformers_skipped"] = str(e)
    if args.real:
        from xcosd.models import load_model

        for name in ("smollm2-135m", "gemma3-270m"):
            backends[name] = load_model(name)
    result["backends"] = {n: time_backend(m, PROMPT) for n, m in backends.items()}
    result["vocab_map"] = time_vocab_map("llama3", "qwen")
    if not args.quick:
        acc = measure_acceptance(draft, target, rounds=args.rounds)
        vmap = VocabMap(draft.vocab, target.vocab)
        result["acceptance"] = {
            "draft": draft.name, "target": target.name, "method": "xcosd", "temperature": 1.0,
            "d": D, "rounds": acc.stats.rounds, "acceptance_rate": acc.stats.acceptance_rate,
            "mean_acceptance_length": acc.stats.mean_acceptance_length,
            "tokens": acc.stats.tokens,
            "other_tokens": acc.other_tokens, "other_resolved": acc.other_resolved,
            "n_common": vmap.n_common, "n_other": vmap.n_other, "samples": acc.samples,
        }

    print(f"{'backend':44} {'draft step ms':>14} {'verify d+1 ms':>14}")
    for n, r in result["backends"].items():
        print(f"{n:44} {r['draft_step_ms']:14.3f} {r['verify_ms']:14.3f}")
    vm = result["vocab_map"]
    print(f"V_C map {vm['draft']} -> {vm['target']}: built in {vm['build_ms']:.0f} ms "
          f"(median of {vm['runs']})")
    if "training" in result:
        t = result["training"]
        print(f"default pair: first run {t['first_run_s']:.1f} s, cached {t['cached_s']:.2f} s")
    if "acceptance" in result:
        a = result["acceptance"]
        print(f"default pair ({a['draft']} -> {a['target']}, xcosd, T=1, d={D}, {a['rounds']} "
              f"rounds): acceptance rate {a['acceptance_rate']:.3f}, mean acceptance length "
              f"{a['mean_acceptance_length']:.2f}, V_O tokens {a['other_tokens']}/{a['tokens']}, "
              f"rejections resolved to V_O {a['other_resolved']}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(f"wrote {OUT}")
    return 0


def _tiny_transformers() -> dict[str, LanguageModel]:
    """A tiny local Llama (the CI test model) for the transformers backend's overhead."""
    from xcosd.models.tiny import tiny_llama

    return {"transformers: tiny llama (4 layers)": tiny_llama()}


if __name__ == "__main__":
    raise SystemExit(main())
