"""The synchronous face, driven from plain threads like a synchronous scheduler's loop."""

from __future__ import annotations

import threading
import time

import pytest

from hicache.domain import EngineClosedError, PoolName, TransferError
from hicache.engine import OperationState
from hicache.engine.sync import SyncEngine, SyncLayerwiseBackupHandle, SyncLoadHandle, open_sync
from tests.engine.fakes import Rig, hybrid_plan

KV, MAMBA = PoolName.KV, PoolName.MAMBA


def _forward(rig: Rig, handle: SyncLoadHandle, host: object, errors: list[BaseException]) -> None:
    """The forward pass on its own thread: wait for each layer, then read it."""
    try:
        for layer in range(rig.layers):
            handle.wait_layer(layer)
            assert rig.layer_ok(layer, host, handle.device_pages)  # type: ignore[arg-type]
    except BaseException as e:
        errors.append(e)


def test_a_scheduler_loop_merges_shares_waits_per_layer_and_cancels_from_plain_threads() -> None:
    rig = Rig(hybrid_plan(), delay_s=0.001)
    try:
        with open_sync(rig.engine) as sync:
            for step in range(5):  # scheduling steps of a synchronous scheduler
                a = rig.host_prefix(f"a{step}", {KV: 2, MAMBA: 1})
                b = rig.host_prefix(f"b{step}", {KV: 1})
                la = sync.prepare_load(a)
                shared = sync.prepare_load(a)  # a second request with the same prefix
                lb = sync.prepare_load(b)
                gate = rig.transfer.gate("load", 0)  # no load can end before lb is cancelled
                sync.submit()
                assert shared.joined
                assert shared.device_pages == la.device_pages
                errors: list[BaseException] = []
                t = threading.Thread(target=_forward, args=(rig, la, a, errors))
                t.start()
                # A request aborted by the scheduler while its copy is held in flight: cancel()
                # returns once its pages are back, so it runs beside the gate's opening.
                canceller = threading.Thread(target=lb.cancel)
                canceller.start()
                deadline = time.monotonic() + 10
                while lb.state is not OperationState.CANCELLED and time.monotonic() < deadline:
                    time.sleep(1e-3)
                gate.open()
                canceller.join(10)
                assert not canceller.is_alive()
                t.join(10)
                assert not t.is_alive()
                assert errors == []
                la.wait()
                shared.wait()
                assert lb.state is OperationState.CANCELLED
                backup = sync.prepare_backup(la.device_pages, layerwise=True)
                sync.submit()
                assert isinstance(backup, SyncLayerwiseBackupHandle)
                for layer in range(rig.layers):
                    backup.layer_computed(layer)
                backup.wait_future().result(10)
                assert rig.backed_up(la.device_pages, backup.host_pages)
                sync.free_device(la.device_pages)
                for pages in (a, b, backup.host_pages):
                    sync.free_host(pages)
            stats = sync.statistics()
            assert stats.submissions >= 10
            assert stats.loads_joined == 5
            assert stats.loads_cancelled == 5
            rig.assert_no_leaks()
        assert sync.closed
        with pytest.raises(EngineClosedError):
            sync.submit()
    finally:
        rig.close_streams()


def test_future_calls_and_a_cancelled_wait_future_cancel_the_operation() -> None:
    rig = Rig()
    gate = rig.transfer.gate("load", 0)
    try:
        sync = SyncEngine(rig.engine)
        with sync:
            host = rig.host_prefix("f", {KV: 1})
            handle = sync.load_future(host).result(10)
            gate.entered.wait(5)
            future = handle.wait_future()
            assert future.cancel()  # the wait task is cancelled on the loop...
            deadline = time.monotonic() + 5
            while handle.state is not OperationState.CANCELLED and time.monotonic() < deadline:
                time.sleep(1e-3)
            gate.open()
            with pytest.raises(TransferError, match="cancelled"):
                handle.wait(10)  # ...and that cancelled the load (as an async wait does)
            rig.assert_no_leaks(host_used={KV: 1})
            device = rig.device_slots.allocate({KV: 1}).pages
            backup = sync.backup_future(device).result(10)
            backup.wait(10)
            assert rig.backed_up(device, backup.host_pages)
    finally:
        rig.close_streams()
