"""The OpenAI API's request bodies, read and checked: pure functions, no I/O.

``parse_completion(body, limits)`` and ``parse_chat(body, limits)`` turn a decoded
JSON body into a :class:`CompletionRequest` / :class:`ChatRequest`, or raise
:class:`~xcosd.api.errors.APIError` naming the parameter. The rules:

* **Every field is either honoured or refused.** A parameter this server does not
  implement (``n`` > 1, ``logprobs``, ``echo``, ``best_of`` > 1, tools,
  penalties, ``logit_bias``, a non-text ``response_format`` ...) is a 400
  ``unsupported_parameter`` when it is set to anything but its neutral value, never
  a silent ignore: ignoring it would hand the client an output drawn from another
  law than the one it asked for. A field the API does not know at all is a 400
  too, as OpenAI's own API answers ("Unrecognized request argument"). Fields that
  cannot change the output (``user``, ``metadata``, ``store``, ``service_tier``)
  are accepted and not used.
* **Sampling follows the OpenAI API, and vLLM where OpenAI has no such field.**
  ``temperature`` in [0, 2] (0 is greedy), ``top_p`` in (0, 1], ``top_k`` as vLLM
  takes it (0 or -1: off), ``seed`` any 64-bit integer (a negative one is taken
  modulo 2**64), ``stop`` a string or up to :attr:`RequestLimits.max_stop` strings,
  ``ignore_eos`` (vLLM's: the target's end tokens do not end the output, which runs
  to ``max_tokens``; the tokens drawn are the same; absent, the server's setting).
* **vLLM's extensions are taken at their neutral values.** Tools built for vLLM
  send its sampling extensions (``min_tokens``, ``repetition_penalty``,
  ``skip_special_tokens``, ``include_stop_str_in_output`` ...: :data:`VLLM_NEUTRAL`)
  even when they change nothing; each is accepted at the value that leaves the
  target's law and the text as they are, and refused (400 naming it) at any
  other. ``stream_options.continuous_usage_stats`` (vLLM's too) puts the usage so
  far on every chunk of a stream.
* **Sizes are bounded.** ``max_tokens`` (or ``max_completion_tokens``, which wins
  where both are given) at
  most :attr:`RequestLimits.max_tokens`, prompt text and messages at most
  :attr:`RequestLimits.max_prompt_chars` characters (413 past it), stop strings
  short.
* ``xcosd``: an optional object of this project's own settings (``method``,
  ``codec``, ``draft_len``, ``tree``: a draft-tree shape or ``"auto"``), which the
  ``openai`` client sends with
  ``extra_body``. Unknown keys in it are refused like any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import APIError, invalid, unsupported

#: fields accepted and not used: they cannot change the output
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})

#: chat roles and the role the target's template is given (OpenAI's newer
#: ``developer`` role is its ``system`` role under another name)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

#: vLLM's request extensions, each with the values at which it changes nothing
#: here (the law, the text, the usage) and why any other is refused
VLLM_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "min_tokens": ((0,), "a minimum length changes the target's law"),
    "repetition_penalty": ((1, 1.0), "penalties change the target's law"),
    "length_penalty": ((1, 1.0), "no beam search"),
    "min_p": ((0, 0.0), "min-p sampling is not implemented"),
    "use_beam_search": ((False,), "no beam search"),
    "skip_special_tokens": ((True,), "special tokens are left out of the text"),
    "spaces_between_special_tokens": ((True,), "special tokens are left out of the text"),
    "include_stop_str_in_output": ((False,), "stop strings are left out of the text"),
    "stop_token_ids": (([],), "only the target's own end tokens and stop strings end a "
                             "generation"),
    "bad_words": (([],), "a banned word changes the target's law"),
    "allowed_token_ids": ((), "a token mask changes the target's law"),
    "truncate_prompt_tokens": ((), "prompts are never truncated"),
    "prompt_logprobs": ((), "the verified rows stay on the cloud"),
    "detokenize": ((True,), "the text is always returned"),
    "return_tokens_as_token_ids": ((False,), "tokens are returned as text (and as ids in "
                                             "the 'xcosd' object)"),
    "guided_json": ((), "no constrained decoding"),
    "guided_regex": ((), "no constrained decoding"),
    "guided_choice": ((), "no constrained decoding"),
    "guided_grammar": ((), "no constrained decoding"),
    "guided_decoding_backend": ((), "no constrained decoding"),
    "logits_processors": ((), "a processor changes the target's law"),
    "priority": ((0,), "requests are served as they come"),
}
#: vLLM's chat extensions, as :data:`VLLM_NEUTRAL`
VLLM_CHAT_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "add_generation_prompt": ((True,), "the target's template always opens the answer"),
    "continue_final_message": ((False,), "the target's template always opens an answer"),
    "echo": ((False,), "the prompt is not echoed"),
    "chat_template": ((), "the target's own chat template is used"),
    "chat_template_kwargs": ((), "the target's own chat template is used as it is"),
    "documents": ((), "the target's own chat template is used as it is"),
}
#: vLLM's fields that cannot change the output: accepted and not used
VLLM_IGNORED = frozenset({"request_id"})

#: the ``xcosd`` object's keys
XCOSD_KEYS = frozenset({"method", "codec", "draft_len", "tree"})


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for."""

    #: tokens one request may generate at most
    max_tokens: int = 4096
    #: tokens a request generates when it names no ``max_tokens``
    default_max_tokens: int = 256
    #: characters of prompt text (completions) or of all messages (chat)
    max_prompt_chars: int = 256 << 10
    #: prompt tokens (a prompt given as ids, or the rendered chat)
    max_prompt_tokens: int = 32 << 10
    #: stop strings, and characters of each
    max_stop: int = 16
    max_stop_chars: int = 256
    #: chat messages
    max_messages: int = 1024


