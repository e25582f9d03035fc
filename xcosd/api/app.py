"""The OpenAI-compatible HTTP API of an edge node, as an ASGI app.

:class:`OpenAIApp` wraps a running :class:`~xcosd.nodes.EdgeNode`; every HTTP
request becomes one generation (one cloud session) on the edge's one connection.
It is a Starlette app, so a user can mount it in their own ASGI server (FastAPI,
Starlette, any ASGI host); ``xcosd edge --http`` serves it with
:class:`xcosd.http.HttpServer`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (each streamed as
Server-Sent Events with ``"stream": true``, else one JSON object), ``GET
/v1/models``, ``GET /health`` (200 while the cloud is connected, 503 otherwise,
its ``status`` saying why: ``connecting`` while the edge looks for its cloud),
``GET /metrics`` (Prometheus: :mod:`xcosd.api.metrics`).

What it guarantees:

* **The target's law.** Sampling settings map one to one onto the edge's
  :class:`~xcosd.config.GenerationConfig`; whatever would change the output and is
  not implemented is refused (:mod:`xcosd.api.requests`). A chat is rendered by the
  **target's** chat template on the cloud (:meth:`EdgeNode.chat_prompt`) and the
  generation starts from those target ids, so its output is the target's own
  answer to the conversation; it ends at the target's end-of-turn token
  (``finish_reason "stop"``). Stop strings are left out of the text, as OpenAI does
  (:mod:`xcosd.api.stop`).
* **Bounded.** At most ``max_in_flight`` generations at once: one more gets 429
  with ``Retry-After``; a body over ``max_body_bytes`` is refused (413) before it is
  read whole. While the cloud is away (not yet connected, or lost), a request
  waits for it at most the edge's ``cloud_wait_s``, then gets 503 with
  ``Retry-After``.
* **A client that goes away costs nothing.** Each generation runs as a task that
  is cancelled the moment the client disconnects (streamed or not), which closes
  its session on the cloud at once.
* **A door with a lock.** Given API keys, every route but ``/health`` (and
  ``/metrics`` where the operator opens it) answers 401 to a request without one
  of them as its bearer token, before its body is read (:mod:`xcosd.api.keys`).
* **A request picks only what the operator allows.** The ``xcosd`` object's
  method, codec, draft length and tree are checked against a
  :class:`~xcosd.api.policy.RequestPolicy` (400 naming the field), and every
  generation's bytes to the cloud are bounded by it (its
  ``GenerationConfig.max_uplink_bytes``) and counted per key.
* **Errors are OpenAI's error objects** with the right status (400, 401, 404,
  405, 413, 415, 429, 503, 504), and nothing a request does stops the others. A stream
  starts once its request is accepted (not at its first token); an error after
  that is an error event of the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..config import GenerationConfig
from ..errors import ErrorCode, XcosdError
from ..http.exposition import metrics_response
from ..nodes.arrivals import Arrival
from ..nodes.edge import EdgeNode
from ..nodes.stats import GenerationResult, GenerationStats
from . import responses as R
from .errors import APIError, context_exceeded, invalid
from .guard import REQUEST_ID, RequestGuard, internal_error, internal_error_response
from .json_body import decode_json
from .keys import CLIENT, ApiKeys, KeyGate
from .metrics import EdgeMetrics
from .policy import RequestPolicy
from .requests import ChatRequest, CompletionRequest, RequestLimits, parse_chat, parse_completion
from .stop import StopTrim

log = logging.getLogger(__name__)

#: error codes of the cloud or the link, and the HTTP status each becomes
STATUS_FOR_CODE: dict[str, int] = {
    ErrorCode.BUSY: 429,
    ErrorCode.METHOD: 400, ErrorCode.CODEC: 400, ErrorCode.BAD_FIELD: 400,
    ErrorCode.BAD_TOKEN: 400, ErrorCode.TOO_LARGE: 413,
    ErrorCode.CLOSED: 503, ErrorCode.UNREACHABLE: 503, ErrorCode.REFUSED: 503,
    ErrorCode.CONNECT: 503, ErrorCode.TRANSPORT: 503, ErrorCode.HANDSHAKE: 503,
    ErrorCode.VERSION: 503, ErrorCode.VOCAB: 503, ErrorCode.CURVE: 503,
    ErrorCode.MODEL: 502, ErrorCode.INTERNAL: 502,
    ErrorCode.BUDGET: 400, ErrorCode.CONTEXT_LENGTH: 400,
}
#: the OpenAI error ``code`` of a code whose own name would not say enough
API_CODE_FOR: dict[str, str] = {ErrorCode.BUDGET: "uplink_budget_exceeded",
                                ErrorCode.CONTEXT_LENGTH: "context_length_exceeded"}


def api_error_for(exc: BaseException, prompt_param: str | None = None) -> APIError:
    """The HTTP answer to a generation that failed with ``exc``; ``prompt_param``
    (``prompt``, ``messages``) is named by a refusal of the prompt's length (the
    cloud's ``context_length``, when the edge's own check did not see it coming)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, TimeoutError):
        return APIError(504, "the generation did not finish within its deadline", None,
                        "timeout")
    if isinstance(exc, XcosdError):
        code = str(exc.code)
        status = STATUS_FOR_CODE.get(code, 500)
        headers = {"Retry-After": "1"} if status in (429, 503) else None
        msg = ("the cloud is unreachable: " if status == 503 else "") + exc.message
        param = prompt_param if code == ErrorCode.CONTEXT_LENGTH else None
        return APIError(status, msg, param, API_CODE_FOR.get(code, code), headers)
    log.error("request %s: generation failed", REQUEST_ID.get(), exc_info=exc)
    return internal_error(type(exc).__name__)


