"""Write ``docs/RESULTS.md`` and its plots (``docs/img/*.png``) from ``bench/out/*.json``.

    .venv/bin/python -m xcosd.bench.results [--only NAME]

``--only NAME`` rewrites just that section of the current RESULTS.md (from its JSON in
``bench/out/``), leaving the others as they are: one bench can be rerun on its own
without rerunning every other one.

All three paths are relative to the working directory (the repository root, where
``make bench`` runs it): the JSON comes from :data:`~xcosd.bench.report.OUT_DIR`.

Nothing in RESULTS.md is typed by hand: every number comes from the JSON the
benches wrote, and every sentence that compares numbers is computed from them
(which method is fastest at a rate, whether a TV is above its noise ...). Missing
JSON files are reported as missing, not invented.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from xcosd.bench import (
    accel,
    balancing_ways,
    chat_turns,
    cloud_cpu,
    edge_runtime,
    http_api,
    http_streams,
    live_link,
    pair_report,
    plots,
    scale,
    slots,
    streaming,
    trees,
)
from xcosd.bench.load import SCALING_HEADER, batching_mode, generation_settings, scaling_rows
from xcosd.bench.methods import format_report, merge_reports
from xcosd.bench.report import OUT_DIR, machine, table

OUT = OUT_DIR
DOC = Path("docs") / "RESULTS.md"
IMG = Path("docs") / "img"

#: a TV estimate counts as "above noise" beyond this many standard errors (about a
#: hundred records are tested, so 3 would raise a false alarm now and then)
TV_SIGMAS = 4.0


def _load(name: str) -> Any:
    p = OUT / name
    return json.loads(p.read_text()) if p.exists() else None


def _rel(cmd: str | None) -> str:
    """A command line as run from the repository root (no machine-specific paths)."""
    return (cmd or "").replace(str(Path.cwd()) + "/", "")


def _img(path: Path, alt: str) -> str:
    return f"![{alt}](img/{path.name})"


def _f(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


# ------------------------------------------------------------------ sections


def section_machine(run: Any, rep_machine: dict[str, Any] | None) -> list[str]:
    m = rep_machine or machine()
    lines = ["## Machine and commands", "",
             f"- CPU: {m.get('cpu_model')}, {m.get('nproc')} usable cores "
             f"(`nproc`), {m.get('memory_gib')} GiB memory; {m.get('platform')}",
             f"- Python {m.get('python')}, numpy {m.get('numpy')}, torch {m.get('torch')}, "
             f"pyzmq {m.get('pyzmq')}, xcosd {m.get('xcosd')}",
             "- The machine is shared and noisy: compare numbers within one run (ratios), not "
             "across runs.", ""]
    if run:
        lines += ["`make bench` ran these steps (`python` is the project's virtualenv "
                  "interpreter):", ""]
        rows = [[s["name"], f"`{_rel(s['command'])}`", s["rc"], f"{s['wall_s']:.0f}"]
                for s in run["steps"]]
        lines += [table(rows, ["step", "command", "exit", "seconds"], markdown=True), "",
                  f"Total: {run['total_s'] / 60:.1f} minutes.", ""]
    else:
        lines += ["(bench/out/run_all.json is missing: the steps were run by hand.)", ""]
    return lines


def section_load(rep: Any) -> list[str]:
    if rep is None:
        return ["## Load test", "", "bench/out/load.json is missing.", ""]
    c = rep["config"]
    g = generation_settings(c)  # nested in newer reports, top-level in older ones
    paths = plots.load_plots(rep, IMG)
    lat = [[name, *(f"{rep[key][q]:.1f}" for q in ("p50", "p90", "p99", "max")),
            rep[key]["count"]]
           for name, key in (("per token", "token_latency_ms"), ("round", "round_latency_ms"),
                             ("time to first token", "ttft_ms"),
                             ("time per output token", "tpot_ms"),
                             ("queue wait (cloud)", "queue_wait_ms"))]
    pd = rep["per_device_tokens_per_s"]
    err = ", ".join(f"{k} {v}" for k, v in rep["errors"].items())
    idl = rep.get("ideal") or {}
    errs = "**zero errors**" if rep["errors_total"] == 0 else f"{rep['errors_total']} errors"
    lines = [
        f"## Load test: {rep['devices']} devices", "",
        f"Command: `{_rel(rep.get('command', 'xcosd bench load'))}`", "",
        f"{rep['devices']} closed-loop devices ({c['procs']} device process(es), each device a "
        f"real `EdgeNode` with its own {c['transport']} connection) against one `CloudNode` "
        f"serving `{c['target']}` (draft `{rep['draft']}`), method {g['method']}/{g['codec']}, "
        f"{g['max_new_tokens']} tokens per generation, batching "
        f"{'on (max ' + str(c['max_batch']) + ')' if c['batching'] else 'off'}; "
        f"{c['warmup_s']:g} s warm-up excluded, {rep['window_s']:.1f} s measured.", "",
        table([["tokens/s (aggregate)", f"{rep['tokens_per_s']:,.1f}"],
               ["rounds/s (aggregate)", f"{rep['rounds_per_s']:,.1f}"],
               ["tokens/s per device (min / p50 / max)",
                f"{pd['min']:.1f} / {pd['p50']:.1f} / {pd['max']:.1f}"],
               ["acceptance rate / mean acceptance length",
                f"{rep['acceptance_rate']:.3f} / {rep['mean_acceptance_length']:.2f}"],
               ["bytes per token up / down (wire)",
                f"{rep['bytes']['up_per_token']:.1f} / {rep['bytes']['down_per_token']:.1f}"],
               ["cloud batches / mean size / busy",
                f"{rep['batches']} / {rep['mean_batch_size']:.1f} / "
                f"{100 * rep['cloud']['busy_fraction']:.0f}%"],
               ["ideal tokens/s (cost model) / efficiency",
                f"{_f(idl.get('tokens_per_s'), ',.1f')} / {_f(idl.get('efficiency'), '.2f')}"],
               ["errors", f"{rep['errors_total']} ({err})"]],
              ["metric", "value"], markdown=True), "",
        table(lat, ["latency (ms)", "p50", "p90", "p99", "max", "samples"], markdown=True), "",
        *(_img(p, p.stem) for p in paths), "",
        (f"The run finished with {errs} "
         f"over {rep['generations']['started']} generations. Per-token latency is a round's "
         f"wall time divided by the tokens it committed (one sample per token); its median "
         f"{rep['token_latency_ms']['p50']:.1f} ms is below the median round latency "
         f"{rep['round_latency_ms']['p50']:.1f} ms because each round commits "
         f"{rep['tokens_per_round']:.2f} tokens on average. The cloud ran "
         f"{rep['batches']} batches of {rep['mean_batch_size']:.1f} sessions on average "
         f"and was computing {100 * rep['cloud']['busy_fraction']:.0f}% of the window; the "
         f"rest of each round is queueing ({rep['queue_wait_ms']['p50']:.1f} ms median) and "
         f"the devices' own drafting and messaging."), "",
    ]
    return lines


def section_scaling(sc: Any) -> list[str]:
    if sc is None:
        return ["## Scaling", "", "bench/out/load_scaling.json is missing.", ""]
    path = plots.scaling_plot(sc, IMG / "load_scaling.png")
    rows = scaling_rows(sc)
    shown = [[r[0], r[1], f"{r[2]:,.1f}", _f(r[3], ",.1f"), _f(r[4], ".2f"), f"{r[5]:.1f}",
              f"{r[6]:.1f}", f"{r[7]:.1f}", r[8], _f(r[9], ".2f"), _f(r[10], ".2f")]
             for r in rows]
    base = sc["base"]
    pts = sc["points"]
    on = {p["devices"]: p for p in pts if batching_mode(p["config"]) == "on"}
    off = {p["devices"]: p for p in pts if batching_mode(p["config"]) == "off"}
    plain = {p["devices"]: p for p in pts if batching_mode(p["config"]) == "no merge"}
    gains = {n: on[n]["tokens_per_s"] / off[n]["tokens_per_s"]
             for n in on if n in off and off[n]["tokens_per_s"] > 0}
    best_n = max(gains, key=lambda n: gains[n]) if gains else None
    effs_on = [(n, e) for n, p in on.items()
               if (e := (p.get("ideal") or {}).get("efficiency")) is not None]
    total_err = sum(p["errors_total"] for p in pts)
    a_ms = 1e3 * ((pts[0].get("ideal") or {}).get("a_s") or 0.0)
    b_ms = 1e3 * ((pts[0].get("ideal") or {}).get("b_s") or 0.0)
    para = [
        f"Target `{base['target']}`: every target call costs a = {a_ms:g} ms plus "
        f"b = {b_ms:g} ms per returned row (a session with d drafts returns d + 1 rows). "
        "For a batch of B sessions with r rows each and L tokens per round, the ideal "
        "closed-loop throughput is B·L / (a + b·B·r) with B = min(devices, max batch) "
        "(B = 1 without batching); *efficiency* is measured / ideal, the share of the cost "
        "model's best that the scheduler, the protocol and the devices deliver.",
    ]
    if gains:
        para.append(
            "Batching multiplies throughput by "
            + ", ".join(f"{gains[n]:.2f}x at {n}" for n in sorted(gains))
            + f" devices (largest at {best_n}). Without batching the cloud serves one "
            "session per call, so throughput stays flat at the single-session rate however "
            "many devices wait.")
    if effs_on:
        lo = min(effs_on, key=lambda t: t[1])
        hi = max(effs_on, key=lambda t: t[1])
        fill = ", ".join(f"{100 * on[n]['mean_batch_size'] / min(n, on[n]['config']['max_batch']):.0f}%"
                         f" at {n}" for n in sorted(on) if n > 1)
        para.append(
            f"With batching, efficiency ranges from {lo[1]:.2f} ({lo[0]} devices) to "
            f"{hi[1]:.2f} ({hi[0]} devices). The mean batch holds {fill} of the devices the "
            "ideal assumes in every batch.")
    if plain:
        merged = {n: on[n]["tokens_per_s"] / plain[n]["tokens_per_s"]
                  for n in on if n in plain and plain[n]["tokens_per_s"] > 0}
        fill_plain = ", ".join(
            f"{100 * plain[n]['mean_batch_size'] / min(n, plain[n]['config']['max_batch']):.0f}%"
            f" at {n}" for n in sorted(plain) if n > 1)
        para.append(
            "Without the merge policy (*no merge*) a batch starts as soon as the target is "
            "free: the devices whose verdicts just went out come back to a busy target and "
            "queue, and the devices take turns in two groups for good, paying the fixed cost "
            f"a twice per cycle; its mean batch holds {fill_plain} of the devices. Holding a "
            "partial batch for the sessions just answered, when they come back sooner than a "
            "(both measured; `xcosd/nodes/merging.py`), changes throughput by "
            + ", ".join(f"{merged[n]:.2f}x at {n}" for n in sorted(merged))
            + " devices.")
        full = [n for n in sorted(merged)
                if max(on[n]["mean_batch_size"], plain[n]["mean_batch_size"])
                < 0.6 * min(n, on[n]["config"]["max_batch"])]
        if full:
            para.append(
                f"At {', '.join(map(str, full))} devices both modes' batches stop at the "
                "cloud's row bound (`max_batch_tokens`, 256 rows by default) well short of "
                "the device count: there is no room to merge, and the ratio is noise.")
    para.append(f"Errors over the whole sweep: {total_err}.")
    return ["## Scaling: devices x batching", "",
            f"Command: `{_rel(sc.get('command', 'xcosd bench load --scaling ...'))}` "
            f"({base['duration_s']:g} s measured after {base['warmup_s']:g} s warm-up per point).",
            "", table(shown, SCALING_HEADER, markdown=True), "", _img(path, "scaling"), "",
            " ".join(para), ""]


def section_soak(rep: Any) -> list[str]:
    """The soak's section (:func:`xcosd.bench.soak.section_lines`), its plot redrawn."""
    from xcosd.bench import soak

    if rep is None:
        return soak.section_lines(None)
    path = soak.plot(rep, IMG / "soak.png")
    return soak.section_lines(rep, f"img/{path.name}", _load("zmq_memory.json"))


