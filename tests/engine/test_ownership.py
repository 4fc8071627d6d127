"""Device page ownership, chosen when the runtime opens: the engine's allocator or the framework's."""

from __future__ import annotations

import pytest

from hicache.bootstrap.runtime import open_runtime
from hicache.domain import ConfigError, PoolName, SlotError
from hicache.engine import TransferEngine
from tests.engine.fakes import Rig, dense_plan

KV = PoolName.KV


def _framework_rig() -> Rig:
    rig = Rig()
    rig.engine = TransferEngine(
        plan=rig.plan,
        transfer=rig.transfer,
        streams=rig.streams,
        host_slots=rig.host_slots,
        device_slots=rig.device_slots,
        device_ownership="framework",
    )
    return rig


@pytest.mark.asyncio
async def test_framework_owned_device_pages_back_up_and_load_without_the_engine_allocator() -> None:
    rig = _framework_rig()
    try:
        async with rig.engine as engine:
            assert engine.device_ownership == "framework"
            # Page 3 was never allocated from the engine's allocator: the framework owns it.
            rig.transfer.fill_device(KV, [3], "fw")
            backup = await engine.backup({KV: [3]})
            await backup.wait()
            assert rig.backed_up({KV: [3]}, backup.host_pages)
            # Pins still protect the pages while in flight, and the allocator never moved.
            rig.transfer.poison_device(KV, [5])
            load = await engine.load(backup.host_pages, {KV: [5]})
            await load.wait()
            assert all(rig.layer_ok(t, backup.host_pages, {KV: [5]}) for t in range(rig.layers))
            assert rig.device_slots.free_counts()[KV] == rig.device_slots.allocator(KV).pages
            with pytest.raises(ConfigError, match="pass the device pages"):
                engine.prepare_load(backup.host_pages)
            with pytest.raises(ConfigError, match="framework's allocator frees them"):
                engine.free_device({KV: [5]})
            engine.free_host(backup.host_pages)
            rig.assert_no_leaks()
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_engine_owned_device_pages_still_refuse_free_pages_and_allocate_for_loads() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            assert engine.device_ownership == "engine"
            with pytest.raises(SlotError, match="page 3 of pool 'kv' is free"):
                engine.prepare_backup({KV: [3]})
            load = await engine.load(rig.host_prefix("e", {KV: 1}))
            await load.wait()
            engine.free_device(load.device_pages)
    finally:
        rig.close_streams()


def test_an_unknown_device_ownership_is_refused() -> None:
    rig = Rig()
    try:
        with pytest.raises(ConfigError, match="device_ownership must be one of"):
            TransferEngine(
                plan=rig.plan,
                transfer=rig.transfer,
                streams=rig.streams,
                host_slots=rig.host_slots,
                device_slots=rig.device_slots,
                device_ownership="nobody",
            )
    finally:
        rig.close_streams()


@pytest.mark.asyncio
@pytest.mark.parametrize("ownership", ["engine", "framework"])
async def test_open_runtime_chooses_who_owns_device_pages(ownership: str) -> None:
    async with open_runtime(dense_plan(), device="cpu", device_ownership=ownership) as rt:
        engine = rt.engine
        assert engine.device_ownership == ownership
        host = rt.host_slots.allocate({KV: 1}).pages
        # With "framework", page 2 is the framework's: the engine's allocator never saw it.
        device = rt.device_slots.allocate({KV: 1}).pages if ownership == "engine" else {KV: (2,)}
        backup = await engine.backup(device, host)
        await backup.wait()
        load = await engine.load(host, device)
        await load.wait()
