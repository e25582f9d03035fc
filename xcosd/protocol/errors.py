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
``bad_message``           a follow-up request or reply kind the method lacks
``bad_request``           a follow-up request the method does not allow now
``no_session``            the session does not exist (never opened, closed, freed)
``session_exists``        an open for a session id already in use
``replay``                a sequence number already seen (replayed or reordered)
``state``                 a message not allowed in the session's current state
``handshake``             a session message before the connection's handshake
``vocab``                 vocabulary fingerprints do not match
``method``                unknown method, codec or method options
``busy``                  a cloud limit (sessions, queued work); retry later
``draining``              the cloud is leaving: connect again (elsewhere) and resume
``codec``                 a payload the session's codec cannot decode
``model``                 the target model failed on this session
``unsupported``           the target cannot do it (a chat, and it has no template)
``context_length``        the prompt plus ``max_new_tokens`` exceeds the target's context
``no_context``            a ``base`` the cloud does not hold (any more): send it whole
``internal``              a bug on the sender's side
========================  =====================================================

A received code this side does not know (a newer peer) stays a plain string on
the :class:`~xcosd.protocol.messages.Error` and becomes a ``ProtocolError`` with
code ``protocol`` that names it.
"""

from __future__ import annotations

from ..errors import (
    BusyError,
    CodecError,
    ErrorCode,
    InvalidDistribution,
    ModelError,
    ProtocolError,
    VocabError,
    XcosdError,
)

#: the codes an ``error`` message carries (the table above)
CODES: tuple[ErrorCode, ...] = (
    ErrorCode.BAD_FRAME, ErrorCode.TOO_LARGE, ErrorCode.UNKNOWN_TYPE, ErrorCode.VERSION,
    ErrorCode.BAD_FIELD, ErrorCode.BAD_VECTOR, ErrorCode.BAD_TOKEN, ErrorCode.BAD_MESSAGE,
    ErrorCode.BAD_REQUEST, ErrorCode.NO_SESSION, ErrorCode.SESSION_EXISTS, ErrorCode.REPLAY,
    ErrorCode.STATE, ErrorCode.HANDSHAKE, ErrorCode.VOCAB, ErrorCode.METHOD, ErrorCode.CODEC,
    ErrorCode.BUSY, ErrorCode.DRAINING, ErrorCode.MODEL, ErrorCode.UNSUPPORTED, ErrorCode.CONTEXT_LENGTH,
    ErrorCode.NO_CONTEXT, ErrorCode.INTERNAL,
)

_CLASSES: dict[ErrorCode, type[XcosdError]] = {
    ErrorCode.BUSY: BusyError,
    ErrorCode.VOCAB: VocabError,
    ErrorCode.BAD_VECTOR: InvalidDistribution,
    ErrorCode.CODEC: CodecError,
    ErrorCode.MODEL: ModelError,
}


def error_code(exc: BaseException) -> ErrorCode:
    """The wire code for an exception raised while handling a peer's message."""
    if isinstance(exc, XcosdError):
        return exc.code
    if isinstance(exc, (TypeError, ValueError)):
        return ErrorCode.BAD_FIELD
    return ErrorCode.INTERNAL


def exception_for(code: ErrorCode | str, message: str) -> XcosdError:
    """The exception a received wire error becomes on this side."""
    if code not in ErrorCode.__members__.values():
        return ProtocolError(f"{code}: {message}", code=ErrorCode.PROTOCOL)
    known = ErrorCode(code)
    return _CLASSES.get(known, ProtocolError)(message, code=known)


__all__ = ["CODES", "ErrorCode", "error_code", "exception_for"]