def _fastest(records: list[dict[str, Any]], rate: str, lossless_only: bool) -> dict[str, Any]:
    pool = [r for r in records if r["lossless"] or not lossless_only]
    return max(pool, key=lambda r: r["modeled_tokens_per_s"].get(rate, 0.0))


def _significant(r: dict[str, Any]) -> bool:
    return (r["tv_to_target"] is not None and r["tv_stderr"] is not None
            and r["tv_to_target"] > TV_SIGMAS * max(r["tv_stderr"], 1e-12)
            and r["tv_to_target"] > 0.005)


def section_methods(rep: Any) -> list[str]:
    if rep is None:
        return ["## Methods", "", "No bench/out/methods*.json.", ""]
    recs = rep["records"]
    paths = plots_methods(rep)
    lines = ["## Methods x codecs x warpers", ""]
    for run in rep.get("runs", []):
        lines.append(f"- `{_rel(run.get('command'))}` ({_f(run.get('elapsed_s'), '.0f')} s)")
    lines += ["",
              "Columns: acceptance rate (accepted / drafted), L (mean acceptance length, "
              "1 + accepted / rounds), target calls per token, wire bytes per token up and "
              "down (frames plus ZMTP framing, session open and close included), downlink "
              "bytes per round with a rejection, follow-up round trips per token, the "
              "measured TV of the output to the target (± standard error; see below), "
              "modeled tokens/s at each downlink rate with "
              f"{rep['config']['rtt_ms']:g} ms RTT, and tokens/s measured live through real "
              "nodes over ZeroMQ with the link emulator.", "",
              format_report(rep, markdown=True), ""]
    lines += [_img(p, p.stem) for p in paths] + [""]
    lines += ["### What the tables show", ""]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in recs:
        groups.setdefault((r["pair"], r["warper"]), []).append(r)
    for (pair, w), rows in groups.items():
        rates = sorted(rows[0]["modeled_tokens_per_s"], key=float)
        f32 = {r["method"]: r for r in rows if r["codec"] == "f32"}
        parts = []
        fast = []
        for rate in rates:
            a = _fastest(rows, rate, True)
            b = _fastest(rows, rate, False)
            s = (f"at {rate} Mbps the fastest lossless configuration is {a['method']}/"
                 f"{a['codec']} ({a['modeled_tokens_per_s'][rate]:.1f} tokens/s)")
            if b is not a:
                s += (f", the fastest overall {b['method']}/{b['codec']} "
                      f"({b['modeled_tokens_per_s'][rate]:.1f}, lossy)")
            fast.append(s)
        parts.append("Modeled throughput: " + "; ".join(fast) + ".")
        sf = f32.get("straightforward")
        for m in ("xcosd", "xcosd-e"):
            if sf and m in f32 and sf["downlink_bytes_per_token"] > 0:
                s = (f"{m} sends {f32[m]['downlink_bytes_per_token'] / sf['downlink_bytes_per_token']:.3g}x "
                     f"the downlink bytes per token of straightforward (both f32: "
                     f"{f32[m]['downlink_bytes_per_token']:,.0f} vs "
                     f"{sf['downlink_bytes_per_token']:,.0f} B/token")
                a, b = f32[m]["downlink_bytes_per_rejection"], sf["downlink_bytes_per_rejection"]
                if a and b:
                    s += (f"; per rejection {a:,.0f} vs {b:,.0f} B, {a / b:.3g}x; per-token "
                          "ratios also carry the runs' different rejection counts")
                parts.append(s + ").")
        ar = f32.get("ar")
        if ar:
            spec = [r for m, r in f32.items() if m != "ar" and r["cloud_calls_per_token"] > 0]
            if spec:
                lo = min(spec, key=lambda r: r["cloud_calls_per_token"])
                hi = max(spec, key=lambda r: r["cloud_calls_per_token"])
                parts.append(
                    f"Cloud target calls per token: ar {ar['cloud_calls_per_token']:.2f}; the "
                    f"drafting methods {lo['cloud_calls_per_token']:.2f} ({lo['method']}) to "
                    f"{hi['cloud_calls_per_token']:.2f} ({hi['method']}), i.e. "
                    f"{ar['cloud_calls_per_token'] / hi['cloud_calls_per_token']:.1f}-"
                    f"{ar['cloud_calls_per_token'] / lo['cloud_calls_per_token']:.1f}x fewer.")
        sig = sorted({f"{r['method']}/{r['codec']}" for r in rows if _significant(r)})
        measured = [r for r in rows if r["tv_to_target"] is not None]
        clean = [r for r in measured if r["lossless"] and (r["tv_commit"] or 0.0) == 0.0]
        hidden = sorted({r["method"] for r in measured if not r["lossless"]}
                        - {r["method"] for r in measured if _significant(r)})
        if measured:
            s = (f"Measured TV above {TV_SIGMAS:g} standard errors ({len(measured)} "
                 "configurations tested): " + (", ".join(sig) if sig else "none") + ".")
            if clean and all(r["tv_to_target"] == 0.0 and r["tv_stderr"] == 0.0 for r in clean):
                s += " Lossless methods with an exact commit (p* = p) measure exactly 0."
            elif clean:
                worst = max(abs(r["tv_to_target"]) / r["tv_stderr"] for r in clean
                            if r["tv_stderr"])
                s += (" Lossless methods with an exact commit (p* = p) stay within "
                      f"{worst:.1f} standard errors of 0.")
            few = min(r["tv_trials"] for r in measured)
            if few < 2000:
                s += (f" Only {few} one-draft rounds per configuration here: at this size the "
                      "witness estimate is skewed (a few heavily weighted resolved rejections) "
                      "and its standard error unreliable, so these TV values do not separate "
                      "methods.")
            elif hidden:
                s += (" Lossy methods not separated from 0 at these contexts: "
                      + ", ".join(hidden) + " (their error depends on the context; the "
                      "estimate is a lower bound).")
            parts.append(s)
        live = [r for r in rows if r.get("live")]
        if live:
            ratios = [r["live"]["tokens_per_s"] / r["modeled_tokens_per_s"][
                f"{r['live']['rate_mbps']:g}"] for r in live
                if r["modeled_tokens_per_s"].get(f"{r['live']['rate_mbps']:g}")]
            if ratios:
                parts.append(
                    f"Live runs at {live[0]['live']['rate_mbps']:g} Mbps reach "
                    f"{min(ratios):.2f}-{max(ratios):.2f}x the modeled tokens/s (the live "
                    "path adds the event loop, the draft thread hop and real sleeps).")
        lines += [f"**{pair}, {w}.** " + " ".join(parts), ""]
    lines += [
        "### How the TV to the target is measured", "",
        "At a few fixed contexts (the prompts), the method's own server and device halves "
        "run thousands of one-draft rounds on the real model rows, and we record the first "
        "token each round emits; for a lossless method its law P is exactly the warped "
        "target row p. The plug-in TV of an empirical distribution over 10^5 tokens is "
        "dominated by sampling noise, so we use a held-out *witness set*: TV(P, p) = "
        "max_A P(A) − p(A); half of the trials choose A = {x : P̂(x) > p(x)}, the other "
        "half estimate P(A) − p(A), and the halves swap roles. This is unbiased for a "
        "lower bound of TV (exactly 0 in expectation for an exact method) and comes with a "
        "standard error. Rejections are the costly part, so only a random subset of them "
        "is resolved, each weighted by rejected / resolved in its half; the estimate stays "
        "unbiased. `tv_commit` in the JSON is TV(p, p*), the distance the commit rule "
        "predicts for a lossless method with a lossy codec.", ""]
    return lines


