"""The resampling methods of ``docs/METHODS.md``, each a pure server/device pair.

``get_method(name, codec=..., **options)`` builds one by the name the CLI, the
handshake and the benches use.
"""

from __future__ import annotations

from typing import Any

from ..codecs import Codec
from .ar import Autoregressive
from .base import (
    Answer,
    CandidatesReply,
    CommitRule,
    DeviceState,
    Draft,
    FullVectorReply,
    HybridReply,
    Method,
    RejectState,
    Reply,
    Request,
    RequestKind,
    Space,
    TokenReply,
    Verdict,
    verify,
)
from .greedy_resample import GreedyResample
from .hybrid_resampling import HybridResampling
from .sd_uplink import SdUplink
from .sr_dv import SrDv
from .straightforward import Straightforward
from .target_resample import TargetResample
from .uhlm import Uhlm

METHODS: dict[str, type[Method]] = {
    m.name: m
    for m in (Autoregressive, SdUplink, Straightforward, HybridResampling, SrDv,
              TargetResample, GreedyResample, Uhlm)
}
LOSSLESS = tuple(n for n, m in METHODS.items() if m.lossless)
LOSSY = tuple(n for n, m in METHODS.items() if not m.lossless)


def get_method(name: str, codec: Codec | str | None = None, **options: Any) -> Method:
    """A method by name (``ar``, ``sd-uplink``, ``straightforward``, ``xcosd``,
    ``xcosd-e``, ``target-resample``, ``greedy-resample``, ``uhlm``)."""
    try:
        cls = METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}") from None
    return cls(codec, **options)


__all__ = [
    "LOSSLESS", "LOSSY", "METHODS", "Answer", "CandidatesReply", "CommitRule", "DeviceState", "Draft",
    "FullVectorReply", "HybridReply", "Method", "RejectState", "Reply", "Request", "RequestKind", "Space",
    "TokenReply", "Verdict", "get_method", "verify",
]
