"""Cancellation at every phase: nothing leaks, in-flight copies are waited for, the engine goes on.

Slow phases are made deterministic with the fake's gates: a copy call is held in flight until
the test opens its gate, so "cancel while layer k is being copied" is exact, not a race.
"""

from __future__ import annotations

import anyio
import pytest

from hicache.domain import PoolName, TransferError
from hicache.engine import OperationState
from tests.engine.fakes import InlineStreams, Rig, hybrid_plan

KV, MAMBA = PoolName.KV, PoolName.MAMBA


async def _entered(gate: object) -> None:
    await anyio.to_thread.run_sync(gate.entered.wait, 5)  # type: ignore[attr-defined]


async def _load_again_works(rig: Rig) -> None:
    """The engine is still usable: a fresh load lands byte-exact and is released."""
    host = rig.host_prefix("after", {KV: 1})
    handle = await rig.engine.load(host)
    for layer in range(rig.layers):
        handle.wait_layer(layer)
        assert rig.layer_ok(layer, host, handle.device_pages)
    await handle.wait()
    rig.engine.free_device(handle.device_pages)
    rig.engine.free_host(host)


@pytest.mark.asyncio
async def test_cancel_before_submit_returns_everything() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("q", {KV: 2})
            handle = engine.prepare_load(host)
            assert len(engine.host_pins) == 2
            await handle.cancel()
            await handle.cancel()  # idempotent
            assert handle.state is OperationState.CANCELLED
            rig.assert_no_leaks(host_used={KV: 2})
            engine.submit()
            assert rig.transfer.calls == []
            with pytest.raises(TransferError, match="cancelled"):
                handle.wait_layer(0)
            with pytest.raises(TransferError, match="cancelled"):
                await handle.wait()
            engine.free_host(host)
            await _load_again_works(rig)
            assert engine.statistics().loads_cancelled == 1
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_a_load_started_in_a_cancelled_scope_takes_nothing() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("c", {KV: 2})
            with anyio.CancelScope() as scope:
                scope.cancel()
                await engine.load(host)
            assert scope.cancelled_caught
            rig.assert_no_leaks(host_used={KV: 2})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_cancel_mid_layers_waits_for_the_copy_in_flight_and_stops_the_rest() -> None:
    rig = Rig(hybrid_plan())
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("m", {KV: 2, MAMBA: 1})
            gate = rig.transfer.gate("load", 2)
            handle = await engine.load(host)
            await _entered(gate)  # layers 0, 1 copied, layer 2 in flight
            cancelled = anyio.Event()

            async def cancel() -> None:
                await handle.cancel()
                cancelled.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel)
                await anyio.sleep(0.02)
                # Still waiting for the copy in flight: its pages must not be reused yet.
                assert not cancelled.is_set()
                assert len(engine.device_pins) == 3
                gate.open()
            assert handle.state is OperationState.CANCELLED
            assert [c[1] for c in rig.transfer.calls_of("load")] == [0, 1, 2]
            rig.assert_no_leaks(host_used={KV: 2, MAMBA: 1})
            await _load_again_works(rig)
    finally:
        rig.close_streams()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["wait", "wait_layer_ready"])