@dataclass(frozen=True)
class Sampling:
    """The settings both endpoints share."""

    model: str
    max_tokens: int
    #: whether the request named ``max_tokens`` (else it is the server's default, which
    #: a prompt near the end of the target's context shortens, xcosd/api/app.py)
    max_tokens_given: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    #: ``None`` where not given: the server's own setting holds
    ignore_eos: bool | None
    stream: bool
    include_usage: bool
    #: vLLM's ``continuous_usage_stats``: the usage so far on every chunk
    continuous_usage: bool
    #: the ``xcosd`` object's settings, ``None`` where not given
    method: str | None
    codec: str | None
    draft_len: int | None
    tree: str | None

    def generation_kwargs(self) -> dict[str, Any]:
        """Keyword settings for :meth:`xcosd.nodes.EdgeNode.generate`."""
        kw: dict[str, Any] = {"max_new_tokens": self.max_tokens, "seed": self.seed,
                              "stop_strings": list(self.stop), "ignore_eos": self.ignore_eos}
        if self.temperature == 0.0:
            kw["do_sample"] = False
        else:
            kw.update(do_sample=True, temperature=self.temperature, top_p=self.top_p,
                      top_k=self.top_k)
        for k in ("method", "codec", "draft_len", "tree"):
            v = getattr(self, k)
            if v is not None:
                kw[k] = v
        return kw


@dataclass(frozen=True)
class CompletionRequest(Sampling):
    """``POST /v1/completions``: ``prompt`` is text or target token ids."""

    prompt: str | tuple[int, ...]


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class ChatRequest(Sampling):
    """``POST /v1/chat/completions``."""

    messages: tuple[ChatMessage, ...]


# ------------------------------------------------------------------ field readers


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float, *,
            lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise invalid(f"'{key}' must be a number, got {type(v).__name__}", key, "invalid_type")
    f = float(v)
    if not (lo < f if lo_open else lo <= f) or not f <= hi:
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise invalid(f"'{key}' must be in {rng}, got {v}", key)
    return f


def _integer(body: Mapping[str, Any], key: str, default: int | None, lo: int,
             hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise invalid(f"'{key}' must be an integer, got {type(v).__name__}", key, "invalid_type")
    if not lo <= v <= hi:
        raise invalid(f"'{key}' must be in [{lo}, {hi}], got {v}", key)
    return int(v)


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"'{key}' must be a boolean, got {type(v).__name__}", key, "invalid_type")
    return v


def _neutral(body: Mapping[str, Any], key: str, why: str, *neutral: Any) -> None:
    """Refuse ``key`` unless absent, null or one of its ``neutral`` values."""
    if key not in body:
        return
    v = body[key]
    if v is None or any(v == n and type(v) is type(n) for n in neutral):
        return
    raise unsupported(key, why)


def _stop(body: Mapping[str, Any], limits: RequestLimits) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > limits.max_stop:
        raise invalid(f"'stop' takes at most {limits.max_stop} strings", "stop")
    for s in stops:
        if not s:
            raise invalid("'stop' strings must not be empty", "stop")
        if len(s) > limits.max_stop_chars:
            raise invalid(f"'stop' strings are at most {limits.max_stop_chars} characters",
                          "stop")
    return tuple(stops)