def _prompt_param(req: CompletionRequest | ChatRequest) -> str:
    """The request field that holds its prompt, as OpenAI's errors name it."""
    return "messages" if isinstance(req, ChatRequest) else "prompt"


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _Generation:
    """One request's generation, running as a task: text pieces arrive on a queue
    (``None`` once it ended); :meth:`cancel` ends it and closes its cloud session."""

    def __init__(self, run: Callable[[Callable[[str], None], GenerationStats],
                                     Coroutine[Any, Any, GenerationResult]],
                 arrived: float, mark: Arrival) -> None:
        self.arrived = arrived
        self.first_at: float | None = None
        #: counted into as it runs: what it sent, even if it fails
        self.stats = GenerationStats()
        #: the name of the API key its request came with
        self.client = CLIENT.get()
        self.pieces: asyncio.Queue[str | None] = asyncio.Queue()
        self.task: asyncio.Task[GenerationResult] = asyncio.get_running_loop().create_task(
            run(self._on_text, self.stats))
        self.task.add_done_callback(lambda _t: self.pieces.put_nowait(None))
        # its first open drops the mark; a generation cancelled before it ran does here
        self.task.add_done_callback(lambda _t: mark.sent())

    def _on_text(self, piece: str) -> None:
        if piece:
            if self.first_at is None:
                self.first_at = time.perf_counter()
            self.pieces.put_nowait(piece)

    async def cancel(self) -> None:
        if not self.task.done():
            self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.arrived


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[Any]) -> Any:
    """``work``'s result, or ``None`` (``work`` cancelled) if the client disconnects
    first: how every wait of a request is cut short when its client goes away."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        with contextlib.suppress(BaseException):
            await watch
        left = not task.done()
        if left:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    return None if left else task.result()


class _Wait:
    """A stream's first piece, not yet taken from its queue."""


_WAIT = _Wait()


