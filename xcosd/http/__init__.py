"""The one HTTP stack of xcosd: ASGI apps (Starlette) served by uvicorn in the
running event loop (:class:`HttpServer`), under :class:`ConnectionLimits`."""

from .limits import ConnectionLimits
from .server import HttpServer

__all__ = ["ConnectionLimits", "HttpServer"]
