"""Review findings in the engine: races between a forward-pass thread and the event loop, close."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import pytest

from hicache.domain import PoolName
from hicache.domain.ports import Direction, Event
from hicache.engine import OperationState
from tests.engine.fakes import Gate, InlineStreams, Rig, hybrid_plan

KV, MAMBA = PoolName.KV, PoolName.MAMBA


class SlowRecordStreams(InlineStreams):
    """Like CUDA: the work issues its copies inside submit, and the event is recorded after it.

    The first submission of ``direction`` is held at a gate between issuing the copies and
    returning its (re-)recorded event, the window in which the batch still holds the step's
    previous, finished event.
    """

    def __init__(self, direction: Direction) -> None:
        super().__init__()
        self.direction = direction
        self.gate: Gate | None = Gate()

    def submit(
        self, direction: Direction, work: Callable[[], object], event: Event | None = None
    ) -> Event:
        gate = self.gate if direction is self.direction else None
        if gate is None:
            return super().submit(direction, work, event)
        self.gate = None

        def held() -> object:
            out = work()  # the copies are issued (still running on the GPU) ...
            gate.pass_through()  # ... and the event is not recorded yet
            return out

        return super().submit(direction, held, event)


@pytest.mark.asyncio
async def test_cancel_waits_for_a_layer_being_submitted_from_the_forward_thread() -> None:
    streams = SlowRecordStreams(Direction.BACKUP)
    rig = Rig(streams=streams)
    async with rig.engine as engine:
        device = rig.device_slots.allocate({KV: 2}).pages
        handle = engine.prepare_backup(device, layerwise=True)
        engine.submit()
        gate = streams.gate
        assert gate is not None
        forward = threading.Thread(target=handle.layer_computed, args=(0,))
        forward.start()
        while not gate.entered.is_set():
            await anyio.sleep(0.001)
        cancelled = anyio.Event()

        async def cancel() -> None:
            await handle.cancel()
            cancelled.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel)
            for _ in range(50):
                await anyio.sleep(0)
            # Layer 0's copy into the engine's host pages is in flight: they must stay taken.
            still_taken = not cancelled.is_set() and len(engine.host_pins) == 2
            gate.open()
            await anyio.to_thread.run_sync(forward.join)
        assert still_taken
        assert handle.state is OperationState.CANCELLED
        rig.assert_no_leaks(device_used={KV: 2})
        engine.free_device(device)


@pytest.mark.asyncio
async def test_close_keeps_a_layerwise_backup_whose_layers_all_finished() -> None:
    rig = Rig(hybrid_plan(), streams=InlineStreams())
    async with rig.engine as engine:
        device = rig.device_slots.allocate({KV: 2}).pages
        rig.transfer.fill_device(KV, device[KV], "dev")
        rig.transfer.fill_device(PoolName.INDEXER, device[KV], "dev")
        handle = engine.prepare_backup(device, layerwise=True)
        engine.submit()
        # Only the attention layers carry this backup's pages; both are reported and copied.
        handle.layer_computed(0)
        handle.layer_computed(3)
        await engine.aclose()  # before the reaper looked at it
    assert handle.state is OperationState.DONE
    assert rig.backed_up(device, handle.host_pages)
    rig.assert_no_leaks(host_used={KV: 2}, device_used={KV: 2})


@pytest.mark.asyncio
async def test_wait_layer_from_a_thread_during_submission_never_returns_early() -> None:
    streams = SlowRecordStreams(Direction.LOAD)
    rig = Rig(streams=streams)
    async with rig.engine as engine:
        host = rig.host_prefix("h", {KV: 2})
        handle = engine.prepare_load(host)
        gate = streams.gate
        assert gate is not None
        seen: list[object] = []
        last = rig.layers - 1

        def forward() -> None:
            try:
                if not gate.entered.wait(10):
                    seen.append("never entered")
                    return
                try:
                    handle.wait_layer(last)  # layer 0 is being submitted, layer 3 is not yet
                except Exception as e:
                    seen.append(type(e).__name__)
                else:
                    seen.append(rig.layer_ok(last, host, handle.device_pages))
            finally:
                gate.open()

        thread = threading.Thread(target=forward)
        thread.start()
        engine.submit()  # blocks in layer 0's submission until the forward thread looked
        await anyio.to_thread.run_sync(thread.join)
        # Either the layer was in place, or the forward pass was told it is not submitted yet.
        assert seen in ([True], ["TransferError"])
        await handle.wait()
        engine.free_device(handle.device_pages)
        engine.free_host(host)
    rig.assert_no_leaks()


@pytest.mark.asyncio
async def test_a_finished_loads_statistics_survive_the_reuse_of_its_event_set() -> None:
    rig = Rig()
    async with rig.engine as engine:
        host = rig.host_prefix("h", {KV: 2})
        first = await engine.load(host)
        await first.wait()
        before = first.statistics()
        assert before.copy_s > 0
        rig.transfer.delay_s = 0.005  # the next load's copies take visibly longer
        second = await engine.load(host)
        await second.wait()
        assert engine.statistics().event_sets_reused >= 1
        assert first.statistics().copy_s == before.copy_s
        engine.free_device(first.device_pages)
        engine.free_device(second.device_pages)
        engine.free_host(host)
    rig.assert_no_leaks()
    rig.close_streams()


@pytest.mark.asyncio
async def test_both_sharers_cancelled_mid_copy_wait_for_it_and_free_once() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("s", {KV: 2})
            gate = rig.transfer.gate("load", 1)
            first = await engine.load(host)
            second = await engine.load(host)
            assert second.joined
            scopes: list[anyio.CancelScope] = []
            inner_done = anyio.Event()

            async def run_inner() -> None:
                with anyio.CancelScope() as scope:
                    scopes.append(scope)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(first.wait)
                        tg.start_soon(second.wait)
                inner_done.set()

            async with anyio.create_task_group() as outer:
                outer.start_soon(run_inner)
                await anyio.to_thread.run_sync(gate.entered.wait, 5)
                scopes[0].cancel()
                for _ in range(50):
                    await anyio.sleep(0)
                in_flight_kept = not inner_done.is_set() and len(engine.device_pins) == 2
                gate.open()
                await inner_done.wait()
            assert in_flight_kept
            assert first.state is second.state is OperationState.CANCELLED
            rig.assert_no_leaks(host_used={KV: 2})
            engine.free_host(host)
    finally:
        rig.close_streams()
