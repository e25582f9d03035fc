"""One error family for the whole package.

Every error a peer or a caller can see derives from :class:`XcosdError`, and the
ones that travel over the wire carry a stable ``code`` so the other side can act
on them (retry on ``busy``, give up on ``version``) without parsing messages.
Input-validation errors also derive from :class:`ValueError` so ordinary Python
code that expects ``ValueError`` for bad arguments keeps working.
"""

from __future__ import annotations


class XcosdError(Exception):
    """Base of every error raised by xcosd."""

    code: str = "internal"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidDistribution(XcosdError, ValueError):
    """A probability vector is NaN, negative, the wrong shape or not normalised."""

    code = "bad_vector"


class VocabError(XcosdError, ValueError):
    """A vocabulary could not be loaded, or two sides disagree on V_C."""

    code = "vocab"


class CodecError(XcosdError, ValueError):
    """A probability codec could not encode or decode a payload."""

    code = "codec"


class ProtocolError(XcosdError):
    """A peer sent something the protocol does not allow."""

    code = "protocol"


class TransportError(XcosdError):
    """The connection failed, timed out or was closed."""

    code = "transport"


class BusyError(XcosdError):
    """The cloud is at a configured limit; retry later."""

    code = "busy"


class ModelError(XcosdError):
    """A language model could not be loaded or run."""

    code = "model"
