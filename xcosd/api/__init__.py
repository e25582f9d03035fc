"""The edge's OpenAI-compatible HTTP API: any OpenAI client gets the cloud's
target model, exactly, through an edge node (:class:`OpenAIApp`, an ASGI app;
``xcosd edge serve --http HOST:PORT`` serves it). See ``docs/API.md``."""

from .app import OpenAIApp
from .errors import APIError
from .requests import RequestLimits

__all__ = ["APIError", "OpenAIApp", "RequestLimits"]
