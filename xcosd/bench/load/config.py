"""What defines one load run: :class:`LoadConfig`, the prompts the devices cycle
through and the model choices the config implies.

Kept apart from everything that runs, so the CLI, the device processes and the
analysis can share it without importing each other; a config travels to a device
process as a plain dict (:meth:`LoadConfig.to_dict`).

What the devices generate with is one :class:`~xcosd.config.GenerationConfig`
(``LoadConfig.generation``), the same value ``EdgeNode``, ``xcosd edge`` and the
library take, so the load test cannot accept a setting the others refuse or drop
one they honour. In the dict (and so in the report's ``"config"``) it is nested
under ``"generation"``; reports written before that carried its fields
(``method``, ``codec``, ``draft_len`` ...) at the top level, and
:func:`generation_settings` reads either."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...config import GenerationConfig
from ...transport import LinkSpec

if TYPE_CHECKING:
    from ...models.base import LanguageModel

#: the default target: a synthetic model over 256 ids costing 20 ms + 0.5 ms per row
DEFAULT_TARGET = "synthetic:256:20:0.5"
#: what the devices generate from, device ``i``'s ``k``-th generation taking prompt
#: ``(i + k) % len(PROMPTS)``: varied lengths, so sessions do not run in lockstep
PROMPTS = (
    "Once upon a time",
    "The cloud server verifies a block of drafted tokens in one pass",
    "def merge_sorted(a, b):",
    "In the beginning the network was slow, and the edge device",
    "Speculative decoding between two vocabularies",
    "A short story about a lighthouse keeper:",
    "The quick brown fox",
    "Return a new list containing all items from the iterable",
)


#: the percentiles every latency summary carries (what wrk, ghz and ``vllm bench
#: serve`` print, and what the text report and docs/RESULTS.md read)
DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)

#: the generation fields a load config held at its top level before ``generation``
#: (older reports have them there)
_FLAT_GENERATION_KEYS = ("method", "codec", "draft_len", "max_new_tokens", "temperature",
                         "top_k", "top_p")


@dataclass
class LoadConfig:
    """Everything that defines one load run (JSON-able, so workers get a copy).

    ``generation``: what every device generates with (its ``max_new_tokens`` is the
    length of each generation). Its ``seed`` must be ``None``: a load run seeds each
    generation on its own, from ``seed`` (device ``i``'s ``k``-th generation gets
    ``seed * 1_000_003 + i * 10_007 + k``), so that devices and successive
    generations differ while a rerun repeats them; one seed for every generation
    would make all devices generate the same text.

    ``target`` and ``draft`` are model specs (what :func:`~xcosd.models.load_model`
    takes) or :class:`~xcosd.models.LanguageModel` objects. An object is used where
    it is: the target is served by this process's cloud, the draft drafts in this
    process. A device process loads its draft itself, by name, so a draft given as
    an object (or the synthetic default draft over a target object's vocabulary)
    means the devices run in this event loop: ``procs`` then defaults to 0, and
    asking for device processes is an error rather than a silent copy.

    ``connect``: the endpoint of a cloud already running (``xcosd serve``, a
    deployment); the run then starts no cloud and ``target`` only says what that
    cloud serves, if known (it picks the default draft; ``None``: unknown, the
    default draft is ``default-draft``, the draft of ``xcosd serve``'s default
    target). ``curve_secret`` / ``curve_server_key``: key files, as for
    ``xcosd edge``, to reach a cloud with CURVE on.

    ``request_rate``: ``None`` (or ``inf``) runs a closed loop, each device starting
    its next generation when one ends; a rate runs an open loop, generations
    arriving as a Poisson process of that many per second (the arrival times derive
    from ``seed``), arrival ``j`` going to device ``j % devices`` whether or not the
    device is still busy with earlier ones. ``burstiness`` shapes those arrivals as
    ``vllm bench serve``'s option does: the gaps between them are gamma distributed
    with that shape and a mean of ``1 / request_rate``, so 1 is the Poisson process,
    below 1 arrivals come in bursts, above 1 more evenly (the rate is the same).
    ``max_concurrency`` caps the open loop's generations in flight, as ``vllm bench
    serve``'s option does (an upstream gateway's limit, or a guard for the load
    generator when the cloud saturates): an arrival past the cap waits for a slot,
    and its latencies still count from its arrival. Device ``j % devices`` owns slot
    ``j``, so the cap splits exactly over device processes (each needs one).
    """

    devices: int = 16
    #: the target model (spec or object); ``None``: :data:`DEFAULT_TARGET` when this
    #: run starts the cloud, unknown with ``connect``
    target: str | LanguageModel | None = None
    #: draft model (spec or object); ``None``: a cost-free SyntheticModel over the
    #: target's vocabulary (flatter than the target, so drafts are sometimes rejected)
    #: for a synthetic target, ``default-draft`` otherwise
    draft: str | LanguageModel | None = None
    # a factory, not a shared default: building one validates it, which imports the
    # methods and codecs, and this module is imported by the CLI's parser
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    duration_s: float | None = 8.0
    warmup_s: float = 2.0
    generations: int | None = None
    warmup_generations: int = 1
    batching: bool = True
    max_batch: int = 256
    max_wait_s: float = 0.002
    #: whether the cloud the tester starts holds a partial batch for the sessions it
    #: just answered when that pays (``xcosd/nodes/merging.py``)
    merge_batches: bool = True
    #: whether that cloud verifies on its loop and sends each verdict as it is drawn
    #: (``xcosd/nodes/scheduler.py``), or verifies each batch in its worker thread
    stream_verdicts: bool = True
    transport: str = "zmq"
    #: device processes; ``None``: 1, or 0 when a model object keeps the devices here
    procs: int | None = None
    timeout_s: float = 120.0
    #: the run's seed, from which every generation's seed derives (see above)
    seed: int = 0
    link_rate_mbps: float | None = None
    rtt_ms: float = 0.0
    #: a running cloud's endpoint: start none, load it (see above)
    connect: str | None = None
    #: the devices' CURVE key file (``NAME.key_secret``) and the server's public key file
    curve_secret: str | None = None
    curve_server_key: str | None = None
    #: how long a device waits for the cloud to accept its connection
    connect_timeout_s: float = 30.0
    #: generations per second, Poisson arrivals (open loop); ``None``: closed loop
    request_rate: float | None = None
    #: the open loop's gamma shape of the gaps between arrivals (1: Poisson)
    burstiness: float = 1.0
    #: the open loop's cap on generations in flight; ``None``: none
    max_concurrency: int | None = None
    #: service-level objectives in ms (``ttft``, ``tpot``, ``e2e``): the report's
    #: ``goodput`` counts the generations that met all of them; ``None``: none
    goodput: dict[str, float] | None = None
    #: what the devices generate from, cycled; ``None``: :data:`PROMPTS`
    prompts: tuple[str, ...] | None = None
    #: the percentiles every latency summary reports, beside p50, p90 and p99
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    #: compare every generation with the target's own greedy decode of its prompt
    #: (greedy generations and a target named by spec); the report's ``exact``
    check_greedy: bool = False

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        if (self.duration_s is None) == (self.generations is None):
            raise ValueError("give exactly one of duration_s and generations")
        if not isinstance(self.generation, GenerationConfig):
            raise ValueError("generation must be a GenerationConfig, got "
                             f"{type(self.generation).__name__}")
        if self.generation.seed is not None:
            raise ValueError("generation.seed must be None in a load run: each generation's "
                             f"seed derives from the run's seed (LoadConfig.seed={self.seed})")
        if self.connect is None and self.target is None:
            self.target = DEFAULT_TARGET
        if self.connect is not None and self.target is not None and not isinstance(self.target, str):
            raise ValueError("with connect the run serves nothing: target may only name what "
                             "the cloud at the endpoint serves (a spec), not be a model object")
        if (self.curve_secret is None) != (self.curve_server_key is None):
            raise ValueError("curve_secret and curve_server_key go together")
        if self.curve_secret is not None:
            if self.connect is None:
                raise ValueError("CURVE keys are for a cloud this run did not start (connect)")
            if self.transport != "zmq":
                raise ValueError(f"CURVE needs the zmq transport, not {self.transport}")
        if self.request_rate is not None:
            if math.isinf(self.request_rate) and self.request_rate > 0:
                self.request_rate = None  # an infinite rate is the closed loop
            elif not self.request_rate > 0 or math.isnan(self.request_rate):
                raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not (isinstance(self.burstiness, int | float) and math.isfinite(self.burstiness)
                and self.burstiness > 0):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness!r}")
        if self.burstiness != 1.0 and self.request_rate is None:
            raise ValueError("burstiness shapes the open loop's arrivals: it needs a "
                             "request_rate")
        if self.max_concurrency is not None:
            if (isinstance(self.max_concurrency, bool) or not isinstance(self.max_concurrency, int)
                    or self.max_concurrency < 1):
                raise ValueError(f"max_concurrency must be an integer >= 1, got "
                                 f"{self.max_concurrency!r}")
            if self.request_rate is None:
                raise ValueError("max_concurrency caps the open loop (request_rate); a closed "
                                 "loop's concurrency is its devices")
        if self.goodput is not None:
            self.goodput = check_slos(self.goodput)
        if self.prompts is not None:
            self.prompts = tuple(self.prompts)
            if not self.prompts or not all(isinstance(p, str) for p in self.prompts):
                raise ValueError("prompts must be a non-empty sequence of strings")
        self.percentiles = check_percentiles(self.percentiles)
        if self.check_greedy:
            g = self.generation
            if g.do_sample and g.temperature != 0:
                raise ValueError("check_greedy compares greedy generations: set do_sample=False")
            if self.target is None or g.stop_strings:
                raise ValueError("check_greedy needs the target (what the cloud serves) and "
                                 "no stop strings")
        why = self.in_process_only()
        if self.procs is None:
            self.procs = 0 if why else 1
        elif self.procs < 0:
            raise ValueError(f"procs must be >= 0, got {self.procs}")
        elif self.procs and why:
            raise ValueError(f"{why}: a device process loads its draft by name; run the devices "
                             "in this event loop (procs=0) or give the draft as a spec")
        if (self.max_concurrency is not None
                and self.max_concurrency < min(self.procs, self.devices)):
            raise ValueError(f"max_concurrency {self.max_concurrency} leaves a device process "
                             f"without a slot: it must be at least procs ({self.procs})")

    def in_process_only(self) -> str | None:
        """Why the devices must run in this process (a model object they draft
        with), or ``None``."""
        if self.draft is not None and not isinstance(self.draft, str):
            return "the draft is a model object"
        if draft_spec(self) == "synthetic-draft" and not isinstance(self.target, str):
            return "the synthetic draft is built over the target object's vocabulary"
        return None

    @property
    def mode(self) -> str:
        """``"open"`` (arrivals at ``request_rate``) or ``"closed"``."""
        return "closed" if self.request_rate is None else "open"

    @property
    def prompt_list(self) -> tuple[str, ...]:
        """The prompts the devices cycle through."""
        return self.prompts if self.prompts is not None else PROMPTS

    @property
    def effective_batch(self) -> int:
        """Sessions per target call when every device has a round queued."""
        return min(self.devices, self.max_batch) if self.batching else 1

    def link(self) -> LinkSpec | None:
        """The emulated link of every device, ``None`` for the bare loopback."""
        if self.link_rate_mbps is None and not self.rtt_ms:
            return None
        rate = math.inf if self.link_rate_mbps is None else self.link_rate_mbps * 1e6
        return LinkSpec.of(up_bps=rate, down_bps=rate, rtt_s=self.rtt_ms / 1e3)

    def to_dict(self) -> dict[str, Any]:
        """JSON types only, ``generation`` nested (:meth:`GenerationConfig.to_dict`);
        a model given as an object is written as its ``name``."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["generation"] = self.generation.to_dict()
        d["target"] = model_name(self.target)
        d["draft"] = model_name(self.draft)
        d["prompts"] = None if self.prompts is None else list(self.prompts)
        d["percentiles"] = list(self.percentiles)
        d["goodput"] = None if self.goodput is None else dict(self.goodput)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoadConfig:
        """The config :meth:`to_dict` wrote; keys of neither are ignored (a report's
        ``config`` may carry more)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["generation"] = GenerationConfig.from_dict(generation_settings(d))
        for k in ("prompts", "percentiles"):
            if kw.get(k) is not None:
                kw[k] = tuple(kw[k])
        return cls(**kw)


#: the cloud's batching in a scaling sweep: batches with the merge policy
#: (``xcosd/nodes/merging.py``), batches without it, one session per call
BATCHING_MODES = ("on", "no merge", "off")


def batching_mode(config: Mapping[str, Any]) -> str:
    """Which of :data:`BATCHING_MODES` a report's ``config`` ran (a report written
    before the merge policy has no ``merge_batches``: it batched without it)."""
    if not config.get("batching", True):
        return "off"
    return "on" if config.get("merge_batches", False) else "no merge"


def check_percentiles(qs: Iterable[float]) -> tuple[float, ...]:
    """``qs`` as a sorted tuple without repeats, each in [0, 100]."""
    out = tuple(sorted({float(q) for q in qs}))
    if not out:
        raise ValueError("percentiles must name at least one percentile")
    bad = [q for q in out if not 0.0 <= q <= 100.0]
    if bad:
        raise ValueError(f"percentiles must lie in [0, 100], got {bad[0]:g}")
    return out


#: what a goodput objective may bound, each per generation: time to first token,
#: time per output token after it, and the whole generation
SLO_METRICS = ("ttft", "tpot", "e2e")


def check_slos(slos: Mapping[str, float]) -> dict[str, float]:
    """Goodput objectives as a dict of :data:`SLO_METRICS` to milliseconds > 0."""
    out: dict[str, float] = {}
    for k, v in dict(slos).items():
        if k not in SLO_METRICS:
            raise ValueError(f"goodput objective {k!r} is not one of {', '.join(SLO_METRICS)}")
        if isinstance(v, bool) or not isinstance(v, int | float) or not (
                math.isfinite(v) and v > 0):
            raise ValueError(f"goodput objective {k} must be milliseconds > 0, got {v!r}")
        out[k] = float(v)
    if not out:
        raise ValueError("goodput needs at least one objective (ttft, tpot or e2e)")
    return out


def percentile_key(q: float) -> str:
    """The summary key of percentile ``q``: ``p50``, ``p99.9``."""
    return f"p{q:g}"


def model_name(m: str | LanguageModel | None) -> str | None:
    """A spec as it is, a model object by its ``name``."""
    return m if m is None or isinstance(m, str) else m.name


def target_spec(cfg: LoadConfig) -> str | None:
    """The target's spec when it is given by name (``None``: an object, or unknown)."""
    return cfg.target if isinstance(cfg.target, str) else None


