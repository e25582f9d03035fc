"""The one HTTP stack of xcosd: ASGI apps (Starlette) served by uvicorn in the
running event loop (:class:`HttpServer`)."""

from .server import HttpServer

__all__ = ["HttpServer"]
