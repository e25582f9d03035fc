"""Error codes are one closed enum: every code the source raises is a member, a
plain string that names none is refused, and a peer's unknown code survives as a
``protocol`` error that names it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from xcosd.errors import ErrorCode, ProtocolError, TransportError, XcosdError
from xcosd.protocol.errors import CODES, error_code, exception_for

ROOT = Path(__file__).resolve().parent.parent / "xcosd"


def _string_codes() -> set[str]:
    """Every string literal passed as ``code=`` or bound to a name ``code``."""
    found: set[str] = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            value: ast.expr | None = None
            if isinstance(node, ast.keyword) and node.arg == "code":
                value = node.value
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "code" for t in node.targets):
                value = node.value
            for c in ast.walk(value) if value is not None else ():
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    found.add(c.value)
    return found


def test_every_code_in_the_source_is_a_member() -> None:
    codes = _string_codes()
    assert codes  # the scan sees the literals
    assert sorted(codes - {c.value for c in ErrorCode}) == []


def test_wire_codes_are_members_and_distinct() -> None:
    assert len(set(CODES)) == len(CODES) and all(isinstance(c, ErrorCode) for c in CODES)


def test_a_code_is_typed_and_compares_as_its_string() -> None:
    e = ProtocolError("x", code="bad_field")
    assert e.code is ErrorCode.BAD_FIELD and e.code == "bad_field"
    assert TransportError("x").code is ErrorCode.TRANSPORT
    assert error_code(ValueError("x")) is ErrorCode.BAD_FIELD


def test_an_unknown_code_is_refused_locally() -> None:
    with pytest.raises(ValueError):
        XcosdError("x", code="no_such_code")


def test_a_peers_unknown_code_becomes_a_protocol_error_naming_it() -> None:
    e = exception_for("from_the_future", "what happened")
    assert isinstance(e, ProtocolError) and e.code is ErrorCode.PROTOCOL
    assert "from_the_future" in str(e)
    assert exception_for("busy", "later").code is ErrorCode.BUSY