class _EventStream(StreamingResponse):
    """A Server-Sent Events response whose body is produced while the client stays:
    the moment it disconnects, the producer is cancelled (whatever the server's ASGI
    version, and even while no event is due)."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, 200, {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                         media_type="text/event-stream")
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def produce() -> None:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            # a send to a client already gone fails: the response is over either way
            with contextlib.suppress(Exception):
                await unless_disconnected(receive, produce())
        finally:
            close = getattr(self.events, "aclose", None)
            if close is not None:
                with contextlib.suppress(BaseException):
                    await close()


class OpenAIApp:
    """The OpenAI-compatible API of ``edge`` (started, or started by the caller
    before the first request).

    ``model``: the model id clients name (default: the cloud's target name);
    ``aliases``: more ids accepted for it. ``limits``: what one request may ask for
    (:class:`~xcosd.api.requests.RequestLimits`). ``max_in_flight``: generations at
    once (429 past it). ``config``: the defaults a request's settings update
    (default: the edge's own). ``api_keys``: the keys a request must carry as its
    bearer token (none: the API is open, for loopback use); ``open_metrics``:
    ``/metrics`` answers without a key too. ``policy``: what a request may pick
    of the protocol and the bytes it may cost (:class:`RequestPolicy`)."""

    def __init__(self, edge: EdgeNode, *, model: str | None = None,
                 aliases: tuple[str, ...] = (), limits: RequestLimits | None = None,
                 max_in_flight: int = 64, retry_after_s: int = 1,
                 config: GenerationConfig | None = None,
                 max_body_bytes: int | None = None,
                 api_keys: ApiKeys | Iterable[str] | None = None, open_metrics: bool = False,
                 policy: RequestPolicy | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.edge = edge
        self._model = model
        self.aliases = frozenset(aliases)
        self.limits = limits or RequestLimits()
        self.policy = policy or RequestPolicy()
        keys = (api_keys if isinstance(api_keys, ApiKeys) or api_keys is None
                else ApiKeys(api_keys))
        self.api_keys = keys if keys else None
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.config = config
        # a prompt's characters as JSON (escapes: up to 6 bytes each) plus the rest
        self.max_body_bytes = (max_body_bytes if max_body_bytes is not None
                               else 6 * self.limits.max_prompt_chars + (64 << 10))
        self.in_flight = 0
        self.started = int(time.time())
        self.metrics = EdgeMetrics(edge.arrivals, edge)
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model:path}", self._model_info, methods=["GET"]),
                Route("/health", self._health, methods=["GET", "HEAD"]),
                Route("/metrics", self._metrics, methods=["GET", "HEAD"]),
            ],
            exception_handlers={HTTPException: self._http_error,
                                Exception: internal_error_response})
        self.app.router.redirect_slashes = False  # a path is the route or a 404
        gated: Any = self.app
        if self.api_keys is not None:
            gated = KeyGate(self.app, self.api_keys,
                            ("/health", "/metrics") if open_metrics else ("/health",),
                            self.metrics.unauthorized)
        self._guarded = RequestGuard(gated)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._guarded(scope, receive, send)

    @property
    def model(self) -> str:
        """The model id this API serves."""
        return self._model or self.edge.target_name or "xcosd"

    # -- small routes ------------------------------------------------------------

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        msg = (f"no route {request.method} {request.url.path}" if exc.status_code == 404
               else f"{request.method} is not allowed on {request.url.path}"
               if exc.status_code == 405 else str(exc.detail))
        self.metrics.request("other", exc.status_code)
        return error_response(APIError(exc.status_code, msg, None,
                                       "not_found" if exc.status_code == 404 else None))

    async def _named(self, request: Request) -> bool:
        """Whether the model's id is known: given, or the cloud's target as its
        welcome said. Before the edge's first handshake, it waits for that (as a
        generation waits for the cloud: at most ``cloud_wait_s``, then 503); False
        if the client left meanwhile."""
        if self._model is not None or self.edge.target_name is not None:
            return True
        try:
            await unless_disconnected(request.receive, self.edge.wait_connected())
        except XcosdError as e:
            raise api_error_for(e) from None
        return self.edge.target_name is not None  # else the client left first

    async def _unnamed(self, request: Request) -> Response | None:
        """The answer of a models route whose model id is not known (:meth:`_named`):
        an error object, 499 for a client that left; ``None`` once it is known."""
        try:
            if not await self._named(request):
                return Response(status_code=499)
        except APIError as e:
            self.metrics.request("models", e.status)
            return error_response(e)
        return None

    async def _models(self, request: Request) -> Response:
        if (early := await self._unnamed(request)) is not None:
            return early
        self.metrics.request("models", 200)
        return JSONResponse(R.models_list(self.model, self.started))

    async def _model_info(self, request: Request) -> Response:
        if (early := await self._unnamed(request)) is not None:
            return early
        name = request.path_params["model"]
        if not self._serves(name):
            self.metrics.request("models", 404)
            return error_response(self._unknown_model(name))
        self.metrics.request("models", 200)
        return JSONResponse(R.models_list(self.model, self.started)["data"][0])

    async def _health(self, request: Request) -> Response:
        ok = self.edge.connected
        reach = self.edge.reach.health(time.monotonic())
        body = {"status": "ok" if ok else reach["state"], "cloud": self.edge.endpoint,
                **reach, "in_flight": self.in_flight, "max_in_flight": self.max_in_flight}
        self.metrics.request("health", 200 if ok else 503)
        return JSONResponse(body, status_code=200 if ok else 503)

    async def _metrics(self, request: Request) -> Response:
        self.metrics.request("metrics", 200)
        return metrics_response(self.metrics.registry, request)

    def _serves(self, name: str) -> bool:
        return name == self.model or name in self.aliases

    def _unknown_model(self, name: str) -> APIError:
        return APIError(404, f"The model '{name}' does not exist; this server serves "
                             f"'{self.model}'", "model", "model_not_found")

    # -- generations -------------------------------------------------------------

    async def _completions(self, request: Request) -> Response:
        return await self._endpoint(request, chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._endpoint(request, chat=True)

    async def _endpoint(self, request: Request, chat: bool) -> Response:
        name = "chat" if chat else "completions"
        arrived = time.perf_counter()
        # requests sent together open their cloud sessions together (a generation's
        # first open waits for the others' marks: xcosd/nodes/arrivals.py); a streamed
        # response's generation holds its mark, any other request's ends here
        mark = self.edge.arrivals.arrived()
        response: Response | None = None
        try:
            response = await self._generate(request, chat, arrived, mark)
        except APIError as e:
            response = error_response(e)
        finally:
            if not isinstance(response, _EventStream):
                mark.leave()
        self.metrics.request(name, response.status_code)
        return response

    async def _body(self, request: Request) -> Any:
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip()
        if ctype not in ("application/json", ""):
            raise APIError(415, f"the body must be application/json, got {ctype}", None,
                           "unsupported_media_type")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise self._too_large()
        buf = bytearray()
        try:
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > self.max_body_bytes:
                    raise self._too_large()
        except ClientDisconnect:  # gone (or dropped at the body's deadline): no one to answer
            raise APIError(499, "the client went away before its body arrived", None,
                           "client_closed") from None
        return decode_json(bytes(buf))

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.max_body_bytes} bytes", None,
                        "request_too_large")

    def _config(self, req: CompletionRequest | ChatRequest) -> GenerationConfig:
        base = self.config or self.edge.config
        try:
            return GenerationConfig.from_kwargs(base, **req.generation_kwargs())
        except (ValueError, TypeError) as e:
            raise invalid(str(e), "xcosd", "invalid_value") from None

    async def _generate(self, request: Request, chat: bool, arrived: float,
                        mark: Arrival) -> Response:
        body = await self._body(request)
        req: CompletionRequest | ChatRequest = (
            parse_chat(body, self.limits) if chat else parse_completion(body, self.limits))
        named = self._model is not None or self.edge.target_name is not None
        if named and not self._serves(req.model):
            raise self._unknown_model(req.model)
        self.policy.check(req, self.config or self.edge.config)
        cfg = self._config(req)
        if self.in_flight >= self.max_in_flight:
            raise APIError(429, f"{self.in_flight} requests are in flight, the most this "
                                f"server takes; retry later", None, "rate_limit_exceeded",
                           {"Retry-After": str(self.retry_after_s)})
        self.in_flight += 1
        self.metrics.running.inc()
        handed_over = False
        gen: _Generation | None = None
        try:
            if not named:  # the served id is the cloud's target's: wait to learn it
                if not await self._named(request):
                    return Response(status_code=499)
                if not self._serves(req.model):
                    raise self._unknown_model(req.model)
            text = req.prompt if isinstance(req, CompletionRequest) and isinstance(
                req.prompt, str) else None
            text_bytes = len(text.encode("utf-8", "surrogatepass")) if text is not None else 0
            if text is not None and self._surely_fits(cfg, text_bytes):
                # a text prompt opens as text (the cloud tokenises it as it would
                # for tokenize): the generation starts now, its length in tokens
                # (usage, the limit) is learned beside it, off the first token's path
                bounded = self._bounded(cfg, text_bytes)
                gen = _Generation(lambda on_text, st: self.edge.generate(
                    text, config=bounded, on_text=on_text, arrival=mark, stats=st),
                    arrived, mark)
            prompt = await unless_disconnected(request.receive,
                                               self._prompt_ids(req, gen, mark))
            if prompt is None:  # the client left while the prompt was prepared
                return Response(status_code=499)
            if gen is None:
                # the prompt's length is known and nothing has reached the cloud: one
                # that cannot fit the target's context is refused here, before any compute
                fitted = self._fit(req, cfg, len(prompt))
                start: str | list[int] = text if text is not None else prompt
                bounded = self._bounded(fitted, text_bytes if text is not None
                                        else 4 * len(prompt))
                gen = _Generation(lambda on_text, st: self.edge.generate(
                    start, config=bounded, on_text=on_text, arrival=mark, stats=st),
                    arrived, mark)
            if req.stream:
                response = await self._stream(request, req, chat, gen, len(prompt))
                handed_over = isinstance(response, _EventStream)
                return response
            return await self._whole(request, req, chat, gen, len(prompt))
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            raise api_error_for(e, _prompt_param(req)) from None
        finally:
            if gen is not None and not handed_over:
                await gen.cancel()  # a refusal or a client gone: its session closes
            if not handed_over:
                self._done()

    def _surely_fits(self, cfg: GenerationConfig, text_bytes: int) -> bool:
        """Whether a text prompt of ``text_bytes`` bytes fits the target's context
        with the request's ``max_tokens`` whatever its tokens, so its generation may
        start before they are counted: a token spells at least one byte, and
        SentencePiece puts one prefix space in front. A longer text is tokenised
        first (a round trip, on a prompt that long a small share of its compute) and
        checked as ids are (:meth:`_fit`). No bound known (not yet connected): the
        cloud's own check answers."""
        context = self.edge.target_context
        return not context or text_bytes + 1 + cfg.max_new_tokens <= context

    def _fit(self, req: CompletionRequest | ChatRequest, cfg: GenerationConfig,
             prompt_tokens: int) -> GenerationConfig:
        """``cfg`` for a prompt of ``prompt_tokens`` target tokens within the target's
        context (the cloud's welcome), or the 400 OpenAI answers: with ``max_tokens``
        given, prompt and completion must fit; without, the server's default is cut
        to the room the prompt leaves (as vLLM's default is that room), and only a
        prompt that leaves none is refused."""
        context = self.edge.target_context
        if not context or prompt_tokens + cfg.max_new_tokens <= context:
            return cfg
        param = _prompt_param(req)
        if req.max_tokens_given:
            raise context_exceeded(context, prompt_tokens, cfg.max_new_tokens, param)
        if prompt_tokens >= context:
            raise context_exceeded(context, prompt_tokens, None, param)
        return cfg.replace(max_new_tokens=context - prompt_tokens)

    def _bounded(self, cfg: GenerationConfig, prompt_bytes: int) -> GenerationConfig:
        """``cfg`` with the policy's bound on the bytes its generation sends."""
        return cfg.replace(max_uplink_bytes=self.policy.uplink_budget(cfg.max_new_tokens,
                                                                      prompt_bytes))

    def _done(self) -> None:
        self.in_flight -= 1
        self.metrics.running.dec()

    async def _prompt_ids(self, req: CompletionRequest | ChatRequest,
                          gen: _Generation | None, mark: Arrival) -> list[int]:
        """The prompt as target ids: a chat rendered by the target's template, text
        tokenised by the target's tokenizer (both on the cloud), ids checked. While
        other requests are arriving, text is tokenised once its generation (``gen``,
        already started) has sent its open: asked before, the tokenize would reach
        the cloud ahead of the opens that wait for each other and delay their first
        call (measured with 16 streams on a target costing 20 ms a call: about
        4 ms). A lone request's is asked at once, while its first round is drafted
        and the cloud is idle (deferred, it cost the embedded pair's first token
        about 2 ms)."""
        if isinstance(req, ChatRequest):
            ids = list(await self.edge.chat_prompt([m.as_dict() for m in req.messages]))
        elif isinstance(req.prompt, str):
            if gen is not None and self.edge.arrivals.pending > int(mark.pending):
                await mark.until_sent()  # others are arriving: after this one's open
            if gen is not None and gen.task.done() and not gen.task.cancelled() and (
                    gen.task.exception() is not None):
                raise gen.task.exception()  # type: ignore[misc]  # e.g. the cloud away
            ids = list(await self.edge.tokenize(req.prompt))
        else:
            ids = list(req.prompt)
            size = self.edge.target_size
            if size is not None and ids and max(ids) >= size:
                raise invalid(f"prompt token ids must be below the target's vocabulary size "
                              f"{size}", "prompt")
        if len(ids) > self.limits.max_prompt_tokens:
            raise invalid(f"the prompt has {len(ids)} tokens; at most "
                          f"{self.limits.max_prompt_tokens}", "messages" if isinstance(
                              req, ChatRequest) else "prompt", "context_length_exceeded",
                          status=413)
        return ids

    async def _whole(self, request: Request, req: CompletionRequest | ChatRequest, chat: bool,
                     gen: _Generation, prompt_tokens: int) -> Response:
        try:
            res = await unless_disconnected(request.receive, asyncio.shield(gen.task))
        except BaseException:
            self._count(gen, "error", prompt_tokens, None)
            raise
        if res is None:
            await gen.cancel()
            self._count(gen, "abort", prompt_tokens, None)
            return Response(status_code=499)
        assert isinstance(res, GenerationResult)
        trim = StopTrim(req.stop)
        trim.feed(res.text)
        text = trim.shown + trim.finish(res.finish_reason == "stop")
        self._count(gen, res.finish_reason, prompt_tokens, res)
        use = R.usage(prompt_tokens, len(res.token_ids))
        info = R.xcosd_info(res.stats, res.token_ids)
        build = R.chat_completion if chat else R.completion
        return JSONResponse(build(R.completion_id(chat), R.now(), req.model, text,
                                  res.finish_reason, use, info))

    def _count(self, gen: _Generation, reason: str, prompt_tokens: int,
               res: GenerationResult | None) -> None:
        self.metrics.generation(reason, prompt_tokens, res.stats if res is not None else None,
                                gen.ttft_s, time.perf_counter() - gen.arrived)
        self.metrics.client(gen.client, gen.stats)

    async def _stream(self, request: Request, req: CompletionRequest | ChatRequest, chat: bool,
                      gen: _Generation, prompt_tokens: int) -> Response:
        if self.edge.connected:
            # accepted (valid, a slot taken, the prompt's length known, the cloud
            # connected): the response starts now, as OpenAI's and vLLM's do, so the
            # client reads the head while the first round runs, not after it; an
            # error from here on is an event of the stream
            return _EventStream(self._events(req, chat, gen, prompt_tokens, _WAIT))
        # the cloud is away: the generation waits for it to come back, and one that
        # cannot still gets its status (503), so wait for the first piece to answer
        first = await unless_disconnected(request.receive, gen.pieces.get())
        if first is None and not gen.task.done():  # the client left
            await gen.cancel()
            self._count(gen, "abort", prompt_tokens, None)
            return Response(status_code=499)
        if first is None and gen.task.exception() is not None:
            self._count(gen, "error", prompt_tokens, None)
            raise api_error_for(gen.task.exception(), _prompt_param(req))  # type: ignore[arg-type]
        return _EventStream(self._events(req, chat, gen, prompt_tokens, first))

    async def _events(self, req: CompletionRequest | ChatRequest, chat: bool, gen: _Generation,
                      prompt_tokens: int, first: str | _Wait | None) -> AsyncIterator[bytes]:
        cid, created, model = R.completion_id(chat), R.now(), req.model
        usage_null = req.include_usage
        trim = StopTrim(req.stop)
        reason = "abort"
        res: GenerationResult | None = None

        # vLLM's continuous_usage_stats: each chunk carries the usage so far (only
        # with include_usage, as vLLM reads it)
        continuous = req.include_usage and req.continuous_usage

        def counted(chunk: dict[str, Any]) -> bytes:
            if continuous:
                chunk["usage"] = R.usage(prompt_tokens, gen.stats.tokens)
            return R.sse(chunk)

        def piece(text: str) -> bytes:
            if chat:
                return counted(R.chat_chunk(cid, created, model, {"content": text},
                                            include_usage=usage_null))
            return counted(R.completion_chunk(cid, created, model, text,
                                              include_usage=usage_null))

        try:
            if chat:
                yield counted(R.chat_chunk(cid, created, model,
                                           {"role": "assistant", "content": ""},
                                           include_usage=usage_null))
            item = await gen.pieces.get() if isinstance(first, _Wait) else first
            ended = item is None
            while not ended:
                # every piece that is already here goes in one chunk: under load a
                # client gets fewer, larger events instead of falling behind
                pieces = [item]
                while not gen.pieces.empty():
                    nxt = gen.pieces.get_nowait()
                    if nxt is None:
                        ended = True
                        break
                    pieces.append(nxt)
                out = trim.feed("".join(p for p in pieces if p))
                if out:
                    yield piece(out)
                if not ended:
                    item = await gen.pieces.get()
                    ended = item is None
            try:
                res = await gen.task
            except Exception as e:
                reason = "error"
                yield R.sse(api_error_for(e, _prompt_param(req)).body())
                yield R.DONE
                return
            reason = res.finish_reason
            rest = trim.finish(reason == "stop")
            if rest:
                yield piece(rest)
            info = R.xcosd_info(res.stats)
            if chat:
                last = R.chat_chunk(cid, created, model, {}, reason, include_usage=usage_null)
            else:
                last = R.completion_chunk(cid, created, model, "", reason,
                                          include_usage=usage_null)
            last["xcosd"] = info
            yield counted(last)
            if req.include_usage:
                yield R.sse(R.usage_chunk(cid, created, model, chat,
                                          R.usage(prompt_tokens, len(res.token_ids)), info))
            yield R.DONE
        finally:
            await gen.cancel()
            self._count(gen, reason, prompt_tokens, res)
            self._done()
