"""Plain ``xcosd serve`` processes behind HAProxy: the stock way to run many clouds.

HAProxy runs in TCP mode (an L4 balancer: each edge connection stays with the cloud
it was given, which holds its sessions' KV caches) with HTTP health checks on each
cloud's ``/health`` (xcosd/nodes/drain.py: 503 while it drains or is full, so new
connections go elsewhere). A cloud that is killed or leaves hands its edges to the
balancer's next pick by exact resume. :func:`haproxy_config` is the configuration
docs/DEPLOY.md shows; the balancer test (tests/test_haproxy_fleet.py) and ``xcosd bench
scale`` run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: seconds a process gets to start (imports, the target) or to stop
START_TIMEOUT_S = 120.0
#: HAProxy's health check interval, ms: a draining cloud stops getting connections
#: within about this long
CHECK_INTER_MS = 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def haproxy_binary() -> str | None:
    """HAProxy's path (``make setup`` installs Debian's package where it is missing)."""
    return shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None)


@dataclass(frozen=True)
class Backend:
    """One cloud behind the balancer: its edge port and its ``/health`` port."""

    name: str
    port: int
    health_port: int
    host: str = "127.0.0.1"


def haproxy_config(front_port: int, backends: Sequence[Backend], stats_port: int, *,
                   front_host: str = "127.0.0.1", inter_ms: int = CHECK_INTER_MS) -> str:
    """The configuration: TCP in front, least connections, an HTTP check of each
    cloud's ``/health`` on its metrics port, a connection that fails redispatched
    to another cloud, and a CSV stats page (``/stats;csv``) for the counts."""
    servers = "\n".join(
        f"    server {b.name} {b.host}:{b.port} check port {b.health_port} "
        f"inter {inter_ms} fall 1 rise 2"
        for b in backends)
    return f"""global
    maxconn 4096

defaults
    mode tcp
    timeout connect 2s
    # edges ping every second and ZeroMQ heartbeats every 5 s: 60 s is idle enough
    timeout client 60s
    timeout server 60s
    retries 3
    option redispatch

frontend xcosd
    bind {front_host}:{front_port}
    default_backend clouds

backend clouds
    balance leastconn
    option httpchk GET /health
    http-check expect status 200
{servers}

listen stats
    mode http
    bind 127.0.0.1:{stats_port}
    stats enable
    stats uri /stats
"""


class Process:
    """A child process whose stderr lines are kept (``lines``)."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)
        self.lines: list[str] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> Process:
        self.lines = []
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for raw in self.proc.stderr:
            self.lines.append(raw.decode(errors="replace").rstrip())

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def wait_line(self, prefix: str, timeout_s: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            for ln in self.lines:
                if ln.startswith(prefix):
                    return ln
            if not self.running or time.monotonic() > deadline:
                tail = "\n".join(self.lines[-15:])
                raise RuntimeError(f"{self.argv[:4]} never said {prefix!r}:\n{tail}")
            await asyncio.sleep(0.05)

    def send(self, sig: int) -> None:
        if self.running:
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def wait(self, timeout_s: float = START_TIMEOUT_S) -> int:
        assert self.proc is not None
        try:
            rc = await asyncio.wait_for(self.proc.wait(), timeout_s)
        finally:
            if self._reader is not None:
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(self._reader, 10)
        return rc

    async def stop(self, sig: int = signal.SIGINT) -> int | None:
        if self.proc is None:
            return None
        self.send(sig)
        try:
            return await self.wait()
        except TimeoutError:
            self.proc.kill()
            return await self.proc.wait()

    def exit_stats(self) -> dict[str, Any] | None:
        """The stats JSON ``xcosd serve`` prints as it exits (``None``: none)."""
        start = next((i for i, ln in enumerate(self.lines) if ln == "{"), None)
        if start is None:
            return None
        end = next((i for i in range(len(self.lines) - 1, start - 1, -1)
                    if self.lines[i] == "}"), None)
        if end is None:
            return None
        try:
            out = json.loads("\n".join(self.lines[start:end + 1]))
        except ValueError:
            return None
        return out if isinstance(out, dict) else None


@dataclass
class Cloud:
    """One ``xcosd serve`` behind the balancer."""

    backend: Backend
    argv: list[str]
    process: Process = field(init=False)

    def __post_init__(self) -> None:
        self.process = Process(self.argv)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.backend.host}:{self.backend.port}"

    @property
    def health_url(self) -> str:
        return f"http://{self.backend.host}:{self.backend.health_port}/health"

    async def start(self) -> Cloud:
        self.process = Process(self.argv)
        await self.process.start()
        await self.process.wait_line("serving ")
        return self


