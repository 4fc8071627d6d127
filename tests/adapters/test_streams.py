"""The streams adapters: CPU worker threads (always) and CUDA streams (marker gpu)."""

from __future__ import annotations

import threading
import time

import pytest

from hicache.adapters.streams import CpuEvent, CpuStreams, open_streams
from hicache.domain import ConfigError, EngineClosedError, TransferError
from hicache.domain.ports import Direction, Event, Streams


@pytest.fixture
def streams() -> CpuStreams:
    s = CpuStreams(name="t")
    yield s  # type: ignore[misc]
    s.close()


def test_cpu_streams_implement_the_port(streams: CpuStreams) -> None:
    assert isinstance(streams, Streams)
    assert isinstance(streams.new_event(), Event)
    assert streams.device == "cpu"


def test_work_runs_in_submission_order_on_one_long_lived_thread_per_direction(
    streams: CpuStreams,
) -> None:
    seen: list[tuple[int, str]] = []
    events = [
        streams.submit(
            Direction.LOAD, lambda i=i: seen.append((i, threading.current_thread().name))
        )
        for i in range(50)
    ]
    events[-1].synchronize()
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"t-load"}
    assert all(ev.query() for ev in events)
    back = streams.submit(
        Direction.BACKUP, lambda: seen.append((-1, threading.current_thread().name))
    )
    back.synchronize()
    assert seen[-1] == (-1, "t-backup")


def test_wait_current_blocks_until_the_work_finished(streams: CpuStreams) -> None:
    release = threading.Event()
    done = []

    def work() -> None:
        release.wait(5)
        done.append(True)

    ev = streams.submit(Direction.LOAD, work)
    assert not ev.query()
    assert ev.exception() is None
    assert ev.elapsed_s() is None
    threading.Timer(0.05, release.set).start()
    ev.wait_current()
    assert done == [True]
    assert ev.query()
    elapsed = ev.elapsed_s()
    assert elapsed is not None
    assert elapsed > 0


def test_errors_are_kept_in_the_event_and_raised_by_synchronize(streams: CpuStreams) -> None:
    def boom() -> None:
        raise ValueError("copy went wrong")

    ev = streams.submit(Direction.LOAD, boom)
    ev.wait_current()  # orders the consumer; does not raise
    assert isinstance(ev.exception(), ValueError)
    with pytest.raises(ValueError, match="copy went wrong"):
        ev.synchronize()
    # The worker survives a failing piece of work.
    ok = streams.submit(Direction.LOAD, lambda: None)
    ok.synchronize()
    assert ok.exception() is None


def test_a_finished_event_is_recorded_again_and_a_pending_one_is_refused(
    streams: CpuStreams,
) -> None:
    idle = streams.new_event()
    assert idle.query()
    release = threading.Event()
    ev = streams.submit(Direction.LOAD, lambda: release.wait(5), idle)
    assert ev is idle
    with pytest.raises(TransferError, match="still in flight"):
        streams.submit(Direction.LOAD, lambda: None, ev)
    release.set()
    ev.synchronize()
    again = streams.submit(Direction.LOAD, lambda: None, ev)
    assert again is ev
    again.synchronize()


def test_a_foreign_event_is_refused(streams: CpuStreams) -> None:
    class Other:
        def query(self) -> bool:
            return True

    with pytest.raises(TransferError, match="does not belong"):
        streams.submit(Direction.LOAD, lambda: None, Other())  # type: ignore[arg-type]


def test_close_drains_queued_work_is_idempotent_and_refuses_more() -> None:
    s = CpuStreams(name="drain")
    seen: list[int] = []
    for i in range(20):
        s.submit(Direction.LOAD, lambda i=i: (time.sleep(0.001), seen.append(i)))
    s.close()
    assert seen == list(range(20))
    s.close()
    assert s.closed
    assert "closed" in repr(s)
    with pytest.raises(EngineClosedError, match="closed"):
        s.submit(Direction.LOAD, lambda: None)
    assert not any(t.name.startswith("drain-") for t in threading.enumerate())


def test_after_compute_is_a_no_op_on_cpu(streams: CpuStreams) -> None:
    streams.after_compute(Direction.BACKUP)
    streams.after_compute(Direction.LOAD)


def test_waiting_on_a_finished_layer_takes_no_lock(streams: CpuStreams) -> None:
    ev = streams.submit(Direction.LOAD, lambda: None)
    ev.synchronize()
    # Holding the stream's condition would deadlock a waiter that took it.
    assert isinstance(ev, CpuEvent)
    cond = ev._cond
    assert cond is not None
    with cond:
        ev.wait_current()


