"""Keyword settings folded into a node's settings objects, by field name.

A node takes its settings as a few frozen dataclasses (``xcosd/nodes/edge_settings.py``,
``xcosd/nodes/cloud_settings.py``), each field written and documented once. Callers
from before (the CLI, the HTTP server, benchmarks, tests) pass the same settings as
loose keywords: :func:`fold` sends each keyword to the object that has a field of
its name, so the list of names lives in the dataclasses and nowhere else, and a
keyword no object takes fails as a call with a wrong keyword does.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def field_names(cls: type[Any]) -> frozenset[str]:
    """The field names of the dataclass ``cls``."""
    return frozenset(f.name for f in dataclasses.fields(cls))


def split(kwargs: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """Take the keywords in ``names`` out of ``kwargs``; what was taken."""
    return {k: kwargs.pop(k) for k in list(kwargs) if k in names}


def fold(owner: str, base: T | None, cls: type[T], kwargs: dict[str, Any]) -> T:
    """``base`` (else ``cls()``, its defaults) with the keywords of ``kwargs`` that
    name one of ``cls``'s fields, which are taken out of ``kwargs``. ``owner``
    names the constructor in an error."""
    given = split(kwargs, field_names(cls))
    if base is not None and not isinstance(base, cls):
        raise TypeError(f"{owner}: expected a {cls.__name__}, got {type(base).__name__}")
    obj = base if base is not None else cls()
    return dataclasses.replace(obj, **given) if given else obj  # type: ignore[type-var]


def no_more(owner: str, kwargs: Mapping[str, Any]) -> None:
    """Raise the ``TypeError`` a call with an unknown keyword raises, naming them."""
    if kwargs:
        names = ", ".join(repr(k) for k in sorted(kwargs))
        raise TypeError(f"{owner}() got an unexpected keyword argument {names}")


def renamed(owner: str, kwargs: dict[str, Any], old: str, new: str) -> None:
    """Accept the old name of a setting as an alias of ``new``, with a
    ``DeprecationWarning`` that says which name to use (both given: TypeError)."""
    if old not in kwargs:
        return
    if new in kwargs:
        raise TypeError(f"{owner}: give {new}, not both {new} and {old}")
    warnings.warn(f"{owner}({old}=...) is deprecated: it is {new} now", DeprecationWarning,
                  stacklevel=3)
    kwargs[new] = kwargs.pop(old)