def serve_argv(target: str, port: int, metrics_port: int, *, drain_timeout_s: float = 30.0,
               extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "xcosd", "serve", "--target", target,
            "--bind", f"tcp://127.0.0.1:{port}", "--metrics-port", str(metrics_port),
            "--drain-timeout", repr(drain_timeout_s), *extra]


class Balanced:
    """``n`` ``xcosd serve`` processes behind HAProxy (or, ``haproxy=False``, none:
    the no-balancer control, its :attr:`endpoint` listing every cloud)."""

    def __init__(self, n: int, target: str, *, drain_timeout_s: float = 30.0,
                 serve_args: Sequence[str] = (), haproxy: bool = True) -> None:
        self.clouds = [Cloud(Backend(f"c{i}", free_port(), free_port()),
                             serve_argv(target, 0, 0, drain_timeout_s=drain_timeout_s,
                                        extra=serve_args))
                       for i in range(n)]
        for c in self.clouds:  # the ports chosen above
            c.argv = serve_argv(target, c.backend.port, c.backend.health_port,
                                drain_timeout_s=drain_timeout_s, extra=serve_args)
        self.use_haproxy = haproxy
        self.front_port = free_port()
        self.stats_port = free_port()
        self.haproxy: Process | None = None
        self._dir: str | None = None

    @property
    def endpoint(self) -> str:
        if self.use_haproxy:
            return f"tcp://127.0.0.1:{self.front_port}"
        return ",".join(c.endpoint for c in self.clouds)

    async def start(self) -> Balanced:
        await asyncio.gather(*(c.start() for c in self.clouds))
        if self.use_haproxy:
            binary = haproxy_binary()
            if binary is None:
                raise RuntimeError("haproxy is not installed (make setup installs it)")
            self._dir = tempfile.mkdtemp(prefix="xcosd-haproxy-")
            cfg = Path(self._dir) / "haproxy.cfg"
            cfg.write_text(haproxy_config(self.front_port, [c.backend for c in self.clouds],
                                          self.stats_port))
            self.haproxy = Process([binary, "-db", "-f", str(cfg)])
            await self.haproxy.start()
            await self.wait_up(len(self.clouds))
        return self

    def server_stats(self) -> dict[str, dict[str, str]]:
        """HAProxy's CSV stats of the clouds, by server name (``status``: UP /
        DOWN; ``stot``: connections it was given; ``scur``: open now)."""
        url = f"http://127.0.0.1:{self.stats_port}/stats;csv"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {row["svname"]: row for row in rows
                if row.get("pxname") == "clouds" and row["svname"] not in ("BACKEND", "FRONTEND")}

    async def wait_up(self, n: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until HAProxy sees ``n`` clouds UP."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                up = sum(1 for row in (await asyncio.to_thread(self.server_stats)).values()
                         if row["status"].startswith("UP"))
            except OSError:
                up = -1
            if up == n:
                return
            if time.monotonic() > deadline or (self.haproxy and not self.haproxy.running):
                tail = "\n".join(self.haproxy.lines[-10:]) if self.haproxy else ""
                raise RuntimeError(f"HAProxy did not see {n} clouds up (saw {up}):\n{tail}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self.haproxy is not None:
            await self.haproxy.stop(signal.SIGTERM)
        await asyncio.gather(*(c.process.stop() for c in self.clouds if c.process.running),
                             return_exceptions=True)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def __aenter__(self) -> Balanced:
        try:
            return await self.start()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["Backend", "Balanced", "Cloud", "Process", "free_port", "haproxy_binary",
           "haproxy_config", "serve_argv"]
