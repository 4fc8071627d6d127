"""The reaper: a sweep costs what finished, not what is in flight; idle streams wake it."""

from __future__ import annotations

import anyio
import pytest

from hicache.adapters.streams.cpu import CpuEvent, CpuStreams
from hicache.domain import PoolName
from hicache.engine import OperationState, _ops, _settling
from tests.engine.fakes import Rig, dense_plan

KV = PoolName.KV


class CountingEvent(CpuEvent):
    """A CPU event that counts how often the engine asks whether it finished."""

    queries = 0

    def query(self) -> bool:
        CountingEvent.queries += 1
        return super().query()


class CountingStreams(CpuStreams):
    def new_event(self) -> CpuEvent:
        return CountingEvent()


async def _until(done: object, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not done():  # type: ignore[operator]
            await anyio.sleep(0.001)


@pytest.mark.asyncio
async def test_a_sweep_looks_at_no_load_batch_queued_behind_one_still_running() -> None:
    rig = Rig(dense_plan(pages=48), streams=CountingStreams(name="counting"))
    try:
        async with rig.engine as engine:
            gate = rig.transfer.gate("load", 0)
            first = await engine.load(rig.host_prefix("a", {KV: 1}))
            await anyio.to_thread.run_sync(gate.entered.wait, 5)
            later = [await engine.load(rig.host_prefix(f"b{i}", {KV: 1})) for i in range(40)]
            CountingEvent.queries = 0
            engine.submit()  # nothing queued: only the sweep runs
            # Per-batch polling would ask at least once per batch in flight (41); the sweep
            # stops at the first load batch whose last step is still on the stream.
            assert CountingEvent.queries <= 4
            assert engine.statistics().in_flight == 41
            gate.open()
            # Nobody waits: the reaper alone settles every load once the stream reaches it.
            await _until(lambda: engine.statistics().loads == 41)
            assert len(engine.host_pins) == 0
            assert len(engine.device_pins) == 0
            for handle in [first, *later]:
                await handle.wait()
                engine.free_device(handle.device_pages)
                engine.free_host(handle.host_pages)
    finally:
        rig.close_streams()
    rig.assert_no_leaks()


@pytest.mark.asyncio
async def test_a_cancelled_load_behind_a_running_one_gives_its_pages_back_at_once() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            gate = rig.transfer.gate("load", 0)
            first = await engine.load(rig.host_prefix("a", {KV: 1}))
            await anyio.to_thread.run_sync(gate.entered.wait, 5)
            host = rig.host_prefix("b", {KV: 2})
            behind = await engine.load(host)
            await behind.cancel()  # none of its steps ran: nothing to wait for
            assert behind.state is OperationState.CANCELLED
            assert engine.statistics().in_flight == 1
            gate.open()
            await first.wait()
            engine.free_device(first.device_pages)
            engine.free_host(first.host_pages)
            engine.free_host(host)
            await _until(lambda: engine.statistics().in_flight == 0)
    finally:
        rig.close_streams()
    rig.assert_no_leaks()


@pytest.mark.asyncio
async def test_a_lone_load_is_settled_when_the_stream_runs_dry_not_at_the_next_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Polls 30 s apart: only the CPU stream's idle signal can end the wait within 5 s.
    monkeypatch.setattr(_ops, "POLL_MIN_S", 30.0)
    monkeypatch.setattr(_ops, "POLL_MAX_S", 30.0)
    monkeypatch.setattr(_settling, "POLL_MIN_S", 30.0)
    monkeypatch.setattr(_settling, "POLL_MAX_S", 30.0)
    rig = Rig()
    try:
        async with rig.engine as engine:
            for tag in ("a", "b", "c"):
                host = rig.host_prefix(tag, {KV: 2})
                handle = await engine.load(host)
                with anyio.fail_after(5):
                    await handle.wait()
                assert rig.layer_ok(0, host, handle.device_pages)
                engine.free_device(handle.device_pages)
                engine.free_host(host)
        # Closing removed the engine's hook from the streams.
        assert isinstance(rig.streams, CpuStreams)
        assert all(w.idle_hook is None for w in rig.streams._workers.values())
    finally:
        rig.close_streams()
    rig.assert_no_leaks()