def plots_methods(rep: dict[str, Any]) -> list[Path]:
    from xcosd.bench.methods import plot_report

    return plot_report(rep, IMG)


REAL_PAIR_HEADING = "## The real pair end to end"
KV_HEADING = "## Batched verification on a real target"


def section_kv(kv: Any) -> list[str]:
    if kv is None:
        return []
    from xcosd.bench.kv_batch import format_report as kv_table

    pts = {(p["sessions"], p["context"]): p for p in kv["points"]}
    big = pts.get((64, 1024))
    lines = [KV_HEADING, "",
             f"From `python -m xcosd.bench.kv_batch` (bench/out/kv_batch.json): {kv['model']}, "
             f"one `score` call verifying {kv['rows']} new tokens for each of N sessions whose "
             f"caches hold the given context (random states: the cost depends on shapes, not "
             f"values), {kv['threads']} torch thread, the faster of two calls. The copy share "
             "is the time spent copying caches over the call's time.", "",
             kv_table(kv, markdown=True), ""]
    if big:
        lines += [f"At 64 sessions x 1,024 positions copying is {100 * big['copy_share']:.1f} % "
                  "of the call (goal: at most 10 %): the new states are written into each "
                  "session's own buffers and each session attends over them, so no history is "
                  "gathered into a batch.", ""]
    return lines


