"""Copy backend failures become TransferError with context; state stays consistent."""

from __future__ import annotations

import pytest

from hicache.adapters.streams.cpu import CpuStreams
from hicache.domain import PoolName, TransferError
from hicache.engine import OperationState
from tests.engine.fakes import InjectedFault, NoEventStreams, Rig, hybrid_plan

KV, MAMBA = PoolName.KV, PoolName.MAMBA


@pytest.mark.asyncio
async def test_a_load_fault_fails_that_layer_and_after_and_frees_what_the_load_took() -> None:
    rig = Rig(hybrid_plan(), delay_s=0.001)
    rig.transfer.fail("load", layer=3)
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("f", {KV: 2, MAMBA: 1})
            handle = await engine.load(host)
            for layer in range(3):
                handle.wait_layer(layer)  # copied before the fault: fine
                assert rig.layer_ok(layer, host, handle.device_pages)
            with pytest.raises(TransferError) as info:
                handle.wait_layer(3)
            message = str(info.value)
            assert "load #1 (kv: 2 pages, mamba: 1 page) failed at transfer layer 3 of 6" in message
            assert "InjectedFault" in message
            assert isinstance(info.value.__cause__, InjectedFault)
            with pytest.raises(TransferError, match="layer 3"):
                handle.wait_layer(5)
            with pytest.raises(TransferError, match="failed at transfer layer 3"):
                await handle.wait()
            assert handle.state is OperationState.FAILED
            # Layers after the fault were never copied for this load.
            assert [c[1] for c in rig.transfer.calls_of("load")] == [0, 1, 2, 3]
            rig.assert_no_leaks(host_used={KV: 2, MAMBA: 1})
            assert engine.statistics().loads_failed == 1
            # The engine goes on.
            again = await engine.load(host)
            await again.wait()
            for layer in range(rig.layers):
                assert rig.layer_ok(layer, host, again.device_pages)
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_a_fault_in_a_merged_submission_fails_every_load_in_that_step() -> None:
    rig = Rig()
    rig.transfer.fail("load", layer=1)
    try:
        async with rig.engine as engine:
            a = rig.host_prefix("a", {KV: 1})
            b = rig.host_prefix("b", {KV: 1})
            ha = engine.prepare_load(a)
            hb = engine.prepare_load(b)
            engine.submit()
            for handle in (ha, hb):
                with pytest.raises(TransferError, match="merged with 1 other"):
                    await handle.wait()
            rig.assert_no_leaks(host_used={KV: 2})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_an_async_layer_wait_raises_the_fault() -> None:
    rig = Rig()
    rig.transfer.fail("load", layer=0)
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("x", {KV: 1})
            handle = await engine.load(host)
            with pytest.raises(TransferError, match="failed at transfer layer 0"):
                await handle.wait_layer_ready(2)
            rig.assert_no_leaks(host_used={KV: 1})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_a_backup_fault_frees_the_host_pages_and_unpins_the_device() -> None:
    rig = Rig()
    rig.transfer.fail("backup")
    try:
        async with rig.engine as engine:
            device = rig.device_slots.allocate({KV: 2}).pages
            handle = await engine.backup(device)
            with pytest.raises(
                TransferError, match=r"backup #1 \(kv: 2 pages\) failed at all layers"
            ):
                await handle.wait()
            assert handle.state is OperationState.FAILED
            rig.assert_no_leaks(device_used={KV: 2})
            again = await engine.backup(device)
            await again.wait()
            assert engine.statistics().backups == 1
            assert engine.statistics().backups_failed == 1
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_a_layerwise_backup_fault_surfaces_at_wait() -> None:
    rig = Rig()
    rig.transfer.fail("backup_layer", layer=2)
    try:
        async with rig.engine as engine:
            device = rig.device_slots.allocate({KV: 1}).pages
            handle = engine.prepare_backup(device, layerwise=True)
            engine.submit()
            for layer in range(rig.layers):
                handle.layer_computed(layer)
            with pytest.raises(TransferError, match=r"layer-wise backup #1 .* failed at transfer"):
                await handle.wait()
            rig.assert_no_leaks(device_used={KV: 1})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_streams_that_refuse_work_fail_the_loads_not_the_engine() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("r", {KV: 1})
            rig.streams.close()  # e.g. a device error took the streams down
            handle = await engine.load(host)
            with pytest.raises(TransferError, match="EngineClosedError"):
                await handle.wait()
            with pytest.raises(TransferError):
                handle.wait_layer(0)
            rig.assert_no_leaks(host_used={KV: 1})
            assert isinstance(rig.streams, CpuStreams)
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_a_submission_that_cannot_start_keeps_its_operations_to_retry_or_cancel() -> None:
    streams = NoEventStreams()
    rig = Rig(hybrid_plan(), streams=streams)
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("s", {KV: 2, MAMBA: 1})
            handle = engine.prepare_load(host)
            other = engine.prepare_load(rig.host_prefix("t", {KV: 1}))
            streams.fail_next = True
            with pytest.raises(TransferError, match="2 operation\\(s\\) stay queued") as info:
                engine.submit()
            assert isinstance(info.value.__cause__, InjectedFault)
            # Nothing was lost: both loads are still queued with their slots and pins...
            assert handle.state is OperationState.QUEUED
            assert other.state is OperationState.QUEUED
            # ...so one can be cancelled (its pages come back) and the other submitted again.
            await other.cancel()
            engine.submit()
            await handle.wait()
            for layer in range(rig.layers):
                assert rig.layer_ok(layer, host, handle.device_pages)
            engine.free_device(handle.device_pages)
            rig.assert_no_leaks(host_used={KV: 3, MAMBA: 1})
    finally:
        rig.close_streams()
