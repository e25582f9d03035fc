"""The two nodes: :class:`CloudNode` (target, batching scheduler) and
:class:`EdgeNode` (draft, ``generate`` / ``stream``), both async context managers
that run inside the caller's event loop; and :class:`Broker`, which puts many
CloudNode replicas behind one endpoint."""

from __future__ import annotations

from .broker import Broker
from .cloud import CloudNode
from .edge import EdgeNode, RoundObserved
from .metrics import MetricsServer, prometheus_text
from .scheduler import BatchStats, Scheduler, score_batch
from .stats import GenerationResult, GenerationStats, merge

__all__ = [
    "BatchStats", "Broker", "CloudNode", "EdgeNode", "GenerationResult", "GenerationStats",
    "MetricsServer", "RoundObserved", "Scheduler", "merge", "prometheus_text",
    "score_batch",
]
