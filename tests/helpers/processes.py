"""``python -m xcosd ...`` as a user runs it, in a test: a real process on
loopback whose output the test reads as it comes, stopped with SIGINT (a Ctrl-C)
when the test is done with it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .waits import HANG_S


def free_port() -> int:
    """A TCP port free on loopback now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    """A running ``xcosd`` command: its process, the lines it printed on stderr and
    the bytes on stdout, both kept up to date."""

    proc: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    out: bytearray = field(default_factory=bytearray)

    async def exited(self) -> int:
        """Its exit status, once it ends by itself (a hang fails after HANG_S)."""
        return await asyncio.wait_for(self.proc.wait(), HANG_S)


@contextlib.asynccontextmanager
async def xcosd_process(*argv: str, rc: int | None = 0) -> AsyncIterator[Running]:
    """``xcosd ARGV``; stopped with SIGINT on exit unless it ended first, after
    which its exit status must be ``rc`` (``None``: any, for a process the test
    killed or let fail)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "xcosd", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    running = Running(proc)

    async def read_err() -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            running.lines.append(raw.decode(errors="replace").rstrip())

    async def read_out() -> None:
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(1 << 16):
            running.out += chunk

    readers = [asyncio.create_task(read_err()), asyncio.create_task(read_out())]
    try:
        yield running
    except BaseException as e:  # a failed wait shows what the command printed
        e.add_note(f"xcosd {argv[0]} printed:\n" + "\n".join(running.lines[-30:]))
        raise
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), HANG_S)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            for reader in readers:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait_for(reader, HANG_S)
    if rc is not None:
        assert proc.returncode == rc, "\n".join(running.lines[-20:])
