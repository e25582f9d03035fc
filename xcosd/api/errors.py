"""Errors of the OpenAI-compatible API, as the OpenAI API spells them.

Every refusal is one :class:`APIError`: an HTTP status and the error object
``{"error": {"message", "type", "param", "code"}}`` that OpenAI's clients parse
(the official ``openai`` package raises ``BadRequestError`` for 400,
``NotFoundError`` for 404, ``RateLimitError`` for 429 and so on from the status,
and shows ``message``). ``type`` follows OpenAI's families
(``invalid_request_error``, ``not_found_error`` ...); ``code`` is a short machine
name where one helps (``unsupported_parameter``, ``model_not_found``,
``context_length_exceeded``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the error ``type`` each status gets, as OpenAI's API names them
TYPE_FOR_STATUS = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "api_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


@dataclass
class APIError(Exception):
    """A request the API refuses: ``status`` and the OpenAI error object's fields."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    #: extra response headers (``Retry-After`` on a 429 or 503)
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def type(self) -> str:
        return TYPE_FOR_STATUS.get(self.status, "api_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value",
            status: int = 400) -> APIError:
    """A 400 (by default) naming the offending parameter."""
    return APIError(status, message, param, code)


def unsupported(param: str, why: str) -> APIError:
    """A parameter this server does not implement: refused, never silently ignored
    (ignoring it would change the output the client asked for)."""
    return APIError(400, f"'{param}' is not supported by this server: {why}", param,
                    "unsupported_parameter")
