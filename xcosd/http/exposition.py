"""Prometheus exposition over the HTTP stack: one function that turns a
``prometheus_client`` registry into a Starlette response, so every node's
``/metrics`` is written by ``prometheus_client`` (text format 0.0.4, exact values,
escaped labels) and answered the same way."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import Response


def metrics_response(registry: CollectorRegistry, request: Request | None = None) -> Response:
    """``registry``'s samples in the text format (headers only for ``HEAD``)."""
    body = generate_latest(registry)
    if request is not None and request.method == "HEAD":
        return Response(b"", media_type=CONTENT_TYPE_LATEST,
                        headers={"content-length": str(len(body))})
    return Response(body, media_type=CONTENT_TYPE_LATEST)
