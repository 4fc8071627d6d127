"""Loads: layer order, poisoned-device checks, sidecars and state layers, merging, sharing."""

from __future__ import annotations

import anyio
import pytest

from hicache.domain import (
    ConfigError,
    ForeignIndexError,
    OutOfSlotsError,
    PoolName,
    SlotError,
    TransferError,
)
from hicache.domain.pins import PinnedPageError
from hicache.engine import LoadHandle, OperationState
from tests.engine.fakes import InlineStreams, Rig, dense_plan, hybrid_plan

KV, MAMBA, INDEXER = PoolName.KV, PoolName.MAMBA, PoolName.INDEXER


@pytest.mark.asyncio
@pytest.mark.parametrize("plan", [dense_plan(6), hybrid_plan()], ids=["dense", "hybrid"])
async def test_forward_pass_never_reads_a_layer_before_its_copy(plan: object) -> None:
    rig = Rig(plan, delay_s=0.003)  # type: ignore[arg-type]
    counts = {KV: 3} if len(rig.owners()) == 1 else {KV: 3, MAMBA: 2}
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("p", counts)
            # The fake device starts poisoned, so a layer read before its copy landed shows it.
            # (Poisoning after load() returned would race the copies, which may already have
            # begun: the engine hands the GIL to the copy worker after layer 0's submission.)
            handle = await engine.load(host)
            seen = []
            for layer in range(rig.layers):
                handle.wait_layer(layer)
                # What the forward pass reads right after waiting: must be the host bytes.
                seen.append(rig.layer_ok(layer, host, handle.device_pages))
            assert seen == [True] * rig.layers
            await handle.wait()
            assert handle.state is OperationState.DONE
            # Every transfer layer had its own event, state-only layers included.
            assert [c[1] for c in rig.transfer.calls_of("load")] == list(range(rig.layers))
            used = dict(counts)
            rig.assert_no_leaks(host_used=used, device_used=used)
            engine.free_device(handle.device_pages)
            engine.free_host(host)
            rig.assert_no_leaks()
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_sidecars_follow_the_anchor_and_state_layers_carry_only_state() -> None:
    rig = Rig(hybrid_plan())
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("s", {KV: 2, MAMBA: 1})
            handle = await engine.load(host)
            await handle.wait()
            by_layer = {c[1]: dict(c[2]) for c in rig.transfer.calls_of("load")}
            assert by_layer[0] == {"kv": 2, "indexer": 2}
            assert by_layer[1] == {"mamba": 1}
            assert by_layer[3] == {"kv": 2, "indexer": 2}
            for layer in range(rig.layers):
                assert rig.layer_ok(layer, host, handle.device_pages)
            assert set(handle.device_pages) == {KV, MAMBA}
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_a_layer_where_the_load_has_no_pool_still_has_an_event() -> None:
    rig = Rig(hybrid_plan())
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("m", {MAMBA: 1})  # state only: nothing on layers 0 and 3
            handle = await engine.load(host)
            for layer in range(rig.layers):
                handle.wait_layer(layer)
            await handle.wait()
            assert [c[1] for c in rig.transfer.calls_of("load")] == [1, 2, 4, 5]
            assert handle.statistics().layers == 4
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_async_waits_per_layer_and_statistics() -> None:
    rig = Rig(delay_s=0.002)
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("w", {KV: 2})
            handle = await engine.load(host)
            for layer in range(rig.layers):
                await handle.wait_layer_ready(layer)
                assert rig.layer_ok(layer, host, handle.device_pages)
            await handle.wait()
            stats = handle.statistics()
            assert stats.state is OperationState.DONE
            assert (
                stats.bytes
                == sum(rig.transfer.layer_bytes(t, []) for t in range(rig.layers))
                + rig.layers * 2 * 4 * 32
            )  # 2 pages x 4 tokens x 32 B per token per layer
            assert stats.copy_s > 0
            assert stats.waits == rig.layers + 1
            assert stats.gbps > 0
            total = engine.statistics()
            assert total.loads == 1
            assert total.bytes_loaded == stats.bytes
            assert total.load_gbps > 0
            assert total.exposed_wait_s > 0
            assert total.in_flight == 0
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_load_into_pages_the_caller_owns() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("c", {KV: 2})
            mine = rig.device_slots.allocate({KV: 2}).pages
            handle = await engine.load(host, mine)
            await handle.wait()
            assert handle.device_pages == dict(mine)
            for layer in range(rig.layers):
                assert rig.layer_ok(layer, host, mine)
            # Pins are gone, pages stay the caller's.
            rig.assert_no_leaks(host_used={KV: 2}, device_used={KV: 2})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_one_step_is_one_submission_with_one_copy_call_per_layer() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            a = rig.host_prefix("a", {KV: 1})
            b = rig.host_prefix("b", {KV: 2})
            ha = engine.prepare_load(a)
            hb = engine.prepare_load(b)
            assert ha.state is OperationState.QUEUED
            assert engine.statistics().queued == 2
            engine.submit()
            await ha.wait()
            await hb.wait()
            calls = rig.transfer.calls_of("load")
            assert len(calls) == rig.layers
            assert all(c[2] == (("kv", 3),) for c in calls)  # one map per pool, both loads
            assert engine.statistics().submissions == 1
            for layer in range(rig.layers):
                assert rig.layer_ok(layer, a, ha.device_pages)
                assert rig.layer_ok(layer, b, hb.device_pages)
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_concurrent_loads_of_one_prefix_issue_one_transfer() -> None:
    rig = Rig(delay_s=0.002)
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("shared", {KV: 3})
            handles: list[LoadHandle] = []

            async def request() -> None:
                handle = await engine.load(host)
                handles.append(handle)
                for layer in range(rig.layers):
                    await handle.wait_layer_ready(layer)
                    assert rig.layer_ok(layer, host, handle.device_pages)
                await handle.wait()

            async with anyio.create_task_group() as tg:
                tg.start_soon(request)
                tg.start_soon(request)
            first, second = handles
            assert not first.joined
            assert second.joined
            assert first.id == second.id
            assert first.device_pages == second.device_pages
            assert len(rig.transfer.calls_of("load")) == rig.layers
            assert rig.transfer.pages_copied == 3 * rig.layers
            stats = engine.statistics()
            assert stats.loads == 1
            assert stats.loads_joined == 1
            # One allocation, shared: freed once.
            rig.assert_no_leaks(host_used={KV: 3}, device_used={KV: 3})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_a_load_after_the_first_finished_is_a_new_transfer() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("x", {KV: 1})
            first = await engine.load(host)
            await first.wait()
            second = await engine.load(host)
            await second.wait()
            assert not second.joined
            assert first.device_pages != second.device_pages
            assert len(rig.transfer.calls_of("load")) == 2 * rig.layers
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_event_sets_are_reused_only_after_they_completed() -> None:
    rig = Rig(event_sets=3)
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("e", {KV: 1})
            for _ in range(6):
                handle = await engine.load(host)
                await handle.wait()
                engine.free_device(handle.device_pages)
            stats = engine.statistics()
            assert stats.event_sets_created == 1
            assert stats.event_sets_reused == 5
            # While one submission is held in flight, the next needs a set of its own.
            gate = rig.transfer.gate("load", 0)
            held = await engine.load(host)
            await anyio.to_thread.run_sync(gate.entered.wait, 5)
            other = rig.host_prefix("f", {KV: 1})
            second = await engine.load(other)
            assert engine.statistics().event_sets_created == 2
            gate.open()
            await held.wait()
            await second.wait()
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_engine_works_with_streams_that_issue_inside_submit() -> None:
    streams = InlineStreams()
    rig = Rig(hybrid_plan(), streams=streams)
    async with rig.engine as engine:
        host = rig.host_prefix("i", {KV: 2, MAMBA: 1})
        handle = await engine.load(host)
        for layer in range(rig.layers):
            handle.wait_layer(layer)
            assert rig.layer_ok(layer, host, handle.device_pages)
        await handle.wait()
        back = await engine.backup(handle.device_pages)
        await back.wait()
        # Both copy streams waited for compute before touching device pages.
        assert [d.value for d in streams.after_compute_calls] == ["load", "backup"]
        assert rig.backed_up(handle.device_pages, back.host_pages)


