"""Races between the event loop and forward-pass threads, found with stress, not luck.

- A submission the streams refuse: ``load()`` / ``backup()`` roll their operation back.
- ``wait_layer`` from threads while the loop finishes, cancels and reuses event sets: a waiter
  must never end up waiting on another submission's work (that is how it hung).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import anyio
import pytest

from hicache.domain import PoolName, TransferError
from hicache.engine import LoadHandle, OperationState
from tests.engine.fakes import Gate, InjectedFault, NoEventStreams, Rig, dense_plan

KV = PoolName.KV
ROUNDS = 150  # today's code without the fix: about 1 round in 15 leaves a waiter stuck


@pytest.mark.asyncio
async def test_a_load_whose_submission_is_refused_is_rolled_back_before_the_error() -> None:
    streams = NoEventStreams()
    rig = Rig(streams=streams)
    try:
        async with rig.engine as engine:
            kept = engine.prepare_load(rig.host_prefix("k", {KV: 1}))
            host = rig.host_prefix("r", {KV: 2})
            streams.fail_next = True
            with pytest.raises(TransferError, match="rolled back") as info:
                await engine.load(host)
            assert isinstance(info.value.__cause__, InjectedFault)
            # The refused load holds nothing: only the prepared one keeps its pins and pages.
            assert engine.statistics().queued == 1
            assert len(engine.host_pins) == 1
            assert kept.state is OperationState.QUEUED
            await kept.cancel()
            rig.assert_no_leaks(host_used={KV: 3})
            # The next submission does not run the rolled-back load behind anyone's back.
            engine.submit()
            assert rig.transfer.calls == []
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_a_backup_whose_submission_is_refused_is_rolled_back_before_the_error() -> None:
    streams = NoEventStreams()
    rig = Rig(streams=streams)
    try:
        async with rig.engine as engine:
            device = rig.device_slots.allocate({KV: 2}).pages
            streams.fail_next = True
            with pytest.raises(TransferError, match="rolled back"):
                await engine.backup(device)
            rig.assert_no_leaks(device_used={KV: 2})
            engine.submit()
            assert rig.transfer.calls == []
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_a_refused_load_that_joined_another_leaves_the_first_one_whole() -> None:
    streams = NoEventStreams()
    rig = Rig(streams=streams)
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("j", {KV: 1})
            first = engine.prepare_load(host)
            streams.fail_next = True
            with pytest.raises(TransferError, match="rolled back"):
                await engine.load(host)  # joins ``first``, then the submission fails
            assert first.state is OperationState.QUEUED
            engine.submit()
            await first.wait()
            assert rig.layer_ok(0, host, first.device_pages)
            engine.free_device(first.device_pages)
            rig.assert_no_leaks(host_used={KV: 1})
    finally:
        rig.close_streams()


class _Waiters:
    """Threads that call ``wait_layer`` on the current handle in a tight loop."""

    def __init__(self, count: int, layer: int) -> None:
        self.layer = layer
        self.handle: LoadHandle | None = None
        self.generation = 0
        self.seen = [0] * count
        self.stop = False
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)
        ]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        while not self.stop:
            gen = self.generation
            handle = self.handle
            if handle is None:
                self.seen[i] = gen
                time.sleep(0)
                continue
            with contextlib.suppress(TransferError):
                handle.wait_layer(self.layer)

    def idle(self) -> bool:
        return all(s == self.generation for s in self.seen)


@pytest.mark.asyncio
async def test_wait_layer_never_waits_on_a_reused_event_while_the_loop_cancels() -> None:
    layers = 4
    rig = Rig(dense_plan(layers), event_sets=1)  # one set per size: reused at once
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: widen every window
    waiters = _Waiters(4, layers - 1)
    stuck = 0
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("s", {KV: 1})
            dev = rig.device_slots.allocate({KV: 1}).pages
            for i in range(ROUNDS):
                handle = await engine.load(host)
                waiters.handle = handle
                await anyio.sleep(0)
                if i % 2:
                    await handle.cancel()
                else:
                    await handle.wait()
                if handle.state is OperationState.DONE:  # done before the cancel came
                    engine.free_device(handle.device_pages)
                engine.statistics()
                # The load's batch finished and gave its events back: a layer-wise backup takes
                # them, and its last layer is held in flight at a gate.
                gate: Gate = rig.transfer.gate("backup_layer", layers - 1)
                backup = engine.prepare_backup(dev, layerwise=True)
                engine.submit()
                backup.layer_computed(layers - 1)
                waiters.handle = None
                waiters.generation += 1
                deadline = time.perf_counter() + 5.0
                while not waiters.idle() and time.perf_counter() < deadline:
                    await anyio.sleep(1e-3)
                if not waiters.idle():
                    stuck += 1  # a waiter waits on the backup's work, not on its own load
                gate.open()
                for layer in range(layers - 1):
                    backup.layer_computed(layer)
                await backup.wait()
                engine.free_host(backup.host_pages)
            assert stuck == 0, f"{stuck} of {ROUNDS} rounds left a waiter on another batch's event"
            rig.assert_no_leaks(host_used={KV: 1}, device_used={KV: 1})
    finally:
        sys.setswitchinterval(old)
        waiters.stop = True
        waiters.handle = None
        for t in waiters.threads:
            t.join(5)
        rig.close_streams()