def read_prompts(path: str | Path) -> tuple[str, ...]:
    """The prompts of a file: JSON Lines with a ``"prompt"`` field (a ``.jsonl`` /
    ``.ndjson`` name, or a first line that is such an object), else one prompt per
    line. Blank lines are skipped. JSON Lines is there for prompts with newlines."""
    p = Path(path)
    lines = [(i, ln) for i, ln in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if ln.strip()]
    if not lines:
        raise ValueError(f"{p}: no prompts")
    jsonl = p.suffix.lower() in (".jsonl", ".ndjson") or _is_prompt_object(lines[0][1])
    if not jsonl:
        return tuple(ln for _, ln in lines)
    out = []
    for i, ln in lines:
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{i}: not JSON: {e.msg}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{p}:{i}: expected an object with a string \"prompt\"")
        out.append(obj["prompt"])
    return tuple(out)


def _is_prompt_object(line: str) -> bool:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and "prompt" in obj


def generation_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The generation settings of a load config dict or a load report's ``"config"``:
    the nested ``"generation"``, or, in a report written before it existed, the same
    fields from the top level (what :mod:`xcosd.bench.results` reads)."""
    gen = config.get("generation")
    if isinstance(gen, Mapping):
        return dict(gen)
    return {k: config[k] for k in _FLAT_GENERATION_KEYS if k in config}


def draft_spec(cfg: LoadConfig) -> str:
    """The draft model the devices load (the report names it; an object by its name)."""
    if cfg.draft is not None:
        return cfg.draft if isinstance(cfg.draft, str) else cfg.draft.name
    if isinstance(cfg.target, str):
        synthetic = cfg.target.startswith("synthetic:")
    else:
        from ...models import SyntheticModel

        synthetic = isinstance(cfg.target, SyntheticModel)
    return "synthetic-draft" if synthetic else "default-draft"


__all__ = ["BATCHING_MODES", "DEFAULT_PERCENTILES", "DEFAULT_TARGET", "PROMPTS", "LoadConfig",
           "batching_mode", "check_percentiles",
           "draft_spec", "generation_settings", "model_name", "percentile_key", "read_prompts",
           "target_spec"]