# -- input checks: typed errors, nothing taken ---------------------------------------------


@pytest.mark.asyncio
async def test_bad_load_requests_raise_typed_errors_and_take_nothing() -> None:
    rig = Rig(hybrid_plan())
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("v", {KV: 2})
            with pytest.raises(ConfigError, match="'indexer' is a sidecar"):
                engine.prepare_load({INDEXER: host[KV]})
            with pytest.raises(ConfigError, match="'swa' is not in this group"):
                engine.prepare_load({PoolName.SWA: [0]})
            with pytest.raises(ConfigError, match="unknown pool name 'nope'"):
                engine.prepare_load({"nope": [0]})
            with pytest.raises(ForeignIndexError, match="host page 99"):
                engine.prepare_load({KV: [99]})
            with pytest.raises(SlotError, match="host page 5 of pool 'kv' is free"):
                engine.prepare_load({KV: [5]})
            with pytest.raises(ConfigError, match="listed twice"):
                engine.prepare_load({KV: [host[KV][0], host[KV][0]]})
            with pytest.raises(ConfigError, match="no host pages"):
                engine.prepare_load({KV: []})
            with pytest.raises(ConfigError, match="paired with"):
                engine.prepare_load(host, rig.device_slots.allocate({KV: 1}).pages)
            with pytest.raises(ConfigError, match="must be a sequence of ints"):
                engine.prepare_load({KV: "01"})  # type: ignore[dict-item]
            rig.assert_no_leaks(host_used={KV: 2}, device_used={KV: 1})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_out_of_device_slots_takes_nothing_and_writing_pinned_pages_is_refused() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("o", {KV: 8})
            gate = rig.transfer.gate("load", 0)
            handle = await engine.load({KV: host[KV][:4]})
            with pytest.raises(OutOfSlotsError, match="4 free pages, 5 were asked"):
                engine.prepare_load({KV: host[KV][3:]})
            with pytest.raises(PinnedPageError, match="in-flight transfer"):
                engine.prepare_load({KV: host[KV][4:6]}, {KV: handle.device_pages[KV][:2]})
            with pytest.raises(PinnedPageError):
                engine.free_host({KV: host[KV][:1]})
            with pytest.raises(PinnedPageError):
                engine.free_device(handle.device_pages)
            with pytest.raises(PinnedPageError, match="cannot back up"):
                engine.prepare_backup(handle.device_pages)
            gate.open()
            await handle.wait()
            rig.assert_no_leaks(host_used={KV: 8}, device_used={KV: 4})
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_wait_layer_rejects_bad_layers_and_unsubmitted_loads() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("l", {KV: 1})
            handle = engine.prepare_load(host)
            with pytest.raises(TransferError, match="not submitted"):
                handle.wait_layer(0)
            # An async wait submits the pending step itself.
            await handle.wait_layer_ready(0)
            with pytest.raises(ConfigError, match="layer 4 is out of range"):
                handle.wait_layer(4)
            with pytest.raises(ConfigError, match="layer -1 is out of range"):
                await handle.wait_layer_ready(-1)
            await handle.wait()
    finally:
        rig.close_streams()


@pytest.mark.asyncio
async def test_repr_shows_live_state() -> None:
    rig = Rig()
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("r", {KV: 2})
            gate = rig.transfer.gate("load", 1)
            handle = await engine.load(host)
            await anyio.to_thread.run_sync(gate.entered.wait, 5)
            assert "1 in flight" in repr(engine)
            assert "2 host / 2 device pages pinned" in repr(engine)
            assert repr(handle).startswith("<LoadHandle #1: running, 2 pages")
            gate.open()
            await handle.wait()
            assert "done" in repr(handle)
            assert "0 in flight" in repr(engine)
    finally:
        rig.close_streams()
