"""API keys: who may use the edge's HTTP API, checked before anything else runs.

An edge that holds an allowed CURVE key is a door to the cloud: whoever reaches
its HTTP port can make the cloud compute. :class:`ApiKeys` holds the keys an
operator gave (``xcosd edge serve --api-key``, ``--api-key-file``, the
``XCOSD_API_KEY`` environment variable, as vLLM's ``--api-key`` and
``VLLM_API_KEY``); :class:`KeyGate` wraps the API's ASGI app and answers a request
that does not carry one as ``Authorization: Bearer KEY`` with 401 and an OpenAI
error object, before its body is read: a refused request costs no model work and
no cloud byte.

Why the comparison is done the way it is: a bearer token is compared with every
key, each as its SHA-256 digest, by :func:`hmac.compare_digest`, and the loop does
not stop at a match. Digests have one length, so the time taken says neither how
long a key is nor how many of its leading bytes a guess got right, nor which key
matched.

Routes left open: ``/health`` only (a load balancer's or Kubernetes' probe sends
no key, and it says nothing but whether the cloud is connected and how busy the
edge is). ``/metrics`` is behind the key unless the operator opens it
(``open_metrics``; Prometheus sends a bearer key with ``authorization:`` in its
scrape config). Every other path, ``/v1/...`` and unknown ones alike, needs the
key: an unknown path answers 404 only to a caller that may use the API.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from ..http.errors import error_object

#: the environment variable ``xcosd edge serve`` reads a key from (vLLM's is
#: ``VLLM_API_KEY``)
API_KEY_ENV = "XCOSD_API_KEY"

#: the name of the key the current request presented (``-``: the API has no keys)
CLIENT: ContextVar[str] = ContextVar("xcosd_api_client", default="-")


def _digest(key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


class ApiKeys:
    """The keys that open the API, each with a name for the metrics and logs.

    ``keys``: the key strings; a key's name is ``key-N`` (N from 1, in the order
    given) unless it is given as a ``(name, key)`` pair. Empty keys and keys with
    whitespace are refused (a header cannot carry them intact)."""

    def __init__(self, keys: Iterable[str | tuple[str, str]]) -> None:
        self._digests: list[tuple[bytes, str]] = []
        for i, k in enumerate(keys, 1):
            name, key = k if isinstance(k, tuple) else (f"key-{i}", k)
            if not key or key != key.strip() or any(c.isspace() for c in key):
                raise ValueError(f"API key {name} is empty or has whitespace")
            if not key.isascii() or not key.isprintable():
                raise ValueError(f"API key {name} must be printable ASCII")
            self._digests.append((_digest(key), name))

    def __len__(self) -> int:
        return len(self._digests)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for _, n in self._digests)

    def match(self, token: bytes) -> str | None:
        """The name of the key ``token`` is, or ``None``: compared with every key
        in constant time (see the module's docstring)."""
        d = _digest(token)
        found: str | None = None
        for digest, name in self._digests:
            if hmac.compare_digest(d, digest):
                found = name
        return found


def read_key_file(path: str | Path) -> list[str]:
    """The keys in ``path``: one a line; blank lines and lines starting with ``#``
    are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read API key file {path}: {e.strerror}") from None
    keys = [ln.strip() for ln in text.splitlines()]
    return [k for k in keys if k and not k.startswith("#")]


def bearer(scope: Scope) -> bytes | None:
    """The token of the request's ``Authorization: Bearer`` header, if any."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = bytes(value).partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class KeyGate:
    """``app`` behind ``keys``: a request to a path not in ``open_paths`` without a
    right key gets 401 (OpenAI's ``invalid_api_key`` error object and
    ``WWW-Authenticate: Bearer``); one with a right key runs with :data:`CLIENT`
    set to its key's name. ``on_refused(path)`` is told of each refusal (the
    metrics count them)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, open_paths: Iterable[str] = ("/health",),
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = bearer(scope)
        name = self.keys.match(token) if token is not None else None
        if name is None:
            if self.on_refused is not None:
                self.on_refused(scope.get("path", ""))
            await _refuse(send, "a key is needed: send 'Authorization: Bearer KEY'"
                          if token is None else "Incorrect API key provided")
            return
        mark = CLIENT.set(name)
        try:
            await self.app(scope, receive, send)
        finally:
            CLIENT.reset(mark)


async def _refuse(send: Send, message: str) -> None:
    body = json.dumps(error_object(401, message, None, "invalid_api_key")).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
