"""What defines one load run: :class:`LoadConfig`, the prompts the devices cycle
through and the model choices the config implies.

Kept apart from everything that runs, so the CLI, the device processes and the
analysis can share it without importing each other; a config travels to a device
process as a plain dict (:meth:`LoadConfig.to_dict`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

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


@dataclass
class LoadConfig:
    """Everything that defines one load run (JSON-able, so workers get a copy)."""

    devices: int = 16
    target: str = DEFAULT_TARGET
    #: draft model spec; ``None``: a cost-free SyntheticModel over the target's
    #: vocabulary (flatter than the target, so drafts are sometimes rejected) for a
    #: synthetic target, ``default-draft`` otherwise
    draft: str | None = None
    method: str = "xcosd-e"
    codec: str = "f32"
    draft_len: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
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
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoadConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def draft_spec(cfg: LoadConfig) -> str:
    """The draft model the devices load (the report names it)."""
    if cfg.draft is not None:
        return cfg.draft
    return "synthetic-draft" if cfg.target.startswith("synthetic:") else "default-draft"


__all__ = ["DEFAULT_TARGET", "PROMPTS", "LoadConfig", "draft_spec"]