MODEL_LAYER_HEADING = "## The model layer against generate"


def section_model_layer(ml: Any) -> list[str]:
    """xcosd's model layer against the same model's ``generate``
    (``python -m xcosd.bench.model_layer``)."""
    if ml is None:
        return []
    from xcosd.bench.model_layer import format_report as layer_table

    worst = min(r["ratio"] for r in ml["models"].values())
    return [MODEL_LAYER_HEADING, "",
            "From `python -m xcosd.bench.model_layer` (bench/out/model_layer.json): each model "
            f"continues {ml['prompts']} prompts by exactly {ml['tokens_per_prompt']} sampled "
            "tokens (T=1) through transformers' `generate` and through xcosd's model layer "
            "(`start` / `score` / `append` and one draw per row: an `ar` round's compute, "
            f"without the network), {ml['torch_threads']} torch thread, the same weights, "
            f"{ml['passes']} alternating passes (medians; each pass's ratio listed).", "",
            layer_table(ml, markdown=True), "",
            f"The slower of the two models runs at {worst:.2f}x its own `generate` through the "
            f"layer (goal: at least {ml['goal']:g}x; {'met' if worst >= ml['goal'] else 'not met'}"
            "). The layer feeds each position once, writes new keys and values into "
            "preallocated per-session buffers (no history copied per step) and runs the "
            "output head only on the rows a call returns.", ""]


OVERLAP_HEADING = "## Drafting while a verdict is in flight"


def section_overlap(ov: Any) -> list[str]:
    """Speculation on against off (``python -m xcosd.bench.overlap``)."""
    if ov is None:
        return []
    from xcosd.bench.overlap import format_report as overlap_table

    def sent(w: dict[str, Any]) -> str:
        on = w["on"]
        return f"{on['speculated_used'] / on['speculated']:.0%}" if on["speculated"] else "none"

    said = "; ".join(f"{name} {w['ratio']:.2f}x ({sent(w)} of the speculated tokens sent as "
                     "drafts)" for name, w in ov["warpers"].items())
    return [OVERLAP_HEADING, "",
            "From `python -m xcosd.bench.overlap` (bench/out/overlap.json): unseeded `xcosd-e` "
            f"over ZeroMQ loopback, a synthetic target that sleeps {ov['target_call_s'] * 1e3:g} "
            f"ms a call and a synthetic draft that sleeps {ov['draft_step_s'] * 1e3:g} ms a step "
            "in the device's draft thread (two machines' compute that does not compete for this "
            "one's cores; the draft ranks tokens as the target does, with a flatter law), "
            f"{ov['prompts']} prompts x {ov['tokens_per_prompt']} tokens, `speculate` on and "
            f"off alternating over {ov['passes']} passes (medians; the ratio is the median of "
            "the ratios within a pass).", "",
            overlap_table(ov, markdown=True), "",
            f"Speculating against not: {said}. Speculation pays only when a verdict takes "
            "the speculated path (the block accepted whole and the bonus the draft's next "
            "token) and a draft step fits in the wait; on the real pair, where the measured "
            "costs make the policy draft almost nothing, it does not run.", ""]


def section_real_pair(rp: Any) -> list[str]:
    if rp is None:
        return []
    from xcosd.bench.real_pair import format_report as real_pair_table

    rows = {r["row"]: r for r in rp["rows"]}
    e, usd, tgt = rows.get("xcosd-e"), rows.get("usd"), rows.get("target-generate")
    lines = [REAL_PAIR_HEADING, "",
             f"From `python -m xcosd.bench.real_pair` (bench/out/real_pair.json): {rp['draft']} "
             f"drafting for {rp['target']}, {rp['prompts']} prompts x "
             f"{rp['tokens_per_prompt']} tokens, T=1, one torch thread per side, the same "
             f"weights in every row, {rp.get('passes', 1)} passes with the rows' order rotated "
             "(the machine is shared and drifts: each ratio is the median over passes of the "
             "ratio within a pass; tok/s is over all passes). "
             "`target-generate` is the target alone through transformers' `generate`; `usd` "
             "is transformers' own cross-tokenizer assisted generation with the assistant's "
             "head unpruned (its pruned default is not lossless); `ar`, `xcosd` and `xcosd-e` "
             "run over ZeroMQ loopback with default settings, unseeded (the draft length "
             "fitted to the measured draft-step and round times), the cloud in its own "
             "process; `xcosd-e seeded` runs seeded generations, whose draft length uses the "
             "fixed default cost. "
             f"The modeled column: the measured edge compute, 100 Mbit/s each way with a 20 ms "
             f"RTT, and a GPU-like cloud at {rp['gpu_call_s'] * 1000:g} ms per target call.", "",
             real_pair_table(rp, markdown=True), ""]
    seeded = rows.get("xcosd-e seeded")
    if e and usd and tgt and seeded and seeded.get("drafted") and e.get("rounds"):
        met = e["vs_usd"] >= 1.3 and e["vs_target"] >= 1.0
        edge_ms = 1000 * seeded["edge_compute_s"] / seeded["drafted"]
        cloud_ms = 1000 * seeded["cloud_compute_s"] / max(seeded["target_calls"], 1)
        lines += [f"With default settings xcosd-e runs at {e['vs_usd']:.2f}x transformers' USD "
                  f"and {e['vs_target']:.2f}x the target alone here (goal: 1.3x and 1.0x; "
                  f"{'met' if met else 'not met'}; `ar` {rows['ar']['vs_usd']:.2f}x and "
                  f"{rows['ar']['vs_target']:.2f}x). On this CPU a forward is bound by reading "
                  f"the weights: in the seeded row a drafted token cost the edge {edge_ms:.0f} "
                  f"ms and a target call the cloud {cloud_ms:.0f} ms, and {seeded['accepted']} "
                  f"of {seeded['drafted']} drafted tokens were accepted. With a draft step at "
                  "about half a target call, drafting pays only well above 50 % acceptance: "
                  "the unseeded policy measures that and drafts "
                  f"{e['drafted'] / e['rounds']:.2f} tokens per round (mostly `ar` rounds, "
                  "probing now and then), while the seeded one, at the fixed default cost (a "
                  "device whose draft step is cheap next to the round trip), drafts "
                  f"{seeded['drafted'] / max(seeded['rounds'], 1):.2f} and runs at "
                  f"{seeded['vs_usd']:.2f}x USD. The modeled column keeps this CPU's edge cost, "
                  "so `ar` leads there too.", ""]
    return lines


