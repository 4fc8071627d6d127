"""End to end on a GPU (marker gpu): pinned host pools, CUDA device pools, the GPU copy backend,
CUDA streams and events, and the engine. wait_layer(i) is a GPU-side wait: the reads that check
the bytes run on the compute stream after it."""

from __future__ import annotations

import pytest
import torch

from hicache.bootstrap.runtime import open_runtime
from hicache.domain import PoolName
from hicache.engine import OperationState
from tests.engine.device_bytes import layer_matches, poison, write_device
from tests.engine.fakes import hybrid_plan

KV, MAMBA = PoolName.KV, PoolName.MAMBA


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_back_up_and_load_back_on_a_gpu_while_computing() -> None:
    plan = hybrid_plan(pages=8, page_size=4, slots=4)
    async with open_runtime(plan, device="cuda") as rt:
        engine = rt.engine
        assert all(pool.pinned for pool in rt.host.pools.values())
        device = rt.device_slots.allocate({KV: 3, MAMBA: 1}).pages
        written = write_device(rt, device, seed=3)
        backup = await engine.backup(device)  # the backup stream waits for that compute
        await backup.wait()
        engine.free_device(device)
        poison(rt)
        x = torch.ones(256, 256, device="cuda")
        async with await engine.load(backup.host_pages) as handle:
            for layer in range(plan.transfer_layers):
                handle.wait_layer(layer)  # the compute stream waits, the CPU goes on
                x = torch.tanh(x @ x)
                assert layer_matches(rt, layer, written, device, handle.device_pages)
        assert handle.state is OperationState.DONE
        stats = handle.statistics()
        assert stats.copy_s > 0  # CUDA timing events
        engine.free_device(handle.device_pages)
        engine.free_host(backup.host_pages)
