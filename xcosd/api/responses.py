"""The OpenAI API's response objects and stream chunks, built from a generation:
pure functions, no I/O.

A completion (``text_completion``) or chat completion (``chat.completion``) carries
``usage`` as OpenAI counts it (prompt and completion tokens, in the target's
tokens, since the output is the target's) and an ``xcosd`` object that clients may
ignore: the method, rounds, acceptance, the bytes each way on the wire, the resumes
and the target token ids of the completion. Streams are Server-Sent Events as
OpenAI sends them: ``data: {json}`` per chunk, a blank line after each, and
``data: [DONE]`` last.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from ..nodes.stats import GenerationStats
from .policy import is_lossless


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def xcosd_info(st: GenerationStats, token_ids: list[int] | None = None) -> dict[str, Any]:
    """The ``xcosd`` object: what the generation cost on the wire and achieved."""
    out: dict[str, Any] = {
        "method": st.method, "codec": st.codec, "rounds": st.rounds, "drafted": st.drafted,
        "accepted": st.accepted, "acceptance": st.acceptance_rate,
        "mean_acceptance_length": st.mean_acceptance_length,
        "uplink_bytes": st.uplink_bytes, "downlink_bytes": st.downlink_bytes,
        "resumes": st.resumes,
        # a lossy method's output is not the target's: the operator allowed it, and
        # the client is told
        "lossless": is_lossless(st.method),
    }
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def completion(cid: str, created: int, model: str, text: str, finish_reason: str,
               use: dict[str, int], info: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": use, "xcosd": info}


def chat_completion(cid: str, created: int, model: str, text: str, finish_reason: str,
                    use: dict[str, int], info: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                                                 "refusal": None},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": use, "xcosd": info}


def completion_chunk(cid: str, created: int, model: str, text: str,
                     finish_reason: str | None = None, *, include_usage: bool = False
                     ) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": cid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": finish_reason}]}
    if include_usage:  # OpenAI sends "usage": null on every chunk but the last
        out["usage"] = None
    return out


def chat_chunk(cid: str, created: int, model: str, delta: dict[str, Any],
               finish_reason: str | None = None, *, include_usage: bool = False
               ) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None,
                     "finish_reason": finish_reason}]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(cid: str, created: int, model: str, chat: bool, use: dict[str, int],
                info: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with ``include_usage``: no choices, the usage."""
    return {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": use, "xcosd": info}


def sse(obj: dict[str, Any]) -> bytes:
    """One Server-Sent Event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


#: the stream's last event
DONE = b"data: [DONE]\n\n"


def models_list(model: str, created: int, owned_by: str = "xcosd") -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": model, "object": "model", "created": created, "owned_by": owned_by}]}