def section_transport(tr: Any) -> list[str]:
    if tr is None:
        return ["## Framework overhead", "", "bench/out/transport.json is missing.", ""]
    rows = []
    for payload, block in tr["payloads"].items():
        res = block["results"]
        bare = res.get("bare pyzmq", {})
        for name, v in res.items():
            rows.append([payload, name, f"{v['p50_us']:.0f}", f"{v['p99_us']:.0f}",
                         f"{v['msgs_per_s']:,.0f}",
                         _f(v.get("p50_vs_bare"), ".2f") if name != "bare pyzmq" else "1",
                         _f(v.get("msgs_per_s_vs_bare"), ".2f") if name != "bare pyzmq" else "1"])
        del bare
    zmq_ratios = [(p, b["results"]["xcosd zmq"]["p50_vs_bare"]) for p, b in tr["payloads"].items()
                  if "xcosd zmq" in b["results"]]
    text = ("A round trip through xcosd's framing over ZeroMQ takes "
            + ", ".join(f"{r:.2f}x the bare pyzmq round trip for {p}" for p, r in zmq_ratios)
            + " (median; same machine, same run). Link emulation and the models add far more "
            "per round than this.") if zmq_ratios else ""
    return ["## Framework overhead: xcosd transport vs bare pyzmq", "",
            "From `python -m xcosd.bench.transport` (bench/out/transport.json, "
            f"{tr.get('loop', 'asyncio')} loop).", "",
            table(rows, ["payload", "stack", "RTT p50 µs", "RTT p99 µs", "msgs/s pipelined",
                         "p50 vs bare", "msgs/s vs bare"], markdown=True), "", text, ""]


ROUNDS_HEADING = "## Framework cost per round"


def section_rounds(rr: Any) -> list[str]:
    """What a whole round costs, against the bare pyzmq echo of the same run
    (``python -m xcosd.bench.transport --rounds``)."""
    if rr is None:
        return [ROUNDS_HEADING, "", "bench/out/rounds.json is missing.", ""]
    def med(r: dict[str, Any], key: str) -> float | None:
        vals = [p[key] for p in r["passes"] if p.get(key) is not None]
        return statistics.median(vals) if vals else None

    rows = [[name, f"{r.get('devices', rr['devices']):,}", f"{r['rounds_per_s']:,.0f}",
             _f(statistics.median(p["tokens_per_s"] for p in r["passes"]), ",.0f"),
             f"{r['echo_msgs_per_s']:,.0f}", f"{r['ratio']:.2f}",
             " ".join(f"{p['ratio']:.2f}" for p in r["passes"]),
             _f(med(r, "layout_echo_msgs_per_s"), ",.0f"), _f(r.get("layout_ratio"), ".2f"),
             _f(med(r, "devices_us_per_round"), ".0f"), _f(med(r, "devices_loop_busy"), ".2f"),
             _f(med(r, "cloud_us_per_round"), ".0f"), _f(med(r, "cloud_loop_busy"), ".2f")]
            for name, r in rr["results"].items()]
    m = rr.get("machine") or {}
    lines = [ROUNDS_HEADING, "",
             "From `python -m xcosd.bench.transport --rounds` (bench/out/rounds.json, "
             f"{rr.get('loop', 'asyncio')} loop): {rr['devices']} closed-loop devices in one "
             f"device process against a cloud in the bench's process, target `{rr['target']}` "
             "(sleeps 10 us + 1 us per row, so what is measured is the framework), a fixed "
             "4-token draft per round, "
             f"{rr['duration_s']:g} s measured after {rr['warmup_s']:g} s, on "
             f"{m.get('nproc', '?')} cores ({m.get('cpu_model', 'CPU not recorded')}). The "
             "yardstick is a bare `zmq.asyncio` "
             f"DEALER/ROUTER echo of 32-byte messages, {rr['window']} in flight, run just "
             "before and after each load run in the same process: the ratio is rounds/s over "
             f"echo messages/s, the median over {rr['repeats']} passes (each pass's ratio "
             "listed). The *layout echo* is the same bare echo over the load test's own "
             "sockets: as many DEALERs as devices, one 32-byte message in flight each, "
             "bracketing each load run too (up to 256 devices); its *layout ratio* is what "
             "xcosd costs over the sockets such a test needs, where the first ratio also "
             "counts what that layout costs against one socket with a window.", "",
             table(rows, ["method / transport", "devices", "rounds/s", "tokens/s",
                          "echo msgs/s", "ratio", "per pass", "layout echo msgs/s",
                          "layout ratio", "devices µs/round",
                          "devices loop busy", "cloud µs/round", "cloud loop busy"],
                   markdown=True), "",
             "*µs/round*: the CPU each side's processes spent in the window (every thread) per "
             "round; *loop busy*: the share of the window its event-loop thread ran (the "
             "report's `cpu` field, docs/LOAD.md).", ""]
    e = rr["results"].get("xcosd-e zmq")
    if e is not None:
        lines += [f"xcosd-e over ZeroMQ runs {e['ratio']:.2f}x the bare echo's message rate "
                  "(goal: 0.3x). A round is a draft message and a verdict, each side's "
                  "state machine, the target call through the scheduler and the device's "
                  "drafting and sampling, all in Python; the echo is one `recv` and one "
                  "`send` in a loop. xcosd's ZeroMQ I/O threads run under `SCHED_BATCH` "
                  "(docs/WIRE.md, Transports), so with both cores busy a send no longer "
                  "hands the event loop's core to the I/O thread it wakes; the echo keeps "
                  "libzmq's defaults (under `SCHED_BATCH` it runs no faster)."]
        busy, dev_us = med(e, "devices_loop_busy"), med(e, "devices_us_per_round")
        if busy is not None and dev_us is not None:
            need = 1e6 / (0.3 * e["echo_msgs_per_s"])
            bound = ("so the devices' process is the limit" if busy >= 0.9 else
                     "so neither side's loop is the limit alone")
            loop_us = busy * 1e6 / e["rounds_per_s"]
            lines[-1] += (f" The devices' event loop ran {busy:.0%} of the window, "
                          f"{bound}: it spends {loop_us:.0f} µs on a round (the process "
                          f"{dev_us:.0f} µs of CPU, its ZeroMQ thread included), where 0.3x "
                          f"of this echo is one round every {need:.0f} µs.")
        layout = med(e, "layout_echo_msgs_per_s")
        if layout is not None and e.get("layout_ratio") is not None:
            lines[-1] += (f" Against the layout echo ({rr['devices']} DEALERs, one message "
                          f"in flight each) the same rounds run {e['layout_ratio']:.2f}x: that "
                          f"layout alone echoes {layout / e['echo_msgs_per_s']:.2f} of the "
                          "one-socket echo's rate, a cost any load test of that many "
                          "devices pays, so the first ratio charges it to xcosd.")
        lines.append("")
    many = rr.get("many_devices")
    big = rr["results"].get(f"xcosd-e zmq, {many} devices") if many else None
    if e is not None and big is not None:
        errors = sum(p["errors"] for p in big["passes"])
        lines += [f"With {many:,} devices in the one device process the same round runs "
                  f"{big['rounds_per_s']:,.0f} rounds/s, {big['ratio']:.2f}x the echo and "
                  f"{big['rounds_per_s'] / e['rounds_per_s']:.2f} of the rate at "
                  f"{rr['devices']} devices, with "
                  f"{'no error' if not errors else f'{errors} errors'}: a process holds a ZeroMQ socket "
                  "and descriptors for each device (xcosd/transport/fds.py), ZMTP "
                  "pings each connection every 5 s, not every second "
                  "(xcosd/transport/zeromq.py), and the collector's youngest generation "
                  "holds 50,000 objects, not 700, so that a round's objects die young "
                  "(xcosd/gc_tuning.py, docs/LOAD.md).", ""]
    return lines