async def test_a_cancelled_wait_cancels_the_load(how: str) -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("w", {KV: 2})
            gate = rig.transfer.gate("load", 1)
            handle = await engine.load(host)
            await _entered(gate)
            scope = anyio.CancelScope()

            async def waiter() -> None:
                with scope:
                    if how == "wait":
                        await handle.wait()
                    else:
                        await handle.wait_layer_ready(3)

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.sleep(0.01)
                scope.cancel()
                await anyio.sleep(0.01)
                assert len(engine.host_pins) == 2  # shielded cleanup waits for layer 1
                gate.open()
            assert scope.cancelled_caught
            assert handle.state is OperationState.CANCELLED
            assert [c[1] for c in rig.transfer.calls_of("load")] == [0, 1]
            rig.assert_no_leaks(host_used={KV: 2})
            await _load_again_works(rig)
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_leaving_a_handle_block_with_an_error_cancels_and_reraises() -> None:
    rig = Rig(delay_s=0.002)
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("b", {KV: 1})
            handle = await engine.load(host)

            async def forward_pass_that_crashes() -> None:
                async with handle:
                    handle.wait_layer(0)
                    raise RuntimeError("forward pass crashed")

            with pytest.raises(RuntimeError, match="forward pass crashed"):
                await forward_pass_that_crashes()
            assert handle.state is OperationState.CANCELLED
            rig.assert_no_leaks(host_used={KV: 1})
            async with await engine.load(host) as ok:
                for layer in range(rig.layers):
                    ok.wait_layer(layer)
            assert ok.state is OperationState.DONE
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_cancel_during_backup_frees_the_host_pages_it_took() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            device = rig.device_slots.allocate({KV: 3}).pages
            rig.transfer.fill_device(KV, device[KV], "d")
            gate = rig.transfer.gate("backup")
            handle = await engine.backup(device)
            await _entered(gate)
            async with anyio.create_task_group() as tg:
                tg.start_soon(handle.cancel)
                await anyio.sleep(0.01)
                assert len(engine.device_pins) == 3
                gate.open()
            assert handle.state is OperationState.CANCELLED
            rig.assert_no_leaks(device_used={KV: 3})
            again = await engine.backup(device)
            await again.wait()
            assert rig.backed_up(device, again.host_pages)
            assert engine.statistics().backups_cancelled == 1
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_cancel_a_layerwise_backup_in_the_middle_of_prefill() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            device = rig.device_slots.allocate({KV: 2}).pages
            handle = engine.prepare_backup(device, layerwise=True)
            engine.submit()
            gate = rig.transfer.gate("backup_layer", 1)
            for layer in (0, 1):
                rig.transfer.fill_device(KV, device[KV], f"l{layer}")
                handle.layer_computed(layer)
            await _entered(gate)  # layer 0 copied, layer 1 in flight
            async with anyio.create_task_group() as tg:
                tg.start_soon(handle.cancel)
                await anyio.sleep(0.01)
                assert len(engine.host_pins) == 2
                gate.open()
            assert handle.state is OperationState.CANCELLED
            with pytest.raises(TransferError, match="cancelled"):
                handle.layer_computed(2)
            assert [c[1] for c in rig.transfer.calls_of("backup_layer")] == [0, 1]
            rig.assert_no_leaks(device_used={KV: 2})
            await _load_again_works(rig)
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_one_sharer_giving_up_leaves_the_shared_load_to_the_other() -> None:
    rig = Rig(delay_s=0.002)
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("s", {KV: 2})
            first = await engine.load(host)
            second = await engine.load(host)
            assert second.joined
            await first.cancel()
            assert first.state is OperationState.CANCELLED
            for layer in range(rig.layers):
                second.wait_layer(layer)
                assert rig.layer_ok(layer, host, second.device_pages)
            await second.wait()
            assert second.state is OperationState.DONE
            rig.assert_no_leaks(host_used={KV: 2}, device_used={KV: 2})
            # When every sharer gives up, the load stops.
            third = await engine.load(host)
            fourth = await engine.load(host)
            await third.cancel()
            await fourth.cancel()
            assert fourth.state is OperationState.CANCELLED
            rig.assert_no_leaks(host_used={KV: 2}, device_used={KV: 2})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_cancel_after_completion_changes_nothing() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("d", {KV: 1})
            handle = await engine.load(host)
            await handle.wait()
            await handle.cancel()
            assert handle.state is OperationState.DONE
            handle.wait_layer(0)
            rig.assert_no_leaks(host_used={KV: 1}, device_used={KV: 1})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_cancel_with_streams_that_issue_inside_submit() -> None:
    rig = Rig(streams=InlineStreams())
    async with rig.engine as engine:
        host = rig.host_prefix("i", {KV: 2})
        handle = await engine.load(host)
        await handle.cancel()
        assert handle.state is OperationState.CANCELLED
        rig.assert_no_leaks(host_used={KV: 2})
        await _load_again_works(rig)


@pytest.mark.asyncio
async def test_cancelling_one_load_of_a_merged_step_leaves_the_others() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            a = rig.host_prefix("a", {KV: 1})
            b = rig.host_prefix("b", {KV: 2})
            c = rig.host_prefix("c", {KV: 1})
            gate = rig.transfer.gate("load", 1)
            ha, hb, hc = (engine.prepare_load(x) for x in (a, b, c))
            engine.submit()
            await _entered(gate)
            async with anyio.create_task_group() as tg:
                tg.start_soon(hb.cancel)
                await anyio.sleep(0.01)
                gate.open()
            for handle, host in ((ha, a), (hc, c)):
                for layer in range(rig.layers):
                    handle.wait_layer(layer)
                    assert rig.layer_ok(layer, host, handle.device_pages)
                await handle.wait()
            assert hb.state is OperationState.CANCELLED
            # Layers 0 and 1 carried all three loads, layers 2 and 3 the two left.
            assert [c[2] for c in rig.transfer.calls_of("load")] == [
                (("kv", 4),),
                (("kv", 4),),
                (("kv", 2),),
                (("kv", 2),),
            ]
            rig.assert_no_leaks(host_used={KV: 4}, device_used={KV: 2})
    finally:
        rig.close_streams()
