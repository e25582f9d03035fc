"""Errors of the OpenAI-compatible API, as the OpenAI API spells them.

Every refusal is one :class:`APIError`: an HTTP status and the error object
``{"error": {"message", "type", "param", "code"}}`` that OpenAI's clients parse
(the official ``openai`` package raises ``BadRequestError`` for 400,
``NotFoundError`` for 404, ``RateLimitError`` for 429 and so on from the status,
and shows ``message``). ``type`` follows OpenAI's families
(``invalid_request_error``, ``not_found_error`` ...); ``code`` is a short machine
name where one helps (``unsupported_parameter``, ``model_not_found``,
``context_length_exceeded``). The object's shape is written once, in
:mod:`xcosd.http.errors`, which the HTTP server's own refusals use too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import context_length_message
from ..http.errors import TYPE_FOR_STATUS, error_object


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
        return error_object(self.status, self.message, self.param, self.code)


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value",
            status: int = 400) -> APIError:
    """A 400 (by default) naming the offending parameter."""
    return APIError(status, message, param, code)


def unsupported(param: str, why: str) -> APIError:
    """A parameter this server does not implement: refused, never silently ignored
    (ignoring it would change the output the client asked for)."""
    return APIError(400, f"'{param}' is not supported by this server: {why}", param,
                    "unsupported_parameter")


def context_exceeded(context: int, prompt_tokens: int, completion_tokens: int | None,
                     param: str) -> APIError:
    """A 400 ``context_length_exceeded`` as OpenAI and vLLM answer it: the prompt
    (``param``: ``prompt`` or ``messages``) with ``completion_tokens`` (``None``: none
    asked, and the prompt leaves no room for one) does not fit the ``context`` tokens
    of the target; the message names both lengths."""
    return APIError(400, context_length_message(context, prompt_tokens, completion_tokens, param),
                    param, "context_length_exceeded")
