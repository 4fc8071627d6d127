"""End to end on the real CPU adapters: materialised host group, CPU device group, the real copy
backend, CPU streams and the engine, wired by the composition root (hicache.bootstrap.runtime).

The serving story: a request's pages are backed up, evicted from the device (poisoned), and a
later request loads them back layer by layer while "computing"; another load is cancelled in the
middle; the engine carries on.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from hicache.adapters.copy import backend_status
from hicache.bootstrap import load_model_spec
from hicache.bootstrap.runtime import open_runtime
from hicache.domain import (
    ConfigError,
    HostGroupPlan,
    PlanSettings,
    PoolName,
    plan_stack,
)
from hicache.engine import OperationState, TransferEngine
from tests.engine.device_bytes import layer_matches, poison, write_device
from tests.engine.fakes import GatedTransfer, hybrid_plan

KV, MAMBA = PoolName.KV, PoolName.MAMBA
BACKENDS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(not backend_status()[name][0], reason=backend_status()[name][1]),
    )
    for name in ("torch", "memcpy")
]


def _plans() -> list[HostGroupPlan]:
    llama = plan_stack(
        load_model_spec("llama-3.1-8b-instruct"),
        PlanSettings(tp_size=4, device_tokens=128, page_size=16),
    )
    return [hybrid_plan(pages=8, page_size=4, slots=4), llama]


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("plan", _plans(), ids=["kv+indexer+mamba", "llama-tp4"])
async def test_back_up_evict_and_load_back_layer_by_layer_while_computing(
    plan: HostGroupPlan, backend: str
) -> None:
    owners = {p.name: p for p in plan.independent_pools()}
    counts = {KV: 3, **({MAMBA: 1} if MAMBA in owners else {})}
    async with open_runtime(plan, device="cpu", backend=backend) as rt:
        engine = rt.engine
        # A request prefilled its pages on the device; back them up.
        device = rt.device_slots.allocate(counts).pages
        written = write_device(rt, device, seed=1)
        backup = await engine.backup(device)
        await backup.wait()
        host = backup.host_pages
        # Evicted from the device; the memory gets overwritten by others.
        engine.free_device(device)
        poison(rt)
        # A later request hits the prefix: load it back while the forward pass runs.
        x = torch.ones(32, 32)
        async with await engine.load(host) as handle:
            for layer in range(plan.transfer_layers):
                handle.wait_layer(layer)
                assert layer_matches(rt, layer, written, device, handle.device_pages), layer
                x = torch.tanh(x @ x)  # the layer's compute
        assert handle.state is OperationState.DONE
        stats = engine.statistics()
        assert stats.bytes_loaded == stats.bytes_backed_up > 0
        engine.free_device(handle.device_pages)
        engine.free_host(host)
        assert len(engine.host_pins) == len(engine.device_pins) == 0
        assert all(
            rt.host_slots.allocator(n).free_count() == rt.host_slots.allocator(n).pages
            for n in owners
        )
    assert rt.closed


@pytest.mark.asyncio
async def test_cancel_a_real_load_in_the_middle_and_carry_on() -> None:
    plan = hybrid_plan(pages=8, page_size=4, slots=4)
    async with open_runtime(plan, device="cpu", backend="torch") as rt:
        device = rt.device_slots.allocate({KV: 2, MAMBA: 1}).pages
        written = write_device(rt, device, seed=2)
        backup = await rt.engine.backup(device)
        await backup.wait()
        rt.engine.free_device(device)
        poison(rt)
        # A second engine over the same runtime, whose copy backend holds layer 2 in flight.
        gated = GatedTransfer(rt.transfer, "load", layer=2)
        engine = TransferEngine(
            plan=plan,
            transfer=gated,
            streams=rt.streams,
            host_slots=rt.host_slots,
            device_slots=rt.device_slots,
            name="gated",
        )
        async with engine:
            handle = await engine.load(backup.host_pages)
            handle.wait_layer(1)
            assert layer_matches(rt, 1, written, device, handle.device_pages)
            await anyio.to_thread.run_sync(gated.gate.entered.wait, 5)
            async with anyio.create_task_group() as tg:
                tg.start_soon(handle.cancel)
                await anyio.sleep(0.01)
                gated.gate.open()
            assert handle.state is OperationState.CANCELLED
            assert len(engine.device_pins) == 0
            assert rt.device_slots.allocator(KV).free_count() == rt.device_slots.allocator(KV).pages
            # Carry on: the same prefix loads completely.
            again = await engine.load(backup.host_pages)
            for layer in range(plan.transfer_layers):
                again.wait_layer(layer)
                assert layer_matches(rt, layer, written, device, again.device_pages)
            await again.wait()


@pytest.mark.asyncio
async def test_runtime_wraps_a_frameworks_tensors() -> None:
    plan = hybrid_plan(pages=4, page_size=4, slots=2)
    tensors = {
        p.name: {
            b.name: [
                torch.zeros((p.device_capacity or 0, *b.shape), dtype=torch.bfloat16)
                if b.dtype.value == "bf16"
                else torch.zeros((p.device_capacity or 0, *b.shape), dtype=torch.float32)
                for _ in range(p.layers)
            ]
            for b in p.geometry.buffers
        }
        for p in plan.pools
    }
    async with open_runtime(plan, device="cpu", device_tensors=tensors, backend="torch") as rt:
        host = rt.host_slots.allocate({KV: 1}).pages
        for t in rt.host.pool(KV).buffers.values():
            t.fill_(3)
        handle = await rt.engine.load(host)
        await handle.wait()
        page = handle.device_pages[KV][0]
        k_layer0 = tensors[KV]["k"][0]
        assert torch.all(k_layer0[page * 4 : (page + 1) * 4] == 3)


@pytest.mark.asyncio
async def test_runtime_closes_once_and_refuses_bad_settings() -> None:
    plan = hybrid_plan()
    rt = open_runtime(plan, device="cpu", backend="torch")
    async with rt:
        assert "open" in repr(rt)
    assert rt.closed
    await rt.aclose()
    assert "closed" in repr(rt)
    with pytest.raises(ConfigError, match="unknown copy backend 'nope'"):
        open_runtime(plan, device="cpu", backend="nope")
    with pytest.raises(ConfigError, match="give one or the other"):
        open_runtime(plan, device_tensors={}, device_capacities={})


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_merged_step_with_a_shared_load_on_the_real_backend(backend: str) -> None:
    plan = hybrid_plan(pages=8, page_size=4, slots=4)
    async with open_runtime(plan, device="cpu", backend=backend) as rt:
        engine = rt.engine
        a = rt.device_slots.allocate({KV: 2, MAMBA: 1}).pages
        b = rt.device_slots.allocate({KV: 3}).pages
        written = write_device(rt, {KV: (*a[KV], *b[KV]), MAMBA: a[MAMBA]}, seed=4)
        ba, bb = engine.prepare_backup(a), engine.prepare_backup(b)
        engine.submit()  # one backup call for both
        await ba.wait()
        await bb.wait()
        engine.free_device(a)
        engine.free_device(b)
        poison(rt)
        la = engine.prepare_load(ba.host_pages)
        lb = engine.prepare_load(bb.host_pages)
        shared = engine.prepare_load(ba.host_pages)  # joins la
        engine.submit()  # one copy call per layer, one page map per pool
        for layer in range(plan.transfer_layers):
            for handle, src in ((la, a), (lb, b), (shared, a)):
                handle.wait_layer(layer)
                assert layer_matches(rt, layer, written, src, handle.device_pages)
        for handle in (la, lb, shared):
            await handle.wait()
        assert shared.joined
        assert engine.statistics().submissions == 2
