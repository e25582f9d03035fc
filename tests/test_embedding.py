"""The nodes embedded in an application's own event loop (asyncio and uvloop):
they run beside the app's tasks, never call ``asyncio.run``, and leave no task,
thread or socket behind."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
import uvloop

import xcosd

from .session_pairs import pair


async def _app() -> dict[str, object]:
    """An app with its own periodic task, using xcosd as a library."""
    before_tasks = asyncio.all_tasks()
    before_threads = set(threading.enumerate())
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    tick_task = asyncio.get_running_loop().create_task(ticker())
    target, draft = pair()
    sockets: list[object] = []
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", metrics_port=0) as cloud:
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, method="xcosd-e",
                                  codec="f32", draft_thread=True) as edge:
            res = await edge.generate("abcab", max_new_tokens=32, temperature=1.0,
                                      top_k=0, top_p=1.0, seed=7)
            streamed = [p async for p in edge.stream("ab", max_new_tokens=16, seed=1)]
            # leave a stream early: its session is closed on the cloud
            async for _ in edge.stream("ab", max_new_tokens=200, seed=2):
                break
            sockets.append(edge._conn._sock)  # type: ignore[union-attr]
        sockets.append(cloud._listener._sock)  # type: ignore[union-attr]
        running_during = len(asyncio.all_tasks())
    tick_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await tick_task
    await asyncio.sleep(0)
    gc.collect()
    return {
        "res": res, "streamed": streamed, "ticks": ticks, "running_during": running_during,
        "left_tasks": asyncio.all_tasks() - before_tasks - {asyncio.current_task()},
        "left_threads": set(threading.enumerate()) - before_threads,
        "sockets_closed": all(getattr(s, "closed", False) for s in sockets),
    }


def _check(out: dict[str, object]) -> None:
    res = out["res"]
    assert len(res.token_ids) <= 32 and res.text  # type: ignore[attr-defined]
    assert "".join(out["streamed"])  # type: ignore[arg-type]
    assert out["ticks"] > 0  # the app's own task kept running
    assert out["running_during"] > 2
    assert not out["left_tasks"], out["left_tasks"]
    assert not out["left_threads"], out["left_threads"]
    assert out["sockets_closed"]


async def test_embedded_in_the_callers_asyncio_loop() -> None:
    _check(await _app())


def test_embedded_in_a_uvloop_loop() -> None:
    _check(uvloop.run(_app()))
