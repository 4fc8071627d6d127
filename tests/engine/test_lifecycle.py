"""Opening and closing the engine, statistics snapshots and structlog events."""

from __future__ import annotations

import anyio
import attrs
import pytest
import structlog

from hicache.domain import ConfigError, EngineClosedError, PoolName, TransferError
from hicache.domain.slots import GroupAllocator
from hicache.engine import EngineStatistics, OperationState, TransferEngine
from tests.engine.fakes import FakeTransfer, InlineStreams, Rig, dense_plan

KV = PoolName.KV


@pytest.mark.asyncio
async def test_an_engine_must_be_opened_and_is_opened_once() -> None:
    rig = Rig()
    try:
        with pytest.raises(EngineClosedError, match="not open"):
            rig.engine.prepare_load({KV: [0]})
        async with rig.engine:
            pass
        with pytest.raises(EngineClosedError, match="already opened"):
            async with rig.engine:
                pass
        with pytest.raises(EngineClosedError, match="closed: cannot load"):
            rig.engine.prepare_load({KV: [0]})
        with pytest.raises(EngineClosedError, match="closed: cannot back up"):
            rig.engine.prepare_backup({KV: [0]})
        with pytest.raises(EngineClosedError, match="closed: cannot submit"):
            rig.engine.submit()
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_close_is_idempotent_and_concurrent_closes_all_return() -> None:
    rig = Rig(delay_s=0.002)
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("c", {KV: 1})
            await engine.load(host)
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.aclose)
                tg.start_soon(engine.aclose)
            assert engine.closed
            await engine.aclose()
        await engine.aclose()
        rig.assert_no_leaks(host_used={KV: 1}, device_used={KV: 1})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_close_keeps_finished_loads_drains_submitted_ones_and_aborts_queued_ones() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            done_host = rig.host_prefix("done", {KV: 1})
            done = await engine.load(done_host)
            await done.wait()
            flying_host = rig.host_prefix("flying", {KV: 1})
            gate = rig.transfer.gate("load", 1)
            flying = await engine.load(flying_host)
            queued = engine.prepare_load(rig.host_prefix("queued", {KV: 1}))
            layerwise = engine.prepare_backup(done.device_pages, layerwise=True)
            engine.submit()
            layerwise.layer_computed(0)
            await anyio.to_thread.run_sync(gate.entered.wait, 5)
            queued2 = engine.prepare_load(rig.host_prefix("queued2", {KV: 1}))
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.aclose)
                await anyio.sleep(0.01)
                gate.open()
        # The finished load is untouched: its pages are still there and still the caller's.
        assert done.state is OperationState.DONE
        done.wait_layer(3)
        for layer in range(rig.layers):
            assert rig.layer_ok(layer, done_host, done.device_pages)
        # The submitted load was not cancelled: it ran to the end.
        assert flying.state is OperationState.DONE
        for layer in range(rig.layers):
            flying.wait_layer(layer)
            assert rig.layer_ok(layer, flying_host, flying.device_pages)
        # What was never submitted or could not finish was aborted, and says why.
        assert queued.state is OperationState.DONE
        assert queued2.state is OperationState.CANCELLED
        with pytest.raises(EngineClosedError, match="engine closed first"):
            await queued2.wait()
        assert layerwise.state is OperationState.CANCELLED
        with pytest.raises(EngineClosedError, match="before the forward pass reported all"):
            await layerwise.wait()
        rig.assert_no_leaks(host_used={KV: 4}, device_used={KV: 3})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_an_error_in_the_engine_block_propagates_as_itself() -> None:
    rig = Rig()
    try:
        with pytest.raises(KeyError, match="boom"):
            async with rig.engine:
                raise KeyError("boom")
        assert rig.engine.closed
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_cancelling_the_task_that_runs_the_engine_closes_it() -> None:
    rig = Rig(delay_s=0.002)
    try:
        with anyio.CancelScope() as scope:
            async with rig.engine as engine:
                host = rig.host_prefix("t", {KV: 1})
                handle = await engine.load(host)
                scope.cancel()
                await anyio.sleep(1)
        assert engine.closed
        assert handle.state is OperationState.DONE  # submitted work drained, not dropped
        rig.assert_no_leaks(host_used={KV: 1}, device_used={KV: 1})
    finally:
        rig.close_streams()


