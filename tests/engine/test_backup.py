"""Backups: after compute, all layers at once or layer by layer during prefill, merged per step."""

from __future__ import annotations

import anyio
import pytest

from hicache.adapters.streams.cpu import CpuStreams
from hicache.domain import PoolName
from hicache.domain.pins import PinnedPageError
from hicache.domain.ports import Direction
from hicache.engine import LayerwiseBackupHandle, OperationState
from tests.engine.fakes import Rig, hybrid_plan

KV, MAMBA = PoolName.KV, PoolName.MAMBA


class OrderedStreams(CpuStreams):
    """CPU streams that record the order of after_compute and submissions per direction."""

    def __init__(self) -> None:
        super().__init__(name="ordered")
        self.log: list[str] = []

    def after_compute(self, direction: Direction) -> None:
        self.log.append(f"after_compute:{direction.value}")
        super().after_compute(direction)

    def submit(self, direction, work, event=None):  # type: ignore[no-untyped-def]
        self.log.append(f"submit:{direction.value}")
        return super().submit(direction, work, event)


@pytest.mark.asyncio
async def test_backup_copies_all_layers_after_compute() -> None:
    streams = OrderedStreams()
    rig = Rig(hybrid_plan(), streams=streams)
    try:
        async with rig.engine as engine:
            device = rig.device_slots.allocate({KV: 2, MAMBA: 1}).pages
            for pool, ids in device.items():
                rig.transfer.fill_device(pool, ids, "dev")
            rig.transfer.fill_device(PoolName.INDEXER, device[KV], "dev")
            handle = await engine.backup(device)
            await handle.wait()
            assert handle.state is OperationState.DONE
            assert streams.log == ["after_compute:backup", "submit:backup"]
            assert rig.backed_up(device, handle.host_pages)
            assert handle.host_pages.keys() == {KV, MAMBA}
            # The host pages are the caller's now; the device pages were never the engine's.
            rig.assert_no_leaks(host_used={KV: 2, MAMBA: 1}, device_used={KV: 2, MAMBA: 1})
            stats = engine.statistics()
            assert stats.backups == 1
            assert stats.bytes_backed_up == handle.statistics().bytes > 0
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_backups_of_one_step_are_one_copy_call() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            a = rig.device_slots.allocate({KV: 1}).pages
            b = rig.device_slots.allocate({KV: 2}).pages
            ha = engine.prepare_backup(a)
            hb = engine.prepare_backup(b)
            engine.submit()
            await ha.wait()
            await hb.wait()
            assert rig.transfer.calls_of("backup") == [("backup", None, (("kv", 3),))]
            assert engine.statistics().submissions == 1
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_backup_into_host_pages_the_caller_names() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            device = rig.device_slots.allocate({KV: 2}).pages
            rig.transfer.fill_device(KV, device[KV], "n")
            host = rig.host_slots.allocate({KV: 2}).pages
            handle = await engine.backup(device, host)
            await handle.wait()
            assert handle.host_pages == dict(host)
            assert rig.backed_up(device, host)
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_the_host_pages_a_backup_writes_cannot_be_freed_or_loaded_meanwhile() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            device = rig.device_slots.allocate({KV: 1}).pages
            gate = rig.transfer.gate("backup")
            handle = await engine.backup(device)
            with pytest.raises(PinnedPageError, match="cannot free"):
                engine.free_host(handle.host_pages)
            with pytest.raises(PinnedPageError, match="cannot load from"):
                engine.prepare_load(handle.host_pages)
            gate.open()
            await handle.wait()
            engine.free_host(handle.host_pages)
            rig.assert_no_leaks(device_used={KV: 1})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_layerwise_backup_copies_each_layer_right_after_its_compute() -> None:
    streams = OrderedStreams()
    rig = Rig(hybrid_plan(), streams=streams)
    try:
        async with rig.engine as engine:
            a = rig.device_slots.allocate({KV: 2, MAMBA: 1}).pages
            b = rig.device_slots.allocate({KV: 1}).pages
            ha = engine.prepare_backup(a, layerwise=True)
            hb = engine.prepare_backup(b, layerwise=True)
            assert isinstance(ha, LayerwiseBackupHandle)
            assert isinstance(hb, LayerwiseBackupHandle)
            engine.submit()
            assert streams.log == []  # nothing copies before compute reports a layer
            for layer in range(rig.layers):
                # "compute" writes this layer on the device, then reports it (both handles do,
                # as a batched forward pass would; the second call is a no-op).
                for pool, ids in {**a, KV: [*a[KV], *b[KV]]}.items():
                    rig.transfer.fill_device(pool, ids, f"prefill{layer}")
                rig.transfer.fill_device(PoolName.INDEXER, [*a[KV], *b[KV]], f"prefill{layer}")
                ha.layer_computed(layer)
                hb.layer_computed(layer)
            await ha.wait()
            await hb.wait()
            calls = rig.transfer.calls_of("backup_layer")
            assert [c[1] for c in calls] == list(range(rig.layers))
            assert streams.log == ["after_compute:backup", "submit:backup"] * rig.layers
            assert rig.backed_up(a, ha.host_pages)
            assert rig.backed_up(b, hb.host_pages)
            assert engine.statistics().backups == 2
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_reporting_layers_after_a_layerwise_batch_ended_touches_nothing() -> None:
    rig = Rig()
    rig.transfer.fail("backup_layer", layer=0)
    try:
        async with rig.engine as engine:
            device = rig.device_slots.allocate({KV: 1}).pages
            failing = engine.prepare_backup(device, layerwise=True)
            engine.submit()
            assert isinstance(failing, LayerwiseBackupHandle)
            failing.layer_computed(0)
            with pytest.raises(Exception, match="failed at transfer layer 0"):
                await failing.wait()
            # Every operation of that batch has ended: its events may serve others now.
            other = await engine.load(rig.host_prefix("o", {KV: 1}))
            failing.layer_computed(1)  # a late report: ignored
            await other.wait()
            assert [c[1] for c in rig.transfer.calls_of("backup_layer")] == [0]
            assert other.state is OperationState.DONE
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_backup_and_load_wait_for_the_ordering_point_they_are_given() -> None:
    from hicache.adapters.streams.cpu import CpuFence

    rig = Rig()
    try:
        async with rig.engine as engine:
            device = rig.device_slots.allocate({KV: 1}).pages
            rig.transfer.fill_device(KV, device[KV], "before")
            fence = CpuFence()  # the forward pass signals it once compute wrote the pages
            handle = await engine.backup(device, after=fence)
            await anyio.sleep(0.05)
            assert rig.transfer.calls_of("backup") == []  # the copy waits for the fence...
            rig.transfer.fill_device(KV, device[KV], "computed")
            fence.signal()
            await handle.wait()  # ...so it reads what compute wrote
            assert rig.backed_up(device, handle.host_pages)
            fence2 = CpuFence()
            load = await engine.load(handle.host_pages, after=fence2)
            await anyio.sleep(0.05)
            assert rig.transfer.calls_of("load") == []
            fence2.signal()
            await load.wait()
            layerwise = engine.prepare_backup(device, handle.host_pages, layerwise=True)
            engine.submit()
            fences = [CpuFence() for _ in range(rig.layers)]
            for layer in range(rig.layers):
                layerwise.layer_computed(layer, after=fences[layer])
            await anyio.sleep(0.02)
            assert rig.transfer.calls_of("backup_layer") == []
            for f in fences:
                f.signal()
            await layerwise.wait()
            engine.free_device(load.device_pages)
    finally:
        rig.close_streams()
