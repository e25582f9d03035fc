"""``xcosd serve --curve-allow DIR`` reads DIR again on SIGHUP and when it changes.

Removing a device's key file is how an operator revokes it; a revocation that
waits for a restart is none. While serving, the allow directory is looked at
every :data:`POLL_S` (the names, sizes and change times of its ``*.key`` files:
a few ``stat`` calls) and on SIGHUP, and read again when it changed:
:meth:`xcosd.transport.CurveServer.reload` admits the keys added and ends the
live connections of the keys removed. A directory that cannot be read as a whole
(a key file half written, a file that is no key) changes nothing: the error is
printed and the last good list stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

#: seconds between two looks at the allow directory
POLL_S = 1.0


def _signature(directory: Path) -> tuple[tuple[str, int, int], ...] | None:
    """What changes when a key file is added, removed or rewritten."""
    try:
        files = sorted(directory.glob("*.key"))
        return tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files)
    except OSError:
        return None


def reload_now(curve: Any, directory: str | os.PathLike[str], why: str) -> None:
    """Read ``directory`` into ``curve``, saying on stderr what changed."""
    from ..errors import XcosdError

    try:
        added, removed = curve.reload(directory)
    except (XcosdError, OSError, ValueError) as e:
        print(f"allow list not reloaded ({why}): {e}; the last one stays", file=sys.stderr,
              flush=True)
        return
    print(f"allow list reloaded ({why}): {len(curve.allow)} keys, {added} added, "
          f"{removed} revoked", file=sys.stderr, flush=True)


@contextlib.asynccontextmanager
async def reloading_allow(curve: Any, directory: str | None,
                          poll_s: float = POLL_S) -> AsyncIterator[None]:
    """While inside, reload ``curve``'s allow list from ``directory`` on SIGHUP and
    when the directory changes (nothing without a directory)."""
    if curve is None or directory is None:
        yield
        return
    d = Path(directory)
    hup = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGHUP, hup.set)

    seen = _signature(d)  # as the allow list was read, not as the task first runs

    async def watch() -> None:
        nonlocal seen
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hup.wait(), poll_s)
            now = _signature(d)
            if hup.is_set():
                hup.clear()
                seen = now
                reload_now(curve, d, "SIGHUP")
            elif now != seen and now is not None:
                seen = now
                reload_now(curve, d, "the directory changed")

    task = asyncio.ensure_future(watch())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGHUP)
