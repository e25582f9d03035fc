"""Everything ``make bench`` runs, in order, then ``docs/RESULTS.md``.

    .venv/bin/python -m xcosd.bench.run_all [--skip-real] [--only STEP,...]

Each step is a separate process (a crash or a hung model cannot take the others
down) whose exact command line, exit status and wall time are saved in
``bench/out/run_all.json``; :mod:`xcosd.bench.results` prints them in RESULTS.md.
The sizes below were chosen so the whole run fits in about 43 minutes on 2 cores.

Run it from the repository root: every step reads and writes ``bench/out/`` and
``docs/`` relative to the working directory (see :data:`xcosd.bench.report.OUT_DIR`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from xcosd.bench.report import OUT_DIR

OUT = OUT_DIR
IMG = Path("docs") / "img"
PY = sys.executable
XCOSD = [PY, "-m", "xcosd"]


def steps(skip_real: bool) -> list[tuple[str, list[str]]]:
    """(name, argv) of every step."""
    out = str(OUT)  # relative: every step runs in the working directory
    s: list[tuple[str, list[str]]] = [
        ("models", [PY, "-m", "xcosd.bench.models", "--rounds", "200"]),
        ("codecs", [PY, "-m", "xcosd.bench.codecs", "--rows", "8"]),
        # warpers on a 262k row, and a batch's warping + verification per session
        ("sampling", [PY, "-m", "xcosd.bench.sampling"]),
        ("transport", [PY, "-m", "xcosd.bench.transport"]),
        # a whole round against the bare echo: 64 devices, a near-free target
        ("rounds", [PY, "-m", "xcosd.bench.transport", "--rounds"]),
        # the cloud's and the devices' CPU per round against a bare echo server's per
        # message, 3 methods x 64/256 devices x 2 warpers x 3 vocabularies (about 5 min),
        # beside docs/cloud_cpu_before.json
        ("cloud-cpu", [PY, "-m", "xcosd.bench.cloud_cpu", "--profile"]),
        ("load-scaling", [*XCOSD, "bench", "load", "--scaling", "1,4,16,64,256", "--duration", "4",
                          "--warmup", "2", "--json", f"{out}/load_scaling.json",
                          "--no-progress"]),
        # 1, 2 and 4 replicas behind one broker, then one of 2 killed mid-run
        ("scale", [*XCOSD, "bench", "scale", "--json", f"{out}/scale.json"]),
        ("load-64", [*XCOSD, "bench", "load", "-n", "64", "--duration", "8", "--warmup", "2",
                     "--json", f"{out}/load.json", "--no-progress"]),
        # every method x codec at T=1 and greedy: cheap warpers, the full grid
        ("methods-dense", [*XCOSD, "bench", "methods", "--warpers", "T=1,greedy",
                           "--prompts", "6", "--tokens", "48", "--tv-trials", "2000",
                           "--json", f"{out}/methods_dense.json", "--no-progress"]),
        # top-p / top-k: warping a 128k-256k row costs tens of ms, so fewer codecs and
        # tokens (the codecs that matter for sparse rows)
        ("methods-truncated", [*XCOSD, "bench", "methods", "--warpers", "top-p 0.95,top-k 50",
                               "--codecs", "f32,q8,sparse,sparse+zstd,topk:64",
                               "--prompts", "3", "--tokens", "32", "--tv-trials", "1500",
                               "--live", "none", "--json", f"{out}/methods_truncated.json",
                               "--no-progress"]),
    ]
    # verdicts streamed from the loop against a batch verified in the worker thread
    s.append(("streaming", [PY, "-m", "xcosd.bench.streaming", "--json",
                            f"{out}/streaming.json"]))
    # the OpenAI-compatible API against the edge's own stream, 1 and 16 streams
    s.append(("http-api", [PY, "-m", "xcosd.bench.http_api", "--json", f"{out}/http_api.json"]))
    # 1,000 streams at once through one edge's API, each checked against generate
    s.append(("http-streams", [*XCOSD, "bench", "http-streams", "--json",
                               f"{out}/http_streams.json"]))
    # warp + verify per batch: the accelerator path in torch on the CPU against numpy
    s.append(("accel", [PY, "-m", "xcosd.bench.accel", "--json", f"{out}/accel.json"]))
    # drafting while a verdict is in flight, on and off (sleeping synthetic models)
    s.append(("overlap", [PY, "-m", "xcosd.bench.overlap", "--json", f"{out}/overlap.json"]))
    # the soak (256 devices, faults throughout) for 600 s, its memory baseline at 360 s
    # (after the cloud's restart at 300 s): over ZeroMQ a connection's queue memory is
    # only all allocated after its first few hundred messages, about 6 minutes at the
    # soak's rate; the control measures that for bare pyzmq at the same rate
    s.append(("soak", [*XCOSD, "bench", "soak", "--duration", "600", "--warmup-fraction",
                       "0.6", "--json", f"{out}/soak.json", "--no-progress"]))
    s.append(("zmq-memory", [PY, "-m", "xcosd.bench.zmq_memory", "--duration", "240",
                             "--json", f"{out}/zmq_memory.json"]))
    if not skip_real:
        s.append(("methods-real", [*XCOSD, "bench", "methods", "--pairs", "real", "--methods",
                                   "ar,straightforward,xcosd,xcosd-e,target-resample",
                                   "--codecs", "f32", "--warpers", "T=1", "--prompts", "1",
                                   "--real-tokens", "12", "--tv-trials", "600",
                                   "--tv-contexts", "1", "--live", "none",
                                   "--json", f"{out}/methods_real.json", "--no-progress"]))
        # the model layer against the same model's own generate (target and draft)
        s.append(("model-layer", [PY, "-m", "xcosd.bench.model_layer",
                                  "--json", f"{out}/model_layer.json"]))
        # batched verification on the real target: cost and copy share per batch
        s.append(("kv-batch", [PY, "-m", "xcosd.bench.kv_batch", "--sessions", "1,8,64",
                               "--contexts", "64,1024,2048", "--json", f"{out}/kv_batch.json"]))
        # more sessions than the llama.cpp target keeps caches for: 4, 8, 12 slots
        s.append(("slots", [PY, "-m", "xcosd.bench.slots", "--json", f"{out}/slots.json"]))
        # the pair end to end against transformers' generate and its assisted generation
        s.append(("real-pair", [PY, "-m", "xcosd.bench.real_pair", "--prompts", "3",
                                "--tokens", "32", "--json", f"{out}/real_pair.json"]))
        # the pair on llama.cpp against torch: the draft step, ar, end to end modeled
        s.append(("edge-runtime", [PY, "-m", "xcosd.bench.edge_runtime", "--prompts", "3",
                                   "--tokens", "32", "--json", f"{out}/edge_runtime.json"]))
        # the pair report against seeded runs, and the pair live over an emulated link
        s.append(("pair-report", [*XCOSD, "pair", "smollm2-135m@llama.cpp", "gemma3-270m@llama.cpp",
                                  "--threads", "1", "--prompts", "16", "--tokens", "48",
                                  "--measure", "--json", "--out", f"{out}/pair_report.json"]))
        s.append(("live-link", [PY, "-m", "xcosd.bench.live_link", "--json",
                                f"{out}/live_link.json"]))
        # multi-turn chats through the OpenAI API, prefix reuse on and off
        s.append(("chat", [PY, "-m", "xcosd.bench.chat_turns", "--json",
                           f"{out}/chat_turns.json"]))
    s.append(("results", [PY, "-m", "xcosd.bench.results"]))
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.run_all", description=__doc__.splitlines()[0])
    ap.add_argument("--skip-real", action="store_true",
                    help="skip the SmolLM2 -> Gemma-3 pair (its two models load in minutes)")
    ap.add_argument("--only", default=None, help="comma list of step names")
    args = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    IMG.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    log_path = OUT / "run_all.json"
    done: dict[str, dict[str, object]] = {}
    if only is not None and log_path.exists():
        done = {s["name"]: s for s in json.loads(log_path.read_text()).get("steps", [])}
    env = {**os.environ, "MPLBACKEND": "Agg"}
    t_all = time.perf_counter()
    failed = 0
    for name, cmd in steps(args.skip_real):
        if only is not None and name not in only:
            continue
        shown = " ".join(shlex.quote(c) for c in cmd).replace(PY, "python")
        print(f"== {name}: {shown}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, env=env)
        wall = time.perf_counter() - t0
        print(f"== {name}: exit {rc} in {wall:.1f} s", flush=True)
        failed += rc != 0
        done[name] = {"name": name, "command": shown, "rc": rc, "wall_s": wall}
        order = [n for n, _ in steps(args.skip_real)]
        log = {"steps": sorted(done.values(), key=lambda s: order.index(str(s["name"]))
                               if s["name"] in order else 99),
               "total_s": sum(float(str(s["wall_s"])) for s in done.values())}
        log_path.write_text(json.dumps(log, indent=1))
    print(f"== all steps in {time.perf_counter() - t_all:.1f} s, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