def _xcosd(body: Mapping[str, Any]) -> dict[str, Any]:
    x = body.get("xcosd")
    if x is None:
        return {}
    if not isinstance(x, dict):
        raise invalid("'xcosd' must be an object", "xcosd", "invalid_type")
    extra = sorted(set(x) - XCOSD_KEYS)
    if extra:
        raise invalid(f"unknown 'xcosd' setting {extra[0]!r}; known: "
                      f"{', '.join(sorted(XCOSD_KEYS))}", f"xcosd.{extra[0]}",
                      "unknown_parameter")
    out: dict[str, Any] = {}
    for k in ("method", "codec", "tree"):
        if x.get(k) is not None:
            if not isinstance(x[k], str):
                raise invalid(f"'xcosd.{k}' must be a string", f"xcosd.{k}", "invalid_type")
            out[k] = x[k]
    out["draft_len"] = _integer(x, "draft_len", None, 0, 64)
    return out


def _unknown(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for k in body:
        if k not in known:
            raise APIError(400, f"Unrecognized request argument supplied: {k}", k,
                           "unknown_parameter")


#: the fields both endpoints read
_COMMON = frozenset({"model", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                     "top_k", "seed", "stop", "ignore_eos", "stream", "stream_options", "n",
                     "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "xcosd"}
                    ) | IGNORED_FIELDS | VLLM_IGNORED | frozenset(VLLM_NEUTRAL)
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "top_logprobs", "tools",
                         "tool_choice", "parallel_tool_calls", "functions", "function_call",
                         "response_format", "modalities", "audio", "prediction",
                         "reasoning_effort"} | frozenset(VLLM_CHAT_NEUTRAL)


def _sampling(body: Mapping[str, Any], limits: RequestLimits) -> dict[str, Any]:
    model = body.get("model")
    if model is None:
        raise invalid("you must provide a model parameter", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise invalid("'model' must be a string", "model", "invalid_type")
    for key, why in (("n", "one choice per request"),):
        if body.get(key) is not None and not (_is_int(body[key]) and body[key] == 1):
            if not _is_int(body[key]):
                raise invalid(f"'{key}' must be an integer", key, "invalid_type")
            raise unsupported(key, why)
    for key, (neutral, why) in VLLM_NEUTRAL.items():
        _neutral(body, key, why, *neutral)
    _neutral(body, "presence_penalty", "penalties change the target's law", 0, 0.0)
    _neutral(body, "frequency_penalty", "penalties change the target's law", 0, 0.0)
    if body.get("logit_bias") not in (None, {}):
        raise unsupported("logit_bias", "a bias changes the target's law")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = continuous_usage = False
    if opts is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true",
                          "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise invalid("'stream_options' takes 'include_usage' and "
                          "'continuous_usage_stats'", "stream_options")
        include_usage = _bool(opts, "include_usage", False)
        continuous_usage = _bool(opts, "continuous_usage_stats", False)
    # OpenAI's newer name wins where both are given (as OpenAI's chat takes them)
    max_tokens = _integer(body, "max_completion_tokens", None, 1, limits.max_tokens)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", None, 1, limits.max_tokens)
    seed = _integer(body, "seed", None, -(1 << 63), (1 << 64) - 1)
    x = _xcosd(body)
    return dict(
        model=model,
        max_tokens=limits.default_max_tokens if max_tokens is None else max_tokens,
        max_tokens_given=max_tokens is not None,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(0, int(_integer(body, "top_k", 0, -1, 1 << 31) or 0)),
        seed=None if seed is None else seed % (1 << 64),
        stop=_stop(body, limits),
        ignore_eos=None if body.get("ignore_eos") is None else _bool(body, "ignore_eos", False),
        stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
        method=x.get("method"), codec=x.get("codec"), draft_len=x.get("draft_len"),
        tree=x.get("tree"))


def _check_body(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    return body


# ---------------------------------------------------------------------- endpoints


def parse_completion(body: Any, limits: RequestLimits = RequestLimits()) -> CompletionRequest:
    """``POST /v1/completions``'s body."""
    body = _check_body(body)
    _unknown(body, COMPLETION_FIELDS)
    common = _sampling(body, limits)
    _neutral(body, "echo", "the prompt is not echoed", False)
    _neutral(body, "best_of", "one candidate per request", 1)
    _neutral(body, "suffix", "no insertion mode")
    if body.get("logprobs") is not None:
        raise unsupported("logprobs", "the verified rows stay on the cloud")
    return CompletionRequest(**common, prompt=_prompt(body, limits))


def _prompt(body: Mapping[str, Any], limits: RequestLimits) -> str | tuple[int, ...]:
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("you must provide a prompt", "prompt", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and p and isinstance(p[0], str | list):
        if len(p) != 1:
            raise unsupported("prompt", "one prompt per request (a list of prompts asks for "
                                        "several completions)")
        p = p[0]
    if isinstance(p, str):
        if len(p) > limits.max_prompt_chars:
            raise invalid(f"the prompt has {len(p)} characters; at most "
                          f"{limits.max_prompt_chars}", "prompt", "context_length_exceeded",
                          status=413)
        return p
    if isinstance(p, list) and all(_is_int(i) for i in p):
        if len(p) > limits.max_prompt_tokens:
            raise invalid(f"the prompt has {len(p)} tokens; at most {limits.max_prompt_tokens}",
                          "prompt", "context_length_exceeded", status=413)
        if any(i < 0 for i in p):
            raise invalid("prompt token ids must be >= 0", "prompt")
        return tuple(int(i) for i in p)
    raise invalid("'prompt' must be a string, a list of token ids, or a list of one of those",
                  "prompt", "invalid_type")


def parse_chat(body: Any, limits: RequestLimits = RequestLimits()) -> ChatRequest:
    """``POST /v1/chat/completions``'s body."""
    body = _check_body(body)
    _unknown(body, CHAT_FIELDS)
    common = _sampling(body, limits)
    for key, (neutral, why) in VLLM_CHAT_NEUTRAL.items():
        _neutral(body, key, why, *neutral)
    if body.get("logprobs") not in (None, False):
        raise unsupported("logprobs", "the verified rows stay on the cloud")
    _neutral(body, "top_logprobs", "the verified rows stay on the cloud", 0)
    for key in ("tools", "functions"):
        if body.get(key) not in (None, []):
            raise unsupported(key, "no tool calling")
    for key in ("tool_choice", "function_call"):
        if body.get(key) not in (None, "none"):
            raise unsupported(key, "no tool calling")
    for key in ("audio", "prediction", "reasoning_effort"):
        _neutral(body, key, "not implemented")
    if body.get("modalities") not in (None, ["text"]):
        raise unsupported("modalities", "text only")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise unsupported("response_format", "no constrained decoding")
    return ChatRequest(**common, messages=_messages(body, limits))


def _messages(body: Mapping[str, Any], limits: RequestLimits) -> tuple[ChatMessage, ...]:
    msgs = body.get("messages")
    if msgs is None:
        raise invalid("you must provide 'messages'", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("'messages' must be a non-empty list", "messages", "invalid_type")
    if len(msgs) > limits.max_messages:
        raise invalid(f"at most {limits.max_messages} messages", "messages", status=413)
    out: list[ChatMessage] = []
    chars = 0
    for i, m in enumerate(msgs):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"'{at}' must be an object", at, "invalid_type")
        role = m.get("role")
        if role == "tool" or "tool_calls" in m or "function_call" in m:
            raise unsupported(f"{at}.role" if role == "tool" else at, "no tool calling")
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(f"'{at}.role' must be one of {', '.join(ROLES)}; got {role!r}",
                          f"{at}.role")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise invalid(f"Unrecognized argument in {at}: {extra[0]}", f"{at}.{extra[0]}",
                          "unknown_parameter")
        if m.get("name") is not None:
            raise unsupported(f"{at}.name", "a name would be dropped by most chat templates")
        text = _content(m.get("content"), f"{at}.content")
        chars += len(text)
        if chars > limits.max_prompt_chars:
            raise invalid(f"the messages exceed {limits.max_prompt_chars} characters", "messages",
                          "context_length_exceeded", status=413)
        out.append(ChatMessage(ROLES[role], text))
    return tuple(out)


def _content(c: Any, at: str) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise unsupported(f"{at}[{j}]", f"text content only, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise invalid(f"'{at}[{j}].text' must be a string", f"{at}[{j}].text",
                              "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    if c is None:
        raise invalid(f"'{at}' is required", at, "missing_required_parameter")
    raise invalid(f"'{at}' must be a string or a list of text parts", at, "invalid_type")
