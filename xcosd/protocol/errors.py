"""Wire error codes and the exceptions they become.

Every error that crosses the link is an :class:`~xcosd.protocol.messages.Error`
with a stable ``code``; the receiving side turns it back into the matching member
of the :mod:`xcosd.errors` family, so callers catch ``BusyError`` or ``VocabError``
instead of parsing messages. Codes a peer can act on:

========================  =====================================================
``bad_frame``             not msgpack, truncated, no header map or no type
``too_large``             over a size limit, refused before decoding
``unknown_type``          a message type this protocol does not have
``version``               the peer speaks another protocol version
``bad_field``             a field is missing or has the wrong type or range
``bad_vector``            a vector with NaN, negatives, wrong length, q(x) = 0
``bad_token``             a token id outside the vocabulary or not allowed here
``bad_request``           a follow-up request the method does not allow now
``no_session``            the session does not exist (never opened, closed, freed)
``session_exists``        an open for a session id already in use
``replay``                a sequence number already seen (replayed or reordered)
``state``                 a message not allowed in the session's current state
``handshake``             a session message before the connection's handshake
``vocab``                 vocabulary fingerprints do not match
``method``                unknown method, codec or method options
``busy``                  a cloud limit (sessions, queued work); retry later
``model``                 the target model failed on this session
``internal``              a bug on the sender's side
========================  =====================================================
"""

from __future__ import annotations

from ..errors import (
    BusyError,
    CodecError,
    InvalidDistribution,
    ModelError,
    ProtocolError,
    VocabError,
    XcosdError,
)

CODES: tuple[str, ...] = (
    "bad_frame", "too_large", "unknown_type", "version", "bad_field", "bad_vector",
    "bad_token", "bad_request", "no_session", "session_exists", "replay", "state",
    "handshake", "vocab", "method", "busy", "model", "internal", "codec",
)

_CLASSES: dict[str, type[XcosdError]] = {
    "busy": BusyError,
    "vocab": VocabError,
    "bad_vector": InvalidDistribution,
    "codec": CodecError,
    "model": ModelError,
}


def error_code(exc: BaseException) -> str:
    """The wire code for an exception raised while handling a peer's message."""
    if isinstance(exc, XcosdError):
        return exc.code if exc.code else "internal"
    if isinstance(exc, (TypeError, ValueError)):
        return "bad_field"
    return "internal"


def exception_for(code: str, message: str) -> XcosdError:
    """The exception a received wire error becomes on this side."""
    cls = _CLASSES.get(code)
    if cls is not None:
        return cls(message, code=code)
    return ProtocolError(message, code=code)


__all__ = ["CODES", "error_code", "exception_for"]
