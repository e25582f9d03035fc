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

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ...config import GenerationConfig
from ...transport import LinkSpec

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
    """

    devices: int = 16
    target: str = DEFAULT_TARGET
    #: draft model spec; ``None``: a cost-free SyntheticModel over the target's
    #: vocabulary (flatter than the target, so drafts are sometimes rejected) for a
    #: synthetic target, ``default-draft`` otherwise
    draft: str | None = None
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
    transport: str = "zmq"
    procs: int = 1
    timeout_s: float = 120.0
    #: the run's seed, from which every generation's seed derives (see above)
    seed: int = 0
    link_rate_mbps: float | None = None
    rtt_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        if (self.duration_s is None) == (self.generations is None):
            raise ValueError("give exactly one of duration_s and generations")
        if self.procs < 0:
            raise ValueError(f"procs must be >= 0, got {self.procs}")
        if not isinstance(self.generation, GenerationConfig):
            raise ValueError("generation must be a GenerationConfig, got "
                             f"{type(self.generation).__name__}")
        if self.generation.seed is not None:
            raise ValueError("generation.seed must be None in a load run: each generation's "
                             f"seed derives from the run's seed (LoadConfig.seed={self.seed})")

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
        """JSON types only, ``generation`` nested (:meth:`GenerationConfig.to_dict`)."""
        d = asdict(self)
        d["generation"] = self.generation.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoadConfig:
        """The config :meth:`to_dict` wrote; keys of neither are ignored (a report's
        ``config`` may carry more)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["generation"] = GenerationConfig.from_dict(generation_settings(d))
        return cls(**kw)


def generation_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The generation settings of a load config dict or a load report's ``"config"``:
    the nested ``"generation"``, or, in a report written before it existed, the same
    fields from the top level (what :mod:`xcosd.bench.results` reads)."""
    gen = config.get("generation")
    if isinstance(gen, Mapping):
        return dict(gen)
    return {k: config[k] for k in _FLAT_GENERATION_KEYS if k in config}


def draft_spec(cfg: LoadConfig) -> str:
    """The draft model the devices load (the report names it)."""
    if cfg.draft is not None:
        return cfg.draft
    return "synthetic-draft" if cfg.target.startswith("synthetic:") else "default-draft"


__all__ = ["DEFAULT_TARGET", "PROMPTS", "LoadConfig", "draft_spec", "generation_settings"]
