"""The two nodes: :class:`CloudNode` (target, batching scheduler) and
:class:`EdgeNode` (draft, ``generate`` / ``stream``), both async context managers
that run inside the caller's event loop; and :class:`Broker`, which puts many
CloudNode replicas behind one endpoint."""

from __future__ import annotations

from typing import Any

from .broker import Broker
from .cloud import CloudNode
from .cloud_settings import BatchPolicy, CloudLimits, CloudPeerSettings
from .edge import EdgeNode, RoundObserved
from .edge_settings import EdgeConnectionSettings, EdgeRunSettings
from .scheduler import BatchStats, Scheduler
from .scoring import score_batch
from .stats import GenerationResult, GenerationStats, merge

__all__ = [
    "BatchPolicy", "BatchStats", "Broker", "CloudLimits", "CloudNode", "CloudPeerSettings",
    "EdgeConnectionSettings", "EdgeNode", "EdgeRunSettings",
    "GenerationResult", "GenerationStats",
    "MetricsServer", "RoundObserved", "Scheduler", "merge", "prometheus_text",
    "score_batch",
]


def __getattr__(name: str) -> Any:
    """``MetricsServer`` and ``prometheus_text`` on first use: their HTTP stack
    (Starlette, uvicorn, prometheus_client) is a third of this package's import
    time, and a node without a metrics port never needs it."""
    if name in ("MetricsServer", "prometheus_text"):
        from . import metrics

        return getattr(metrics, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