SAMPLING_HEADING = "## Warpers and verification at full vocabulary"


def section_sampling(sp: Any) -> list[str]:
    """Warp cost per row and a batch's warping plus verification per session
    (``python -m xcosd.bench.sampling``)."""
    if sp is None:
        return []
    labels = [w for w in next(iter(sp["warp"].values()))]
    warp_rows = [[kind, *(f"{by[w]['ms']:.2f} ({by[w]['kept']:,})" for w in labels)]
                 for kind, by in sp["warp"].items()]
    sessions = list(next(iter(sp["batch"].values())))
    batch_rows = [[label, *(f"{by[n]['ms_per_batch']:.1f} / {by[n]['ms_per_session']:.2f}"
                            for n in sessions)]
                  for label, by in sp["batch"].items()]
    flat = sp["warp"].get("flat", {})
    lines = [SAMPLING_HEADING, "",
             "From `python -m xcosd.bench.sampling` (bench/out/sampling.json), rows of "
             f"{sp['vocab']:,} ids (Gemma-3's vocabulary size). Warp: the median ms of "
             "`xcosd.sampling.warp` on one row (kept tokens in brackets) for four row shapes: "
             "`flat` (uniform noise), `llm` (softmax of bf16 logits with a peaked head), `zipf` "
             "(shuffled 1/rank^1.1), `peaked` (Cauchy logits).", "",
             table(warp_rows, ["row", *labels], markdown=True), ""]
    if "top-p 0.95" in flat and "top-k 50" in flat:
        worst = {w: max(by[w]["ms"] for by in sp["warp"].values()) for w in ("top-p 0.95",
                                                                              "top-k 50")}
        lines += [f"On the flat row top-p 0.95 takes {flat['top-p 0.95']['ms']:.2f} ms and "
                  f"top-k 50 {flat['top-k 50']['ms']:.2f} ms (goal: at most 1 ms each); over "
                  f"the {len(sp['warp'])} row shapes at most {worst['top-p 0.95']:.2f} and "
                  f"{worst['top-k 50']:.2f} ms.", ""]
    lines += ["Batch: the scheduler's `score_batch` over N sessions x 5 rows (4 drafts and "
              "the bonus row) of `llm` rows from a model that returns them at no cost, "
              "xcosd-e / f32: each session's rows warped as its verification reads them, then "
              "its verification (commit, accept tests, a bonus token or the rejection's "
              "candidates); ms per batch / per session.", "",
              table(batch_rows, ["warper", *(f"{n} session{'s' if n != '1' else ''}"
                                             for n in sessions)], markdown=True), ""]
    lo, hi = sessions[0], sessions[-1]
    change = ", ".join(f"{label} {by[lo]['ms_per_session']:.2f} -> {by[hi]['ms_per_session']:.2f}"
                       for label, by in sp["batch"].items())
    lines += [f"Per session from {lo} to {hi} sessions: {change} ms. A row's warp is a few "
              "passes over 1 MB of memory and a session's verification works on its own rows, "
              "so batching saves no per-row work on a CPU; a large batch's rows also stop "
              "fitting the caches.", ""]
    vec = sp.get("vector")
    if vec:
        ns = list(next(iter(vec.values())))
        vec_rows = [[label, *(f"{by[n]['row_by_row_ms']:.3f} / {by[n]['one_call_ms']:.3f}"
                              for n in ns)] for label, by in vec.items()]
        ratio = ", ".join(f"{label} {by[ns[-1]]['one_call_ms'] / by[ns[-1]]['row_by_row_ms']:.2f}x"
                          for label, by in vec.items())
        trend = "; ".join(
            f"{label} {by[ns[0]]['row_by_row_ms']:.2f} -> {by[ns[-1]]['row_by_row_ms']:.2f} "
            f"row by row, {by[ns[0]]['one_call_ms']:.2f} -> {by[ns[-1]]['one_call_ms']:.2f} "
            "in one call" for label, by in vec.items())
        lines += ["One call or row by row: ms per row of warping N `llm` rows (the rows one "
                  "verification step reads across N sessions) with `warp` on each row in turn "
                  "/ in one vectorised call on the N-row block (the same bits either way).", "",
                  table(vec_rows, ["warper", *(f"{n} row{'s' if n != '1' else ''}" for n in ns)],
                        markdown=True), "",
                  f"At {ns[-1]} rows one call costs, per row, {ratio} what warping row by row "
                  f"costs. Per row from {ns[0]} to {ns[-1]} rows (ms): {trend}. A vectorised "
                  "call saves only the per-call overhead, tens of microseconds against a row's "
                  "passes over 1 MB, and each of its passes runs over the whole block, which "
                  "no longer fits the caches; so the cloud warps each session's rows of this "
                  "length as its verification reads them (and only those). Where a call's "
                  "fixed cost dominates, one call per batch pays: rows of at most 4,096 ids "
                  "a batch warps together (`warp_together` in xcosd/nodes/scoring.py; "
                  "top-p at 256 ids, 100 rows: about 3 us a row, against 11 us for one row "
                  "alone), and so would an accelerator's kernel launches, which this machine "
                  "has none to measure.", ""]
    return lines


