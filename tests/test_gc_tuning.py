"""The collector setting of processes with many sessions (xcosd/gc_tuning.py)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from xcosd.gc_tuning import GEN0_THRESHOLD, many_sessions_gc


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_the_first_threshold_is_raised_within_and_restored_after() -> None:
    gc.set_threshold(700, 10, 10)
    with many_sessions_gc():
        assert gc.get_threshold() == (GEN0_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_higher_threshold_or_a_disabled_collection_is_left_alone() -> None:
    for t in ((GEN0_THRESHOLD * 2, 5, 7), (0, 10, 10)):
        gc.set_threshold(*t)
        with many_sessions_gc():
            assert gc.get_threshold() == t
        assert gc.get_threshold() == t


def test_as_a_decorator_it_restores_after_an_error_too() -> None:
    gc.set_threshold(700, 10, 10)
    seen: list[tuple[int, int, int]] = []

    @many_sessions_gc()
    def run(fail: bool) -> int:
        seen.append(gc.get_threshold())
        if fail:
            raise RuntimeError("boom")
        return 3

    assert run(False) == 3
    with pytest.raises(RuntimeError):
        run(True)
    assert seen == [(GEN0_THRESHOLD, 10, 10)] * 2
    assert gc.get_threshold() == (700, 10, 10)


def test_the_processes_with_many_sessions_run_under_it() -> None:
    """``xcosd serve`` (and its replicas and broker), the ``xcosd bench`` commands
    that host a cloud or devices, and the load generator's device processes."""
    from xcosd.bench.load.devices import worker_main
    from xcosd.commands import bench, serve

    raw = many_sessions_gc.__wrapped__  # type: ignore[attr-defined]
    for fn in (serve.run, bench.run_load, bench.run_scale, bench.run_soak, worker_main):
        managers = [c.cell_contents for c in fn.__closure__ or ()]
        assert any(getattr(m, "func", None) is raw for m in managers), fn.__qualname__
    assert not any(getattr(c.cell_contents, "func", None) is raw
                   for c in bench.run_methods.__closure__ or ())


async def test_a_node_that_closed_is_freed_without_a_collection() -> None:
    """Under many_sessions_gc full collections are rare, so whatever a process
    drops must not wait for one: an edge node that generated and closed, and the
    cloud's side of its session, are freed by reference counting alone (no
    reference cycle through the node's handshake, connection or meter)."""
    import weakref

    from xcosd.bench.load.devices import load_draft, spec_target_vocab
    from xcosd.config import GenerationConfig
    from xcosd.models import load_model
    from xcosd.nodes import CloudNode, EdgeNode

    spec = "synthetic:256:0:0"
    tv = spec_target_vocab(spec)
    draft = load_draft("synthetic-draft", tv)
    async with CloudNode(load_model(spec), bind="tcp://127.0.0.1:0") as cloud:
        async def lifetime() -> weakref.ref[EdgeNode]:
            edge = EdgeNode(draft, cloud.endpoint, config=GenerationConfig(max_new_tokens=8),
                            target_vocab=tv)
            await edge.start()
            await edge.generate("hello")
            await edge.close()
            return weakref.ref(edge)

        await lifetime()  # the first one also fills caches that live on
        await asyncio.sleep(0.05)
        gc.collect()
        gc.disable()
        try:
            gone = await lifetime()
            await asyncio.sleep(0.05)  # the loop lets go of the node's finished tasks
            assert gone() is None
            assert gc.collect() == 0  # and nothing else it made was left in a cycle
        finally:
            gc.enable()


async def test_refused_messages_leave_nothing_for_a_collection() -> None:
    """A cloud refuses a hostile peer's messages all day; under many_sessions_gc
    what each refusal makes (the exception, its traceback's frames, the error sent
    back) must go with reference counting, not wait for a rare full collection.
    Over a real ZeroMQ connection: frames that are not msgpack, headers that are
    not a map or name an unknown type, and, after a handshake, requests for
    sessions never opened. Each kind is checked to have been answered with its
    error."""
    import msgpack

    from xcosd.bench.load.devices import load_draft, spec_target_vocab
    from xcosd.methods.base import RequestKind
    from xcosd.models import load_model
    from xcosd.nodes import CloudNode
    from xcosd.protocol import RequestMsg, pack
    from xcosd.transport import connect

    from .helpers.raw import handshake, reply

    spec = "synthetic:256:0:0"
    draft = load_draft("synthetic-draft", spec_target_vocab(spec))
    kinds = [  # (the error each is answered with, the message)
        ("bad_frame", lambda i: [b"\x00\x01 not msgpack"]),
        ("bad_frame", lambda i: [msgpack.packb(["draft", i])]),  # a header not a map
        ("unknown_type", lambda i: [msgpack.packb({"t": "nope", "s": i})]),
        ("no_session", lambda i: pack(RequestMsg(1000 + i, 1, 0, RequestKind.MORE))),
    ]
    async with CloudNode(load_model(spec), bind="tcp://127.0.0.1:0") as cloud:
        conn = await connect(cloud.endpoint)
        try:
            await handshake(conn, draft)

            async def refuse(n: int) -> None:
                for _, make in kinds:
                    for i in range(n):
                        await conn.send(make(i))
                        await reply(conn)  # its error

            await refuse(5)  # first refusals fill caches that live on
            await asyncio.sleep(0.05)
            gc.collect()
            gc.disable()
            try:
                await refuse(50)
                await asyncio.sleep(0.05)
                assert gc.collect() == 0
            finally:
                gc.enable()
            want: dict[str, int] = {}
            for code, _ in kinds:
                want[code] = want.get(code, 0) + 55
            assert {str(k): v for k, v in cloud.stats()["errors_by_code"].items()} == want
        finally:
            await conn.close()
