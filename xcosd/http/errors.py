"""The error object every xcosd HTTP answer carries, in OpenAI's shape.

``{"error": {"message", "type", "param", "code"}}`` is what OpenAI's clients parse
(the official ``openai`` package raises its typed exceptions from the status and
shows ``message``). It is written here, once, because two layers answer with it:
the API's routes (:class:`xcosd.api.errors.APIError`) and the HTTP server itself,
which refuses a connection or a request before any route runs (a client over its
connection cap, a head or body past its deadline, a head that is not HTTP:
:mod:`xcosd.http.protocol`).
"""

from __future__ import annotations

import http
import json
from typing import Any

#: the error ``type`` each status gets, as OpenAI's API names them
TYPE_FOR_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "api_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_object(status: int, message: str, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    """The body of an error answer with ``status``."""
    return {"error": {"message": message, "type": TYPE_FOR_STATUS.get(status, "api_error"),
                      "param": param, "code": code}}


def raw_error_response(status: int, message: str, code: str,
                       headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 error response that closes its connection, as bytes: what
    the server writes itself, outside any request's cycle (the connection is closed
    right after, so the response says so)."""
    body = json.dumps(error_object(status, message, None, code)).encode()
    lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
             "content-type: application/json", f"content-length: {len(body)}",
             *(f"{k}: {v}" for k, v in (headers or {}).items()), "connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
