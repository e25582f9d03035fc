"""Every request gets an id, and an error no route expected is logged with it and
answered as an error object, never as a bare 500 page.

A refusal of what a client sent is an :class:`~xcosd.api.errors.APIError` raised
by the code that read it; anything else that escapes a route is this server's
fault. :class:`RequestGuard` wraps the API's ASGI app: it names each request
(``x-request-id`` on its response, as OpenAI's API sends it, and
:data:`REQUEST_ID` for the logs of everything the request runs, its generation's
task included, which copies the context it was created in), and logs an escaping
exception with that id. The answer itself is :func:`internal_error_response`,
which Starlette's outermost middleware sends (it sends its handler's response
before re-raising): a 500 error object that quotes the id, so a user can report
it and an operator find it.
"""

from __future__ import annotations

import logging
import secrets
from contextvars import ContextVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError

log = logging.getLogger(__name__)

#: the id of the request being served (``-`` outside one)
REQUEST_ID: ContextVar[str] = ContextVar("xcosd_request_id", default="-")


def internal_error(what: str) -> APIError:
    """The answer to an internal error in the current request (500, its id quoted)."""
    return APIError(500, f"internal error: {what} (request {REQUEST_ID.get()})", None,
                    "internal")


async def internal_error_response(request: Request, exc: Exception) -> Response:
    return JSONResponse(internal_error(type(exc).__name__).body(), status_code=500)


class RequestGuard:
    """``app`` with an id per HTTP request and its unexpected errors logged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = "req_" + secrets.token_hex(12)
        token = REQUEST_ID.set(rid)

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, named)
        except Exception:
            # already answered (internal_error_response); said once, here, with its id
            log.exception("request %s %s %s failed", rid, scope.get("method"),
                          scope.get("path"))
        finally:
            REQUEST_ID.reset(token)