def test_repr_shows_pending_work(streams: CpuStreams) -> None:
    release = threading.Event()
    ev = streams.submit(Direction.LOAD, lambda: release.wait(5))
    streams.submit(Direction.LOAD, lambda: None)
    assert "load 2 pending" in repr(streams)
    assert "pending" in repr(ev)
    release.set()
    ev.synchronize()


def test_open_streams_parses_devices() -> None:
    s = open_streams("cpu")
    try:
        assert isinstance(s, CpuStreams)
    finally:
        s.close()
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        open_streams("tpu")


# -- CUDA (ROCm through torch.cuda) ----------------------------------------------------------


@pytest.mark.gpu
def test_cuda_streams_order_copies_and_make_compute_wait() -> None:
    import torch

    from hicache.adapters.streams import CudaStreams

    s = CudaStreams("cuda")
    try:
        assert isinstance(s, Streams)
        host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
        dev = torch.zeros(1 << 20, dtype=torch.float32, device="cuda")
        ev = s.submit(Direction.LOAD, lambda: dev.copy_(host, non_blocking=True))
        ev.wait_current()  # GPU-side wait; the CPU goes on
        total = dev.sum()  # on the current (compute) stream, after the copy
        assert float(total) == float(host.sum())
        assert ev.query()
        elapsed = ev.elapsed_s()
        assert elapsed is not None
        assert elapsed >= 0
        # A backup after compute reads what compute wrote.
        dev.mul_(2)
        s.after_compute(Direction.BACKUP)
        out = torch.empty_like(host).pin_memory()
        bev = s.submit(Direction.BACKUP, lambda: out.copy_(dev, non_blocking=True))
        bev.synchronize()
        assert torch.equal(out, host * 2)
        # Reuse of a finished event.
        again = s.submit(Direction.LOAD, lambda: None, ev)
        assert again is ev
        again.synchronize()

        def boom() -> None:
            raise RuntimeError("issue failed")

        bad = s.submit(Direction.LOAD, boom)
        with pytest.raises(RuntimeError, match="issue failed"):
            bad.synchronize()
    finally:
        s.close()
        s.close()
    with pytest.raises(EngineClosedError):
        s.submit(Direction.LOAD, lambda: None)


@pytest.mark.gpu
def test_open_streams_gives_cuda_streams_on_a_gpu() -> None:
    from hicache.adapters.streams import CudaStreams

    s = open_streams("cuda")
    try:
        assert isinstance(s, CudaStreams)
        assert s.device.startswith("cuda")
    finally:
        s.close()


def test_cpu_work_ordered_after_a_fence_waits_on_the_worker_not_the_caller(
    streams: CpuStreams,
) -> None:
    from hicache.adapters.streams.cpu import CpuFence

    fence = CpuFence()
    ran: list[str] = []
    start = time.perf_counter()
    streams.after_compute(Direction.BACKUP, fence)  # returns at once
    ev = streams.submit(Direction.BACKUP, lambda: ran.append("copy"))
    assert time.perf_counter() - start < 1.0
    time.sleep(0.05)
    assert ran == []  # the copy waits for the fence
    assert not ev.query()
    fence.signal()
    ev.synchronize()
    assert ran == ["copy"]
    ready = threading.Event()
    ready.set()
    streams.after_compute(Direction.LOAD, ready)  # any object with wait()
    streams.submit(Direction.LOAD, lambda: None).synchronize()
    with pytest.raises(TransferError, match="cannot order CPU streams"):
        streams.after_compute(Direction.BACKUP, object())


@pytest.mark.gpu
def test_cuda_copies_ordered_after_an_event_of_another_stream_read_what_it_wrote() -> None:
    import torch

    s = open_streams("cuda")
    try:
        side = torch.cuda.Stream()
        dev = torch.zeros(1 << 20, dtype=torch.float32, device="cuda")
        out = torch.empty(1 << 20, dtype=torch.float32).pin_memory()
        with torch.cuda.stream(side):  # an overlap scheduler's forward stream
            torch.cuda._sleep(50_000_000)
            dev.fill_(3.0)
            done = torch.cuda.Event()
            done.record(side)
        s.after_compute(Direction.BACKUP, done)  # the current stream knows nothing of ``side``
        s.submit(Direction.BACKUP, lambda: out.copy_(dev, non_blocking=True)).synchronize()
        assert float(out.min()) == 3.0
        s.after_compute(Direction.LOAD, side)
        with pytest.raises(TransferError, match="cannot order CUDA streams"):
            s.after_compute(Direction.LOAD, object())
    finally:
        s.close()
