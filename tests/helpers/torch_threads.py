"""Torch on one intra-op thread: for a test module (import the fixture into it), or
around one call (the context manager, where no fixture applies)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def torch_on_one_thread() -> Iterator[None]:
    """One intra-op thread: the rows here are tiny, and the suite runs a worker per
    core, so torch's thread pools would only spin against each other."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    with torch_on_one_thread():
        yield
