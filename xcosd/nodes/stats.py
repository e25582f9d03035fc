"""What one generation cost and achieved: :class:`GenerationStats`, and the result
type :class:`GenerationResult` that :meth:`EdgeNode.generate` returns.

Names follow vLLM's speculative-decoding metrics where one exists: the
acceptance rate is accepted / drafted, the mean acceptance length is
``1 + accepted / rounds`` (tokens per target call when every round is one call).
Bytes are **wire** bytes (frames plus the transport's framing), per direction and
per message type, counted for this generation's messages only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..protocol.edge import RoundSettled


@dataclass
class GenerationStats:
    method: str = ""
    codec: str = ""
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    #: target forward passes this generation caused (one per round)
    target_calls: int = 0
    #: follow-up request/reply exchanges after a verdict (SR-DV more, HR other ...)
    extra_round_trips: int = 0
    trials: int = 0
    fallbacks: int = 0
    #: rounds with a rejection, and the bytes those rounds moved (verdict and
    #: follow-ups down, the draft and requests up)
    rejections: int = 0
    rejection_uplink_bytes: int = 0
    rejection_downlink_bytes: int = 0
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    uplink_by_type: dict[str, int] = field(default_factory=dict)
    downlink_by_type: dict[str, int] = field(default_factory=dict)
    messages_up: int = 0
    messages_down: int = 0
    wall_s: float = 0.0
    #: link model (RTT/2 + 8 bytes / rate per message) plus measured compute
    modeled_s: float = 0.0
    draft_compute_s: float = 0.0
    cloud_compute_s: float = 0.0
    resumes: int = 0
    busy_retries: int = 0
    #: messages sent again because their answer was late (same seq)
    resends: int = 0
    #: tokens drafted while a verdict was in flight, and those later rounds sent
    speculated: int = 0
    speculated_used: int = 0
    #: draft-context tokens computed in the wait of rounds that drafted nothing
    caught_up: int = 0
    #: draft prompt tokens computed beside the open's round trip (round 0 drafting
    #: nothing, ``EdgeSession.draft_later``)
    prefilled_beside: int = 0
    #: rounds that drafted a tree, and how many rounds drafted each shape
    #: (``TreeShape.label``: ``"3x2"``, ``"spine:4x2"``)
    tree_rounds: int = 0
    shapes: dict[str, int] = field(default_factory=dict)
    finish_reason: str = ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def modeled_tokens_per_s(self) -> float:
        return self.tokens / self.modeled_s if self.modeled_s > 0 else 0.0

    @property
    def messages(self) -> int:
        return self.messages_up + self.messages_down

    def settle(self, ev: RoundSettled) -> None:
        """Count a round the edge's state machine settled (the one place rounds are
        tallied, for the node and the in-process pump alike)."""
        self.rounds += 1
        self.drafted += ev.drafted
        self.accepted += ev.accepted
        self.extra_round_trips += ev.extra_trips
        self.trials += ev.trials
        self.fallbacks += ev.fallbacks
        self.rejections += int(ev.rejected)
        if ev.shape is not None:
            self.tree_rounds += 1
            self.shapes[ev.shape] = self.shapes.get(ev.shape, 0) + 1

    def count(self, direction: str, mtype: str, nbytes: int) -> None:
        if direction == "up":
            self.uplink_bytes += nbytes
            self.messages_up += 1
            self.uplink_by_type[mtype] = self.uplink_by_type.get(mtype, 0) + nbytes
        else:
            self.downlink_bytes += nbytes
            self.messages_down += 1
            self.downlink_by_type[mtype] = self.downlink_by_type.get(mtype, 0) + nbytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate,
                 mean_acceptance_length=self.mean_acceptance_length,
                 tokens_per_s=self.tokens_per_s, modeled_tokens_per_s=self.modeled_tokens_per_s)
        return d


@dataclass
class GenerationResult:
    """``text`` (UTF-8 of the target tokens' bytes), ``token_ids`` (target ids) and
    ``stats``."""

    text: str
    token_ids: list[int]
    stats: GenerationStats

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


def merge(stats: list[GenerationStats]) -> GenerationStats:
    """Totals over many generations (rates recomputed from the totals)."""
    out = GenerationStats()
    if stats:
        out.method, out.codec = stats[0].method, stats[0].codec
    for s in stats:
        for k in ("tokens", "rounds", "drafted", "accepted", "target_calls", "extra_round_trips",
                  "trials", "fallbacks", "rejections", "rejection_uplink_bytes",
                  "rejection_downlink_bytes", "uplink_bytes", "downlink_bytes", "messages_up",
                  "messages_down", "resumes", "busy_retries", "resends", "speculated",
                  "speculated_used", "caught_up", "prefilled_beside"):
            setattr(out, k, getattr(out, k) + getattr(s, k))
        for k in ("wall_s", "modeled_s", "draft_compute_s", "cloud_compute_s"):
            setattr(out, k, getattr(out, k) + getattr(s, k))
        for src, dst in ((s.uplink_by_type, out.uplink_by_type),
                         (s.downlink_by_type, out.downlink_by_type)):
            for t, v in src.items():
                dst[t] = dst.get(t, 0) + v
    return out
