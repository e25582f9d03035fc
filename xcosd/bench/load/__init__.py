"""``xcosd bench load``: many edge devices against one cloud, closed or open loop.

One :class:`~xcosd.nodes.CloudNode` serves the target in this process, or, with
``connect``, a cloud already running elsewhere is loaded; ``devices`` edge devices,
each a real :class:`~xcosd.nodes.EdgeNode` with its own ZeroMQ (or TCP)
connection, run as asyncio tasks in ``procs`` separate worker processes (default
one; ``procs=0``: in this event loop, see :mod:`~xcosd.bench.load.run` for why).
docs/LOAD.md is the user's guide and lists every field of the JSON report.

Closed loop (the default): every device runs one generation at a time and starts
the next as soon as one ends. Open loop (``request_rate``): generations arrive as a
Poisson process (gamma gaps of shape ``burstiness`` when it is not 1), spread over
the devices round-robin, each started at its arrival whatever is still running.
Warm-up is excluded: with ``duration_s`` the measured window is
``[start + warmup_s, start + warmup_s + duration_s]`` and generations still running
at its end are cancelled; with ``generations`` each device first runs
``warmup_generations`` and the window is the span in which every device is past
its warm-up and none has finished (the steady state).

What is measured, in the shape ``wrk``/``ghz``/``vllm bench serve`` print:

* throughput: tokens/s and rounds/s, aggregate and per device, from the rounds that
  end inside the window;
* latency: per-token latency (a round's wall time divided by the tokens it emitted,
  one sample per token), round latency, time to first token (``generate`` called,
  or the arrival in an open loop -> first token committed, session open included),
  time per output token (vLLM's TPOT: ``(end - first token) / (tokens - 1)`` per
  generation) and end-to-end latency, at the percentiles ``percentiles`` asks for
  (and p50, p90, p99 always); the raw samples ride along, so reports of several
  load generators merge exactly (:mod:`~xcosd.bench.load.merge`);
* the cloud (one this run started): batch-size histogram and queue wait of the
  batches that end inside the window, compute time and busy fraction;
* bytes per token up and down (wire bytes of the rounds in the window), acceptance;
* the CPU the device processes and the cloud started here spent in the window, per
  round and as their event loops' busy share (a saturated load generator is said);
* errors by class over the whole run: ``timeout``, ``busy``, ``protocol``,
  ``transport``, ``other``.

With a :class:`~xcosd.models.SyntheticModel` target, whose batch costs
``a + b * rows``, the scheduler's ideal is known: a batch of ``B`` sessions with
``r`` rows each emits ``B * L`` tokens (``L`` tokens per round) in ``a + b * B * r``
seconds, so ``ideal = B * L / (a + b * B * r)`` with ``B = min(devices, max_batch)``
(1 without batching). The measured/ideal ratio is the scheduler's efficiency.

The modules, one job each: :mod:`~xcosd.bench.load.config` (:class:`LoadConfig`, whose
``generation`` is the :class:`~xcosd.config.GenerationConfig` every device uses),
:mod:`~xcosd.bench.load.devices` (the load generator and its device process),
:mod:`~xcosd.bench.load.pipe` (the framing between the processes),
:mod:`~xcosd.bench.load.run` (the cloud, the processes, the scaling sweep),
:mod:`~xcosd.bench.load.analysis` (window, percentiles, ideal: the JSON report),
:mod:`~xcosd.bench.load.cpu` (the CPU each side spent in the window: is the load
generator the limit?),
:mod:`~xcosd.bench.load.merge` (several generators' reports as one) and
:mod:`~xcosd.bench.load.report` (the report as text).
"""

from __future__ import annotations

from .analysis import SCHEMA_VERSION, analyse, ideal, summarize, window_of
from .config import (
    BATCHING_MODES,
    DEFAULT_PERCENTILES,
    DEFAULT_TARGET,
    PROMPTS,
    LoadConfig,
    batching_mode,
    draft_spec,
    generation_settings,
    read_prompts,
)
from .devices import (
    ERROR_CLASSES,
    Schedule,
    WindowEnded,
    arrival_offsets,
    concurrency_slots,
    run_devices,
)
from .merge import merge_reports
from .report import SCALING_HEADER, format_report, scaling_rows
from .run import RecordingModel, run_load, run_load_sync, run_scaling

__all__ = ["BATCHING_MODES", "DEFAULT_PERCENTILES", "DEFAULT_TARGET", "ERROR_CLASSES", "PROMPTS",
           "SCALING_HEADER", "SCHEMA_VERSION", "LoadConfig", "RecordingModel", "Schedule",
           "WindowEnded", "analyse", "arrival_offsets", "batching_mode", "concurrency_slots",
           "draft_spec",
           "format_report", "generation_settings", "ideal", "merge_reports", "read_prompts",
           "run_devices", "run_load", "run_load_sync", "run_scaling", "scaling_rows", "summarize",
           "window_of"]
