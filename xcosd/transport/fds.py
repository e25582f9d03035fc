"""File descriptors: what a process holding thousands of connections must raise.

Each connection costs descriptors: a cloud holds one TCP socket per device, and a
process that runs many edge devices (a load generator, a gateway) holds a TCP
socket and a ZeroMQ mailbox per device. Many systems start a process with a soft
limit of 1,024 descriptors, far below the hard limit, and a process past it fails
with ``Too many open files`` while still far from any real resource bound. The
entry points that serve or simulate many devices (``xcosd serve``, ``xcosd bench
load`` and its device processes) therefore raise the soft limit to the hard one at
start, as servers and load generators commonly do (vLLM's API server and its
``bench serve`` among them); so does the load tester's
:func:`~xcosd.bench.load.run_load`, which opens that many connections knowingly.
The nodes never change a process's limits: an application embedding them decides
that for itself, with this function.
"""

from __future__ import annotations

import contextlib

#: the soft limit aimed for: room for tens of thousands of connections
DEFAULT_FD_TARGET = 65536


def fd_limit() -> int | None:
    """The process's soft limit on open descriptors (``None`` where unknown)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def raise_fd_limit(target: int = DEFAULT_FD_TARGET) -> int | None:
    """Raise the soft limit on open descriptors towards ``target``, never past the
    hard limit and never lowering it; the soft limit in force afterwards (``None``
    where the platform has no such limit). A refusal leaves the limit as it was."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return fd_limit()


__all__ = ["DEFAULT_FD_TARGET", "fd_limit", "raise_fd_limit"]