def section_codecs(cd: Any) -> list[str]:
    if cd is None:
        return []
    lines = ["## Codecs on real rows", "",
             f"From `python -m xcosd.bench.codecs` ({cd['rows']} rows of the {cd['source']}; "
             f"|V_C| = {cd['n_common']:,}, |V_T| = {cd['n_target']:,}).", ""]
    for w, block in cd["warpers"].items():
        rows = [[name, f"{v['bytes_hr']:,.0f}", f"{v['bytes_full']:,.0f}",
                 f"{v['encode_us']:,.0f}", f"{v['decode_us']:,.0f}", f"{v['tv_full_mean']:.2e}"]
                for name, v in block["codecs"].items()]
        lines += [f"**{w}** (mean non-zeros per row {block['nonzero_mean']:,.0f})", "",
                  table(rows, ["codec", "HR bytes", "full bytes", "encode µs", "decode µs",
                               "TV(p, p*)"], markdown=True), ""]
    return lines


def section_models(md: Any) -> list[str]:
    if md is None:
        return []
    rows = [[n, f"{v['draft_step_ms']:.3f}", f"{v['verify_ms']:.3f}"]
            for n, v in md.get("backends", {}).items()]
    lines = ["## Model costs", "", "From `python -m xcosd.bench.models` (bench/out/models.json).", "",
             table(rows, ["backend", "draft step ms", f"verify d+1={md.get('d', 4) + 1} ms"],
                   markdown=True), ""]
    a = md.get("acceptance")
    if a:
        lines += [f"Default pair acceptance ({a['draft']} -> {a['target']}, {a['method']}, T=1, "
                  f"d={a['d']}, {a['rounds']} rounds): acceptance rate "
                  f"{a['acceptance_rate']:.3f}, mean acceptance length "
                  f"{a['mean_acceptance_length']:.2f}.", ""]
    return lines


def sizes_note(run: Any) -> list[str]:
    return ["## Sizes used", "",
            "To fit `make bench` in about 43 minutes on 2 cores the sizes are small: the "
            "load tests measure 4 s (scaling points) and 8 s (64 devices) after 2 s of "
            "warm-up, the cloud CPU rows 3 s after 1.5 s (3 s at 128k and 262k; 3 passes at "
            "vocab 256); the "
            "methods grid runs 6 prompts x 48 tokens at T=1 and greedy (every "
            "method and codec), 3 prompts x 32 tokens at top-p 0.95 and top-k 50 (5 "
            "codecs), the real pair 1 prompt x 12 tokens "
            "(f32, T=1); the TV uses 2000 (1500 at top-p/top-k, 600 for the real pair) "
            "one-draft rounds per context at 3 contexts (1 for the real pair), and the real "
            "pair end to end 3 prompts x 32 tokens per row, the slots bench 12 sessions "
            "of 96 prompt tokens x 6 tokens; the soak runs "
            "256 devices for 600 s (its memory baseline at 360 s), and its bare-pyzmq "
            "control 240 s. Small samples "
            "make acceptance rates noisy by a few percent; the commands above take larger "
            "sizes (`--prompts`, `--tokens`, `--tv-trials`, `--duration`).", ""]


#: a section another tool writes (``bench/mutation.py --update-results``, hours of
#: CPU): carried over from the current file rather than dropped
MUTATION_HEADING = "## Mutation testing"
#: figures from a lent GPU (bench/gpu_check.py, ``make gpu-check``): kept as written,
#: since ``make bench`` runs where there is none
GPU_HEADING = "## The accelerator check"


#: the heading of guidellm's run against an edge, kept as it is when the file is
#: written again: guidellm is not among the project's dependencies, so ``make
#: bench`` cannot run it (the section says how it was run)
GUIDELLM_HEADING = "## guidellm against the edge"


def kept_section(heading: str) -> list[str]:
    """The lines of ``heading``'s section in the current RESULTS.md (to the next
    ``## `` heading), or nothing when there is none."""
    if not DOC.exists():
        return []
    lines = DOC.read_text().splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        return []
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
               len(lines))
    return [*lines[start:end], ""]


