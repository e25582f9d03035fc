"""One error family for the whole package, and the codes its errors carry.

Every error a peer or a caller can see derives from :class:`XcosdError`, and the
ones that travel over the wire carry a stable ``code`` (an :class:`ErrorCode`) so
the other side can act on them (retry on ``busy``, give up on ``version``) without
parsing messages. Input-validation errors also derive from :class:`ValueError` so
ordinary Python code that expects ``ValueError`` for bad arguments keeps working.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Every code an :class:`XcosdError` can carry.

    A ``StrEnum``, so a code compares equal to its string and goes on the wire as
    that string. The wire codes (those an ``error`` message carries) are
    tabulated in :mod:`xcosd.protocol.errors`; the transport codes stay on the
    side that raised them.
    """

    # -- wire: framing and message shape
    BAD_FRAME = "bad_frame"
    TOO_LARGE = "too_large"
    UNKNOWN_TYPE = "unknown_type"
    VERSION = "version"
    BAD_FIELD = "bad_field"
    BAD_VECTOR = "bad_vector"
    BAD_TOKEN = "bad_token"
    #: a follow-up request or reply kind the method does not have at all
    BAD_MESSAGE = "bad_message"
    #: a follow-up request the method does not allow now
    BAD_REQUEST = "bad_request"
    # -- wire: sessions and the handshake
    NO_SESSION = "no_session"
    SESSION_EXISTS = "session_exists"
    REPLAY = "replay"
    STATE = "state"
    HANDSHAKE = "handshake"
    VOCAB = "vocab"
    METHOD = "method"
    CODEC = "codec"
    BUSY = "busy"
    #: the cloud is draining (leaving): connect again, to another node, and resume there
    DRAINING = "draining"
    MODEL = "model"
    #: the cloud's target cannot do what was asked (a chat without a chat template)
    UNSUPPORTED = "unsupported"
    #: a prompt (with its ``max_new_tokens``) longer than the target's context
    CONTEXT_LENGTH = "context_length"
    #: a context named by reference (``base``) that the cloud no longer holds: send it whole
    NO_CONTEXT = "no_context"
    INTERNAL = "internal"
    # -- the families' defaults
    PROTOCOL = "protocol"
    TRANSPORT = "transport"
    # -- transports (local: raised on the side that saw them)
    CLOSED = "closed"
    UNREACHABLE = "unreachable"
    REFUSED = "refused"
    CONNECT = "connect"
    SEND = "send"
    RECV = "recv"
    BIND = "bind"
    ADDRESS_IN_USE = "address_in_use"
    ENDPOINT = "endpoint"
    CURVE = "curve"
    #: a generation reached the bytes it may send (``GenerationConfig.max_uplink_bytes``)
    BUDGET = "budget"


class XcosdError(Exception):
    """Base of every error raised by xcosd."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: ErrorCode | str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = ErrorCode(code)  # a plain string must name a member

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidDistribution(XcosdError, ValueError):
    """A probability vector is NaN, negative, the wrong shape or not normalised."""

    code = ErrorCode.BAD_VECTOR


class VocabError(XcosdError, ValueError):
    """A vocabulary could not be loaded, or two sides disagree on V_C."""

    code = ErrorCode.VOCAB


class CodecError(XcosdError, ValueError):
    """A probability codec could not encode or decode a payload."""

    code = ErrorCode.CODEC


class ProtocolError(XcosdError):
    """A peer sent something the protocol does not allow."""

    code = ErrorCode.PROTOCOL


class TransportError(XcosdError):
    """The connection failed, timed out or was closed."""

    code = ErrorCode.TRANSPORT


class BusyError(XcosdError):
    """The cloud is at a configured limit; retry later."""

    code = ErrorCode.BUSY


class BudgetError(XcosdError):
    """A generation would send the cloud more bytes than it may
    (``GenerationConfig.max_uplink_bytes``): it ends before that message goes."""

    code = ErrorCode.BUDGET


class ModelError(XcosdError):
    """A language model could not be loaded or run."""

    code = ErrorCode.MODEL


def context_length_message(context: int, prompt_tokens: int, completion_tokens: int | None,
                           what: str = "prompt") -> str:
    """Why a generation does not fit the target's context, in the words OpenAI's and
    vLLM's servers use (clients and people know them): both lengths named.
    ``completion_tokens`` ``None``: the prompt alone leaves no room for a token.
    ``what``: the request's part that holds the prompt (``prompt``, ``messages``)."""
    head = f"This model's maximum context length is {context} tokens. However, "
    if completion_tokens is None:
        return (head + f"your {what} resulted in {prompt_tokens} tokens, which leaves no "
                f"room for the completion. Please reduce the length of the {what}.")
    return (head + f"you requested {prompt_tokens + completion_tokens} tokens ({prompt_tokens} "
            f"in the {what}, {completion_tokens} in the completion). Please reduce the "
            f"length of the {what} or completion.")