def test_constructor_checks_and_needs_no_event_loop() -> None:
    plan = dense_plan(4)
    other = dense_plan(3)
    slots = GroupAllocator(plan)
    streams = InlineStreams()
    with pytest.raises(ConfigError, match="moves 3 transfer layers but the plan has 4"):
        TransferEngine(
            plan=plan,
            transfer=FakeTransfer(other),
            streams=streams,
            host_slots=slots,
            device_slots=slots,
        )
    with pytest.raises(ConfigError, match="event_sets must be a positive integer"):
        TransferEngine(
            plan=plan,
            transfer=FakeTransfer(plan),
            streams=streams,
            host_slots=slots,
            device_slots=slots,
            event_sets=0,
        )
    with pytest.raises(ConfigError, match="host_slots must be a GroupAllocator"):
        TransferEngine(
            plan=plan,
            transfer=FakeTransfer(plan),
            streams=streams,
            host_slots=None,  # type: ignore[arg-type]
            device_slots=slots,
        )
    engine = TransferEngine(
        plan=plan,
        transfer=FakeTransfer(plan),
        streams=streams,
        host_slots=slots,
        device_slots=slots,
    )
    assert "new" in repr(engine)


@pytest.mark.asyncio
async def test_statistics_are_frozen_snapshots() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            before = engine.statistics()
            assert isinstance(before, EngineStatistics)
            with pytest.raises(attrs.exceptions.FrozenInstanceError):
                before.loads = 3  # type: ignore[misc]
            host = rig.host_prefix("s", {KV: 2})
            handle = await engine.load(host)
            await handle.wait()
            after = engine.statistics()
            assert before.loads == 0
            assert after.loads == 1
            doc = after.as_json()
            assert doc["loads"] == 1
            assert "load_gbps" in doc
            assert handle.statistics().as_json()["state"] == "done"
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_structlog_events_one_per_batch_at_info_and_per_layer_at_debug() -> None:
    rig = Rig()
    rig.transfer.fail("backup")
    try:
        with structlog.testing.capture_logs() as logs:
            async with rig.engine as engine:
                host = rig.host_prefix("l", {KV: 2})
                a = engine.prepare_load(host)
                b = engine.prepare_load(rig.host_prefix("m", {KV: 1}))
                engine.submit()
                await a.wait()
                await b.wait()
                failing = await engine.backup(a.device_pages)
                with pytest.raises(TransferError):
                    await failing.wait()
                cancelled = engine.prepare_load(host)
                await cancelled.cancel()
    finally:
        rig.close_streams()
    info = [e for e in logs if e["log_level"] == "info"]
    assert [e["event"] for e in info] == [
        "engine_opened",
        "load_batch",
        "backup_batch",
        "load_cancelled",
        "engine_closed",
    ]
    batch = info[1]
    assert batch["ops"] == 2
    assert batch["pages"] == 3
    assert batch["steps"] == rig.layers
    assert batch["done"] == 2
    assert batch["bytes"] == 3 * 4 * 32 * rig.layers
    layers = [e for e in logs if e["event"] == "load_layer"]
    assert [e["layer"] for e in layers] == list(range(rig.layers))
    assert all(e["log_level"] == "debug" for e in layers)
    failed = [e for e in logs if e["event"] == "backup_failed"]
    assert len(failed) == 1
    assert failed[0]["log_level"] == "warning"
    assert "InjectedFault" in failed[0]["error"]
    assert all(e.get("engine") == "engine" for e in logs)