def replace_section(text: str, heading: str, section: list[str], before: tuple[str, ...]) -> str:
    """``text`` with the section whose heading starts with ``heading`` (up to the next
    ``## `` heading) replaced by ``section``; without one, ``section`` goes before the
    first heading that starts with one of ``before``, else at the end."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(heading)), None)
    if start is None:
        at = next((i for i, ln in enumerate(lines) if ln.startswith(before)), len(lines))
        end = at
        start = at
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))
    new = [*lines[:start], *section, *lines[end:]]
    return "\n".join(new).rstrip() + "\n"


#: what ``--only`` can rewrite: name -> (heading prefix, the section, the headings
#: it goes before when the file has none yet)
SECTIONS = {"load": ("## Load test", lambda: section_load(_load("load.json")),
                     ("## Scaling", "## Replicas", "## Soak", "## Methods", "## Sizes used",
                      MUTATION_HEADING)),
            "scaling": ("## Scaling", lambda: section_scaling(_load("load_scaling.json")),
                        ("## Replicas", "## Soak", "## Methods", "## Sizes used",
                         MUTATION_HEADING)),
            "soak": ("## Soak", lambda: section_soak(_load("soak.json")),
                     ("## Methods", REAL_PAIR_HEADING, "## Framework overhead", "## Sizes used",
                      MUTATION_HEADING)),
            "kv-batch": (KV_HEADING, lambda: section_kv(_load("kv_batch.json")),
                         (slots.HEADING, "## Framework overhead", "## Codecs", "## Sizes used",
                          MUTATION_HEADING)),
            "slots": (slots.HEADING, lambda: slots.section_lines(_load(slots.OUT_NAME)),
                      ("## Framework overhead", "## Codecs", "## Sizes used", MUTATION_HEADING)),
            "real-pair": (REAL_PAIR_HEADING, lambda: section_real_pair(_load("real_pair.json")),
                          ("## Framework overhead", "## Codecs", "## Sizes used",
                           MUTATION_HEADING)),
            "model-layer": (MODEL_LAYER_HEADING,
                            lambda: section_model_layer(_load("model_layer.json")),
                            (REAL_PAIR_HEADING, KV_HEADING, "## Framework overhead",
                             "## Codecs", "## Sizes used", MUTATION_HEADING)),
            "replicas": ("## Replicas", lambda: scale.section_lines(_load(scale.OUT_FILE.name)),
                         ("## Soak", "## Methods", REAL_PAIR_HEADING, "## Framework overhead",
                          "## Sizes used", MUTATION_HEADING)),
            "balancers": (balancing_ways.HEADING,
                          lambda: balancing_ways.section_lines(_load(balancing_ways.OUT_FILE.name)),
                          ("## Soak", "## Methods", REAL_PAIR_HEADING, "## Framework overhead",
                           "## Sizes used", MUTATION_HEADING)),
            "sampling": (SAMPLING_HEADING, lambda: section_sampling(_load("sampling.json")),
                         ("## Codecs", "## Sizes used", MUTATION_HEADING)),
            "streaming": (streaming.HEADING,
                          lambda: streaming.section_lines(_load(streaming.OUT.name)),
                          (OVERLAP_HEADING, KV_HEADING, "## Framework overhead", "## Codecs",
                           "## Sizes used", MUTATION_HEADING)),
            "http-api": (http_api.HEADING,
                         lambda: http_api.section_lines(_load(http_api.OUT.name)),
                         (OVERLAP_HEADING, KV_HEADING, "## Framework overhead", "## Codecs",
                          "## Sizes used", MUTATION_HEADING)),
            "edge-runtime": (edge_runtime.HEADING,
                             lambda: edge_runtime.section_lines(_load(edge_runtime.OUT_NAME)),
                             (KV_HEADING, "## Framework overhead", "## Codecs", "## Sizes used",
                              MUTATION_HEADING)),
            "chat": (chat_turns.HEADING,
                     lambda: chat_turns.section_lines(_load(chat_turns.OUT_NAME)),
                     (KV_HEADING, "## Framework overhead", "## Codecs", "## Sizes used",
                      MUTATION_HEADING)),
            "live-link": (live_link.HEADING,
                          lambda: live_link.section_lines(_load(live_link.OUT_NAME)),
                          (KV_HEADING, "## Framework overhead", "## Codecs", "## Sizes used",
                           MUTATION_HEADING)),
            "pair-report": (pair_report.HEADING,
                            lambda: pair_report.section_lines(_load(pair_report.OUT_NAME)),
                            (KV_HEADING, "## Framework overhead", "## Codecs", "## Sizes used",
                             MUTATION_HEADING)),
            "http-streams": (http_streams.HEADING,
                             lambda: http_streams.section_lines(_load(http_streams.OUT.name)),
                             (OVERLAP_HEADING, KV_HEADING, "## Framework overhead", "## Codecs",
                              "## Sizes used", MUTATION_HEADING)),
            "accel": (accel.HEADING, lambda: accel.section_lines(_load(accel.OUT.name)),
                      (GPU_HEADING, "## Codecs", "## Sizes used", MUTATION_HEADING)),
            "overlap": (OVERLAP_HEADING, lambda: section_overlap(_load("overlap.json")),
                        (KV_HEADING, "## Framework overhead", "## Codecs", "## Sizes used",
                         MUTATION_HEADING)),
            "transport": ("## Framework overhead",
                          lambda: section_transport(_load("transport.json")),
                          (ROUNDS_HEADING, "## Codecs", "## Sizes used", MUTATION_HEADING)),
            "rounds": (ROUNDS_HEADING, lambda: section_rounds(_load("rounds.json")),
                       (cloud_cpu.HEADING, SAMPLING_HEADING, "## Codecs", "## Sizes used",
                        MUTATION_HEADING)),
            "trees": (trees.HEADING, lambda: trees.section_lines(trees.load_reports(OUT)),
                      (REAL_PAIR_HEADING, "## Framework overhead", "## Codecs", "## Sizes used",
                       MUTATION_HEADING)),
            "cloud_cpu": (cloud_cpu.HEADING,
                          lambda: cloud_cpu.section_cloud_cpu(_load(cloud_cpu.OUT.name)),
                          (SAMPLING_HEADING, accel.HEADING, GPU_HEADING, "## Codecs",
                           "## Sizes used", MUTATION_HEADING))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.results", description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(SECTIONS), default=None,
                    help="rewrite only this section of the current RESULTS.md")
    args = ap.parse_args(argv)
    IMG.mkdir(parents=True, exist_ok=True)
    if args.only is not None:
        heading, make, before = SECTIONS[args.only]
        text = DOC.read_text() if DOC.exists() else ""
        DOC.write_text(replace_section(text, heading, make(), before))
        print(f"wrote the {args.only} section of {DOC}")
        return 0
    run = _load("run_all.json")
    load = _load("load.json")
    scaling = _load("load_scaling.json")
    method_files = sorted(OUT.glob("methods*.json"))
    methods = merge_reports([json.loads(p.read_text()) for p in method_files]) if method_files else None
    rep_machine = (load or scaling or methods or {}).get("machine") if (load or scaling or methods) else None
    doc = ["# xcosd benchmark results", "",
           "Generated by `python -m xcosd.bench.results` from `bench/out/*.json` (written "
           "by `make bench`, i.e. `python -m xcosd.bench.run_all`). Do not edit by hand: rerun "
           "`make bench`.", ""]
    doc += section_machine(run, rep_machine)
    doc += section_load(load)
    doc += section_scaling(scaling)
    doc += scale.section_lines(_load(scale.OUT_FILE.name))
    doc += balancing_ways.section_lines(_load(balancing_ways.OUT_FILE.name))
    doc += section_soak(_load("soak.json"))
    doc += section_methods(methods)
    doc += section_model_layer(_load("model_layer.json"))
    doc += trees.section_lines(trees.load_reports(OUT))
    doc += section_real_pair(_load("real_pair.json"))
    doc += edge_runtime.section_lines(_load(edge_runtime.OUT_NAME))
    doc += pair_report.section_lines(_load(pair_report.OUT_NAME))
    doc += live_link.section_lines(_load(live_link.OUT_NAME))
    doc += chat_turns.section_lines(_load(chat_turns.OUT_NAME))
    doc += streaming.section_lines(_load(streaming.OUT.name))
    doc += http_api.section_lines(_load(http_api.OUT.name))
    doc += http_streams.section_lines(_load(http_streams.OUT.name))
    doc += kept_section(GUIDELLM_HEADING)
    doc += section_overlap(_load("overlap.json"))
    doc += section_kv(_load("kv_batch.json"))
    doc += slots.section_lines(_load(slots.OUT_NAME))
    doc += section_transport(_load("transport.json"))
    doc += section_rounds(_load("rounds.json"))
    doc += cloud_cpu.section_cloud_cpu(_load(cloud_cpu.OUT.name))
    doc += section_sampling(_load("sampling.json"))
    doc += accel.section_lines(_load(accel.OUT.name))
    doc += kept_section(GPU_HEADING)
    doc += section_codecs(_load("codecs.json"))
    doc += section_models(_load("models.json"))
    doc += sizes_note(run)
    doc += kept_section(MUTATION_HEADING)
    DOC.write_text("\n".join(doc).rstrip() + "\n")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
