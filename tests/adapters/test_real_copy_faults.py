"""Copy failures injected into a real runtime (CPU device, real copy backend, shm host memory).

The fakes of tests/engine/test_faults.py show the engine's bookkeeping; here the same promise is
checked on the real adapters: a copy that raises fails its operation with a TransferError, the
host slots the backup took are back, no pin is left, and the engine serves the next backup and
load, whose bytes are exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from hicache.bootstrap import load_model_spec
from hicache.bootstrap.runtime import open_runtime
from hicache.domain import PlanSettings, PoolName, TransferError, plan_stack

pytestmark = pytest.mark.timeout(120)
KV = PoolName.KV


class CopyFault(OSError):
    """What a failing copy raises (an OS error from the native helper, say)."""


@pytest.mark.asyncio
@pytest.mark.parametrize("op", ["backup", "load_layer"])
async def test_an_injected_copy_failure_fails_the_op_and_leaks_nothing(op: str) -> None:
    plan = plan_stack(
        load_model_spec("llama-3.1-8b-instruct"),
        PlanSettings(device_tokens=256, page_size=64, storage="shm", pinned="off"),
    )
    async with open_runtime(plan, device="cpu", name="faulty") as rt:
        engine = rt.engine
        free_host = rt.host_slots.free_counts()
        pages = rt.device_slots.allocate({KV: 2})
        for tensors in rt.device.pool(KV).buffers.values():
            for layer, t in enumerate(tensors):
                t.view(torch.uint8).fill_(layer + 1)
        real = getattr(rt.transfer, op)
        armed = [True]

        def failing(*args: Any) -> Any:
            layer_or_maps: Sequence[Any] | int = args[0]
            if armed[0] and (op == "backup" or layer_or_maps == 5):
                armed[0] = False
                raise CopyFault("injected copy failure")
            return real(*args)

        setattr(rt.transfer, op, failing)
        if op == "backup":
            handle = await engine.backup(pages.pages)
            with pytest.raises(TransferError, match="injected copy failure"):
                await handle.wait()
            assert rt.host_slots.free_counts() == free_host  # the backup's host pages are back
        backup = await engine.backup(pages.pages)
        await backup.wait()
        engine.free_device(pages.pages)
        for tensors in rt.device.pool(KV).buffers.values():
            for t in tensors:
                t.zero_()  # poison: only a real load brings the bytes back
        load = await engine.load(backup.host_pages)
        if op == "load_layer":
            with pytest.raises(TransferError, match="injected copy failure"):
                await load.wait()
            load = await engine.load(backup.host_pages)
        await load.wait()
        for tensors in rt.device.pool(KV).buffers.values():
            for layer, t in enumerate(tensors):
                tokens = [p * 64 + i for p in load.device_pages[KV] for i in range(64)]
                rows = t.view(torch.uint8)[tokens]
                assert bool((rows == layer + 1).all())
        engine.free_device(load.device_pages)
        engine.free_host(backup.host_pages)
        assert rt.host_slots.free_counts() == free_host
        assert len(engine.host_pins) == 0
        assert len(engine.device_pins) == 0
        stats = engine.statistics()
        assert (stats.backups_failed, stats.loads_failed) == ((1, 0) if op == "backup" else (0, 1))
