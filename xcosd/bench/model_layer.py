"""Each position computed once: xcosd's model layer against the same model's own
``generate``, in one run.

    .venv/bin/python -m xcosd.bench.model_layer [--prompts 3] [--tokens 32] [--passes 5]

For the real pair's target (Gemma-3-270m) and draft (SmolLM2-135M-Instruct), with
the same weights and one torch thread, each prompt is continued by exactly
``--tokens`` sampled tokens (T = 1, no top-k, no top-p) in two ways:

* ``generate``: transformers' ``model.generate(do_sample=True, ...)``, the loop a
  user would otherwise run;
* ``layer``: :class:`~xcosd.models.TransformersModel`'s ``start`` / ``score`` /
  ``append``, one row per step sampled with :func:`xcosd.sampling.sample_index`:
  what the cloud does in an ``ar`` round and the device in a draft step, without
  the network.

Passes alternate the two (the machine is shared and drifts); the report gives each
pass's tokens/s and the median ratio ``layer / generate`` per model. A ratio below
1 would mean the layer does work ``generate`` does not (a position fed twice, a
history copied, the output head run on rows nobody reads).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from xcosd.bench.real_pair import DRAFT, PROMPTS, TARGET, pair_main
from xcosd.bench.report import machine, table

#: the issue's bar for the layer against generate
GOAL = 0.95


def _generate(m: Any, prompts: list[str], tokens: int) -> float:
    """tokens/s of ``generate`` over ``prompts``."""
    import torch

    tok = m.tokenizer
    done, wall = 0, 0.0
    for i, prompt in enumerate(prompts):
        enc = tok(prompt, return_tensors="pt")
        torch.manual_seed(i)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = m.model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                   max_new_tokens=tokens, min_new_tokens=tokens,
                                   pad_token_id=tok.eos_token_id)
            wall += time.perf_counter() - t0
        done += int(out.shape[1] - enc["input_ids"].shape[1])
    return done / wall


def _layer(m: Any, prompts: list[str], tokens: int) -> float:
    """tokens/s of the model layer over ``prompts``, the same context as
    :func:`_generate` (``start`` adds the BOS the tokenizer adds)."""
    import numpy as np

    from xcosd.sampling import sample_index

    rng = np.random.default_rng(0)
    bos = m.vocab.roles.get("bos")
    done, wall = 0, 0.0
    for prompt in prompts:
        ids = list(m.tokenizer(prompt)["input_ids"])
        if bos is not None and ids[:1] == [bos]:
            ids = ids[1:]
        t0 = time.perf_counter()
        s = m.start(ids)
        for _ in range(tokens):
            row = m.score([(s, [])])[0][-1]
            m.append(s, [sample_index(row, rng)])
        wall += time.perf_counter() - t0
        m.end(s)
        done += tokens
    return done / wall


def run(n_prompts: int, tokens: int, passes: int) -> dict[str, Any]:
    import torch

    from xcosd.models import load_model

    torch.set_num_threads(1)
    prompts = PROMPTS[:n_prompts]
    models: dict[str, Any] = {}
    for name in (TARGET, DRAFT):
        m = load_model(name)
        _generate(m, prompts[:1], 4)  # warm-up, untimed
        _layer(m, prompts[:1], 4)
        runs = []
        for p in range(passes):
            # alternate which goes first: a drift of the machine's speed favours neither
            first, second = (_generate, _layer) if p % 2 == 0 else (_layer, _generate)
            a = first(m, prompts, tokens)
            b = second(m, prompts, tokens)
            g, lay = (a, b) if first is _generate else (b, a)
            runs.append({"generate_tok_s": g, "layer_tok_s": lay, "ratio": lay / g})
            print(f"  {name} pass {p + 1}: generate {g:.2f} tok/s, layer {lay:.2f} tok/s, "
                  f"ratio {lay / g:.3f}", flush=True)
        models[name] = {
            "passes": runs,
            "generate_tok_s": statistics.median(r["generate_tok_s"] for r in runs),
            "layer_tok_s": statistics.median(r["layer_tok_s"] for r in runs),
            "ratio": statistics.median(r["ratio"] for r in runs),
        }
        del m
    return {"schema_version": 1, "kind": "model_layer", "prompts": n_prompts,
            "tokens_per_prompt": tokens, "passes": passes, "torch_threads": 1, "goal": GOAL,
            "models": models, "machine": machine()}


def format_report(rep: dict[str, Any], markdown: bool = False) -> str:
    rows = [[name, f"{r['generate_tok_s']:.2f}", f"{r['layer_tok_s']:.2f}", f"{r['ratio']:.3f}",
             " ".join(f"{p['ratio']:.2f}" for p in r["passes"])]
            for name, r in rep["models"].items()]
    return table(rows, ["model", "generate tok/s", "layer tok/s", "layer / generate",
                        "per pass"], markdown=markdown)


def main(argv: list[str] | None = None) -> int:
    return pair_main(argv, "xcosd.bench.model_layer", __doc__, 5,
                     "alternating generate / layer passes (medians reported)",
                     "model_layer.json", run, format_report)


if __name__ == "__main__":
    raise SystemExit(main())
