"""Declarative wire fields: what a message's header keys and buffers are, once.

Each message declares a table of :class:`Field` (a header key: its attribute,
wire key, type and bounds) and of :class:`Buf` (a raw buffer: ids, float32 values
or opaque bytes); :func:`encode_fields` / :func:`decode_fields` and
:func:`encode_buffers` / :func:`decode_buffers` do the work for every message, so
a bound or a type check is written once and cannot drift between encoder and
decoder. Everything a peer sends is hostile until checked: every reader raises
:class:`~xcosd.errors.ProtocolError` (``bad_field``; ``bad_token`` for a negative
id; ``bad_vector`` for a non-probability) and never crashes.

Header key order is the table's order (msgpack keeps it), so the bytes on the
wire are a pure function of the message.

Every message of every round goes through these tables, so each table is compiled
once into a list of per-field steps (:func:`encode_fields` / :func:`decode_fields`
look the compiled form up by the table): a value that passes a field's cheap check
(an int in range, a string short enough) is taken as it is, and anything else goes
through the full reader, which accepts or refuses it exactly as before and words
the error. Decoding is as strict as the readers, for a fraction of their cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import Any

import numpy as np

from ..errors import ErrorCode, ProtocolError

MAX_NAME = 128  # method / codec / node names, option names
MAX_IDS = 1 << 22  # resume ids, V_C arrays
INT_MAX = (1 << 63) - 1
#: a token id: a non-negative int32
TOKEN_MAX = (1 << 31) - 1

Header = dict[str, Any]
Buffers = list[bytes]


def bad(what: str, code: ErrorCode = ErrorCode.BAD_FIELD) -> ProtocolError:
    return ProtocolError(what, code=code)


# ------------------------------------------------------------------ field readers


def get(h: Mapping[str, Any], key: str, t: str) -> Any:
    try:
        return h[key]
    except KeyError:
        raise bad(f"{t}: missing field {key!r}") from None


def read_int(h: Mapping[str, Any], key: str, t: str, lo: int = 0, hi: int = INT_MAX) -> int:
    v = get(h, key, t)
    if type(v) is not int:  # bool is an int subclass: refuse it too
        raise bad(f"{t}: field {key!r} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise bad(f"{t}: field {key!r} = {v} outside {lo}..{hi}")
    return v


def read_float(h: Mapping[str, Any], key: str, t: str, lo: float = -math.inf,
               hi: float = math.inf) -> float:
    v = get(h, key, t)
    if type(v) not in (int, float):
        raise bad(f"{t}: field {key!r} must be a number, got {type(v).__name__}")
    f = float(v)
    if not (math.isfinite(f) and lo <= f <= hi):
        raise bad(f"{t}: field {key!r} = {v!r} outside [{lo}, {hi}]")
    return f


def read_str(h: Mapping[str, Any], key: str, t: str, maxlen: int = MAX_NAME) -> str:
    v = get(h, key, t)
    if not isinstance(v, str):
        raise bad(f"{t}: field {key!r} must be a string, got {type(v).__name__}")
    if len(v) > maxlen:
        raise bad(f"{t}: field {key!r} longer than {maxlen}")
    return v


def read_text(h: Mapping[str, Any], key: str, t: str, max_bytes: int) -> str:
    """A string bounded in UTF-8 bytes (what it costs on the wire), not characters."""
    v = read_str(h, key, t, max_bytes)  # characters <= bytes: a cheap first cut
    if len(v) * 4 > max_bytes and len(v.encode()) > max_bytes:
        raise bad(f"{t}: field {key!r} longer than {max_bytes} bytes of UTF-8")
    return v


def read_bool(h: Mapping[str, Any], key: str, t: str) -> bool:
    v = get(h, key, t)
    if not isinstance(v, bool):
        raise bad(f"{t}: field {key!r} must be a boolean, got {type(v).__name__}")
    return v


def check_count(buffers: Sequence[bytes], n: int, t: str) -> None:
    if len(buffers) != n:
        raise bad(f"{t}: expected {n} buffers, got {len(buffers)}")


#: the wire's two numeric layouts, made once (a dtype named by a string is parsed again
#: on every call, a fair part of converting a few ids)
_I4, _F4 = np.dtype("<i4"), np.dtype("<f4")


def ids_to_bytes(ids: Any) -> bytes:
    """Token ids as little-endian int32 bytes."""
    return np.ascontiguousarray(np.asarray(ids, dtype=np.int64), dtype=_I4).tobytes()


def bytes_to_ids(buf: bytes, t: str, what: str = "ids", n: int | None = None,
                 max_n: int = MAX_IDS) -> np.ndarray:
    """Little-endian int32 bytes -> int64 ids (checked length, never negative)."""
    if len(buf) % 4:
        raise bad(f"{t}: {what} buffer of {len(buf)} bytes is not a whole number of int32")
    k = len(buf) // 4
    if (n is not None and k != n) or k > max_n:
        raise bad(f"{t}: {what} has {k} values, expected {n if n is not None else f'<= {max_n}'}")
    a = np.frombuffer(buf, dtype=_I4).astype(np.int64)
    # a little-endian int32 is negative when the top bit of its last byte is set
    if k and (max(bytes(buf[3::4])) >= 0x80 if k <= SMALL else int(a.min()) < 0):
        raise bad(f"{t}: {what} contains a negative id", code=ErrorCode.BAD_TOKEN)
    return a


def f32_to_bytes(v: Any) -> bytes:
    """Values as little-endian float32 bytes."""
    return np.ascontiguousarray(v, dtype=_F4).tobytes()


def bytes_to_f32(buf: bytes, t: str, what: str, n: int) -> np.ndarray:
    """Little-endian float32 bytes -> float32 array of exactly ``n`` values."""
    if len(buf) != 4 * n:
        raise bad(f"{t}: {what} has {len(buf)} bytes, expected {4 * n}")
    return np.frombuffer(buf, dtype=_F4).astype(np.float32)


#: arrays up to this many values are checked as Python numbers: a numpy reduction
#: costs microseconds of overhead whatever the size, a draft has a handful of values
SMALL = 64


def check_probs(v: np.ndarray, t: str, what: str) -> None:
    """Probability values must be finite and in [0, 1] (``bad_vector`` otherwise)."""
    if not v.size:
        return
    if v.size <= SMALL:
        vals = v.ravel().tolist()
        # a NaN or an infinity makes the sum non-finite; with all finite, min / max
        # are exact
        ok = math.isfinite(sum(vals)) and min(vals) >= 0.0 and max(vals) <= 1.0 + 1e-6
    else:
        ok = bool(np.all(np.isfinite(v))) and float(v.min()) >= 0.0 \
            and float(v.max()) <= 1.0 + 1e-6
    if not ok:
        raise ProtocolError(f"{t}: {what} contains NaN, negative or >1 values",
                            code=ErrorCode.BAD_VECTOR)


# ------------------------------------------------------------------ the specs


class Kind(StrEnum):
    """The type of a header field, and so its reader."""

    INT = "int"
    FLOAT = "float"
    #: a string of at most ``size`` characters
    STR = "str"
    #: a string of at most ``size`` bytes of UTF-8 (prompts)
    TEXT = "text"
    BOOL = "bool"
    #: a list of at most ``size`` integers (a tuple in Python)
    INTS = "ints"
    #: a map of role names to token ids
    ROLES = "roles"
    #: a map of at most ``size`` option names to numbers or booleans
    OPTIONS = "options"
    #: a map read with the ``FIELDS`` of ``nested``
    NESTED = "nested"


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: the default of a field that must be present
REQUIRED: Any = _Required()


def omit_none(v: Any) -> bool:
    return v is None


def omit_falsy(v: Any) -> bool:
    return not v


@dataclass(frozen=True)
class Field:
    """One header key of a message.

    ``attr``: the dataclass attribute; ``key``: the wire key; ``lo``/``hi``:
    bounds of a number; ``size``: the most characters, bytes or items.
    ``nullable``: ``None`` is a value (nil on the wire, or the key left out when
    ``omit`` says so); a nullable field absent or nil reads as ``default``
    (``None`` unless given). A boolean with a ``default`` may be absent.
    ``to_wire`` converts the value before packing (``float`` for a temperature);
    ``from_wire`` converts what was read (a known error code to its enum);
    ``choices`` restricts a string to an enum's values.
    """

    attr: str
    key: str
    kind: Kind
    lo: float = 0
    hi: float = INT_MAX
    size: int = MAX_NAME
    nullable: bool = False
    default: Any = REQUIRED
    omit: Callable[[Any], bool] | None = None
    to_wire: Callable[[Any], Any] | None = None
    from_wire: Callable[[Any], Any] | None = None
    choices: type[StrEnum] | None = None
    nested: Any = None


def _write(f: Field, v: Any) -> Any:
    if f.to_wire is not None and v is not None:
        return f.to_wire(v)
    if f.kind is Kind.INTS:
        return list(v)
    if f.kind in (Kind.ROLES, Kind.OPTIONS):
        return dict(v)
    if f.kind is Kind.NESTED:
        return encode_fields(v, f.nested.FIELDS)
    return v


#: the kinds whose value goes on the wire as it is (without a ``to_wire``)
_PLAIN = frozenset({Kind.INT, Kind.FLOAT, Kind.STR, Kind.TEXT, Kind.BOOL})

#: an encoding step: attribute, wire key, omit test, conversion (``None``: as is)
_EncodeStep = tuple[str, str, Callable[[Any], bool] | None, Callable[[Any], Any] | None]


def _encode_plan(fields: Sequence[Field]) -> list[_EncodeStep]:
    plan: list[_EncodeStep] = []
    for f in fields:
        conv = None if f.kind in _PLAIN and f.to_wire is None else partial(_write, f)
        plan.append((f.attr, f.key, f.omit, conv))
    return plan


def encode_fields(obj: Any, fields: Sequence[Field], into: Header | None = None) -> Header:
    """The header entries of ``obj``, in table order (added to ``into`` when given,
    after what it holds)."""
    h: Header = {} if into is None else into
    for attr, key, omit, conv in _compiled(fields)[0]:
        v = getattr(obj, attr)
        if omit is not None and omit(v):
            continue
        h[key] = v if conv is None else conv(v)
    return h


def _read(h: Mapping[str, Any], f: Field, t: str) -> Any:
    k = f.kind
    if f.nullable and h.get(f.key) is None:
        return None if f.default is REQUIRED else f.default
    if k is Kind.BOOL and f.default is not REQUIRED and f.key not in h:
        return f.default
    if k is Kind.INT:
        return read_int(h, f.key, t, int(f.lo), int(f.hi))
    if k is Kind.FLOAT:
        return read_float(h, f.key, t, f.lo, f.hi)
    if k is Kind.STR:
        s = read_str(h, f.key, t, f.size)
        if f.choices is not None:
            if s not in f.choices.__members__.values():
                raise bad(f"{t}: unknown {f.key!r} value {s!r}")
            return f.choices(s)
        return s
    if k is Kind.TEXT:
        return read_text(h, f.key, t, f.size)
    if k is Kind.BOOL:
        return read_bool(h, f.key, t)
    v = get(h, f.key, t)
    if k is Kind.INTS:
        if not isinstance(v, list) or not all(type(x) is int for x in v) or len(v) > f.size:
            raise bad(f"{t}: {f.key} must be a list of integers")
        return tuple(v)
    if k is Kind.ROLES:
        if not isinstance(v, dict) or not all(
                isinstance(a, str) and type(b) is int for a, b in v.items()):
            raise bad(f"{t}: {f.key} must map strings to ids")
        return dict(v)
    if k is Kind.OPTIONS:
        if not isinstance(v, dict) or len(v) > f.size or not all(
                isinstance(a, str) and len(a) <= MAX_NAME and type(b) in (int, float, bool)
                for a, b in v.items()):
            raise bad(f"{t}: options must map names to numbers or booleans")
        return dict(v)
    if k is Kind.NESTED:
        if not isinstance(v, dict):
            raise bad(f"{t}: {f.attr} must be a map")
        return f.nested(**decode_fields(v, f.nested.FIELDS, t))
    raise AssertionError(f"no reader for {k}")


def decode_fields(h: Mapping[str, Any], fields: Sequence[Field], t: str) -> dict[str, Any]:
    """``{attr: value}`` for every field, each checked (``t`` names the message)."""
    out: dict[str, Any] = {}
    for attr, read, conv in _compiled(fields)[1]:
        v = read(h, t)
        out[attr] = conv(v) if conv is not None and v is not None else v
    return out


_Reader = Callable[[Mapping[str, Any], str], Any]
#: a decoding step: attribute, reader, ``from_wire`` conversion
_DecodeStep = tuple[str, _Reader, Callable[[Any], Any] | None]
#: every table compiled so far, by identity (tables are module-level constants):
#: the table itself, so an id cannot be taken for another one, and its plans
_PLANS: dict[int, tuple[Sequence[Field], list[_EncodeStep], list[_DecodeStep]]] = {}
_ABSENT: Any = object()


def _compiled(fields: Sequence[Field]) -> tuple[list[_EncodeStep], list[_DecodeStep]]:
    got = _PLANS.get(id(fields))
    if got is None or got[0] is not fields:
        got = (fields, _encode_plan(fields),
               [(f.attr, _fast_reader(f), f.from_wire) for f in fields])
        if len(_PLANS) < 4096:  # tables are few; never grow without bound
            _PLANS[id(fields)] = got
    return got[1], got[2]


def _fast_reader(f: Field) -> _Reader:
    """``_read`` for ``f``, with the common case checked inline: a value that passes
    is exactly what ``_read`` returns for it; anything else goes to ``_read``."""
    key, kind = f.key, f.kind
    null_default = None if f.default is REQUIRED else f.default

    def slow(h: Mapping[str, Any], t: str) -> Any:
        return _read(h, f, t)

    if kind is Kind.INT:
        lo, hi, nullable = int(f.lo), int(f.hi), f.nullable

        def read_int_fast(h: Mapping[str, Any], t: str) -> Any:
            v = h.get(key)
            if type(v) is int and lo <= v <= hi:
                return v
            if v is None and nullable:
                return null_default
            return _read(h, f, t)

        return read_int_fast
    if kind is Kind.STR and not f.nullable:
        size = f.size
        members = None if f.choices is None else {m.value: m for m in f.choices}

        def read_str_fast(h: Mapping[str, Any], t: str) -> Any:
            v = h.get(key)
            if type(v) is str and len(v) <= size:
                if members is None:
                    return v
                m = members.get(v)
                if m is not None:
                    return m
            return _read(h, f, t)

        return read_str_fast
    if kind is Kind.BOOL and not f.nullable:
        default = f.default

        def read_bool_fast(h: Mapping[str, Any], t: str) -> Any:
            v = h.get(key, _ABSENT)
            if v is True or v is False:
                return v
            if v is _ABSENT and default is not REQUIRED:
                return default
            return _read(h, f, t)

        return read_bool_fast
    if kind is Kind.FLOAT and not f.nullable:
        flo, fhi = f.lo, f.hi

        def read_float_fast(h: Mapping[str, Any], t: str) -> Any:
            v = h.get(key)
            if type(v) is float and flo <= v <= fhi and math.isfinite(v):
                return v
            return _read(h, f, t)

        return read_float_fast
    return slow


class BufKind(StrEnum):
    """What a buffer holds."""

    #: token ids, little-endian int32
    IDS = "ids"
    #: probabilities, little-endian float32, each in [0, 1]
    PROBS = "probs"
    #: opaque bytes (a codec's payload, a vocabulary table)
    RAW = "raw"


@dataclass(frozen=True)
class Buf:
    """One raw buffer of a message: its attribute, kind and bounds.

    ``what`` names it in errors; ``max_n``: the most values; ``same_len_as``:
    another buffer's attribute whose length this one must have.
    """

    attr: str
    kind: BufKind
    what: str = ""
    max_n: int = MAX_IDS
    same_len_as: str | None = None


def encode_buffers(obj: Any, bufs: Sequence[Buf]) -> Buffers:
    out: Buffers = []
    for b in bufs:
        v = getattr(obj, b.attr)
        out.append(ids_to_bytes(v) if b.kind is BufKind.IDS
                   else f32_to_bytes(v) if b.kind is BufKind.PROBS else v)
    return out


def decode_buffers(buffers: Sequence[bytes], bufs: Sequence[Buf], t: str) -> dict[str, Any]:
    """``{attr: value}`` for the first ``len(bufs)`` buffers (their count is checked
    by the caller, which knows about optional ones)."""
    out: dict[str, Any] = {}
    for raw, b in zip(buffers, bufs, strict=False):
        n = None if b.same_len_as is None else int(out[b.same_len_as].shape[0])
        if b.kind is BufKind.IDS:
            out[b.attr] = bytes_to_ids(raw, t, b.what or b.attr, n=n, max_n=b.max_n)
        elif b.kind is BufKind.PROBS:
            assert n is not None, "a probability buffer follows its ids"
            v = bytes_to_f32(raw, t, b.what or b.attr, n)
            check_probs(v, t, b.what or b.attr)
            out[b.attr] = v
        else:
            out[b.attr] = bytes(raw)
    return out
