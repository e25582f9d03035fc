"""A request body's JSON, decoded under bounds: every body a client can send is
either a JSON value the request parsers can read safely, or a 400 error object.

Python's ``json`` module takes more than a request should carry, and some of it
fails later and elsewhere, as an internal error rather than the client's:

* **Nesting.** ``json.loads`` recurses once per level and raises ``RecursionError``
  (not ``ValueError``) past the interpreter's limit, about 1,000 levels; below that
  a value nested hundreds deep is decoded whole. A body is refused past
  :data:`MAX_DEPTH` levels (the deepest the API reads is five: a chat message's
  content part), and a ``RecursionError`` is that refusal too.
* **Text that is not Unicode.** A body must be UTF-8 (RFC 8259 says JSON exchanged
  between systems is); ``json.loads`` would also guess UTF-16 or UTF-32. A ``\\ud800``
  escape decodes to a lone surrogate, a ``str`` that cannot be encoded, which a
  tokenizer fails on long after the request was accepted: refused here, in any
  string or key at any level.
* **Not JSON.** ``NaN``, ``Infinity`` and ``-Infinity`` are refused: they are not
  JSON, and no OpenAI client sends them. An integer past Python's 4,300 digits is
  refused by ``json`` itself.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import invalid

#: levels of arrays and objects a body may nest (the body itself is level 1)
MAX_DEPTH = 32


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def decode_json(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` as a JSON value, or :class:`~xcosd.api.errors.APIError` (400) naming
    what is wrong and, where one is at fault, the top-level field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the body is not UTF-8: byte {e.start} ({raw[e.start:e.start + 1]!r}) "
                      f"is {e.reason}", None, "invalid_json") from None
    try:
        value = json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise invalid(f"the body nests arrays and objects deeper than {max_depth} levels",
                      None, "invalid_json") from None
    except ValueError as e:
        raise invalid(f"the body is not valid JSON: {e}", None, "invalid_json") from None
    _check(value, max_depth)
    return value


def _check(value: Any, max_depth: int) -> None:
    """Walk ``value`` (without recursion: its depth is the thing checked) for
    nesting past ``max_depth`` and for strings that are not Unicode."""
    # (value, its depth, the top-level field it is under)
    stack: list[tuple[Any, int, str | None]] = [(value, 1, None)]
    while stack:
        v, depth, field = stack.pop()
        if isinstance(v, str):
            _unicode(v, field)
        elif isinstance(v, dict | list):
            if depth > max_depth:
                raise invalid(f"the body nests arrays and objects deeper than {max_depth} "
                              f"levels", field, "invalid_json")
            if isinstance(v, dict):
                for k, x in v.items():
                    _unicode(k, field)  # (a key that is not text is named by none)
                    stack.append((x, depth + 1, k if depth == 1 else field))
            else:
                stack.extend((x, depth + 1, field) for x in v)


def _unicode(s: str, field: str | None) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(f"the body holds a lone surrogate (\\u{ord(s[e.start]):04x}): strings "
                      f"must be valid Unicode", field, "invalid_value") from None
