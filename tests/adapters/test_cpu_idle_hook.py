"""CPU streams' idle signal: a hook called once a worker finished its work and has none queued."""

from __future__ import annotations

import threading

from hicache.adapters.streams.cpu import CpuStreams
from hicache.domain.ports import Direction, IdleSignal


def test_the_idle_hook_runs_after_the_last_queued_work_finished() -> None:
    streams = CpuStreams(name="idle")
    try:
        assert isinstance(streams, IdleSignal)
        release = threading.Event()
        seen: list[tuple[bool, bool]] = []
        called = threading.Event()
        events = []

        def hook() -> None:
            seen.append((events[0].query(), events[1].query()))
            called.set()

        streams.set_idle_hook(hook)
        events.append(streams.submit(Direction.LOAD, lambda: release.wait(5)))
        events.append(streams.submit(Direction.LOAD, lambda: None))
        release.set()
        assert called.wait(5)
        events[1].synchronize()
        # Called once the queue ran dry (not after the first work), with both events finished.
        assert seen == [(True, True)]
        streams.set_idle_hook(None)
        streams.submit(Direction.LOAD, lambda: None).synchronize()
        assert seen == [(True, True)]
    finally:
        streams.close()


def test_a_hook_that_raises_is_dropped_and_the_stream_keeps_running() -> None:
    streams = CpuStreams(name="idle")
    try:

        def hook() -> None:
            raise RuntimeError("broken hook")

        streams.set_idle_hook(hook)
        streams.submit(Direction.LOAD, lambda: None).synchronize()
        done = streams.submit(Direction.LOAD, lambda: 7)
        done.synchronize()
        assert done.exception() is None
    finally:
        streams.close()
