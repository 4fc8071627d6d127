"""A hypothesis state machine of random loads, backups, frees and cancellations with faults.

The model owns page sets whose bytes it knows (host entries: tagged host pages; device entries:
device pages holding a known copy). After every step: no pins remain, the allocators' free
lists are exactly what the model does not own, and every page the model owns still holds its
bytes (a failed or cancelled transfer never wrote into pages it did not own).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from hicache.domain import OutOfSlotsError, PoolName, TransferError
from hicache.engine import OperationState
from tests.engine.fakes import Rig, hybrid_plan

KV, MAMBA, INDEXER = PoolName.KV, PoolName.MAMBA, PoolName.INDEXER
T = TypeVar("T")


@attrs.frozen
class HostEntry:
    pages: dict[PoolName, tuple[int, ...]]
    tag: str


@attrs.frozen
class DeviceEntry:
    pages: dict[PoolName, tuple[int, ...]]
    source: HostEntry  # the bytes it holds are this host entry's


class EngineMachine(RuleBasedStateMachine):
    host_entries = Bundle("host_entries")
    device_entries = Bundle("device_entries")

    def __init__(self) -> None:
        super().__init__()
        self.rig = Rig(hybrid_plan(pages=6, slots=3))
        self.tags = itertools.count()
        self.exit_stack = contextlib.ExitStack()
        self.portal = self.exit_stack.enter_context(anyio.from_thread.start_blocking_portal())
        self.exit_stack.enter_context(self.portal.wrap_async_context_manager(self.rig.engine))
        self.owned_host: list[HostEntry] = []
        self.owned_device: list[DeviceEntry] = []

    def gone(self) -> Gone:
        return Gone(next(self.tags))

    def run(self, fn: Callable[[], Awaitable[T]]) -> T:
        return self.portal.call(fn)

    def teardown(self) -> None:
        try:
            self.exit_stack.close()
        finally:
            self.rig.close_streams()

    # -- helpers ------------------------------------------------------------------------------
    def _expect_host(self, entry: HostEntry) -> bool:
        t = self.rig.transfer
        for pool in self.rig.plan.pools:
            owner = KV if pool.name is INDEXER else pool.name
            for layer in range(pool.layers):
                for page in entry.pages.get(owner, ()):
                    want = f"{entry.tag}/{pool.name.value}/{layer}/{page}".encode()
                    if t.host[pool.name][layer][page] != want:
                        return False
        return True

    def _expect_device(self, entry: DeviceEntry) -> bool:
        t = self.rig.transfer
        src = entry.source
        for pool in self.rig.plan.pools:
            owner = KV if pool.name is INDEXER else pool.name
            for layer in range(pool.layers):
                for h, d in zip(src.pages.get(owner, ()), entry.pages.get(owner, ()), strict=True):
                    want = f"{src.tag}/{pool.name.value}/{layer}/{h}".encode()
                    if t.device[pool.name][layer][d] != want:
                        return False
        return True

    # -- rules --------------------------------------------------------------------------------
    @rule(target=host_entries, kv=st.integers(0, 3), state=st.integers(0, 1))
    def make_host(self, kv: int, state: int) -> Any:
        counts = {p: n for p, n in ((KV, kv), (MAMBA, state)) if n}
        if not counts:
            counts = {KV: 1}
        try:
            pages = self.rig.host_slots.allocate(counts).pages
        except OutOfSlotsError:
            return self.gone()
        tag = f"h{next(self.tags)}"
        for pool, ids in pages.items():
            self.rig.transfer.fill_host(pool, ids, tag)
            if pool is KV:
                self.rig.transfer.fill_host(INDEXER, ids, tag)
        entry = HostEntry(dict(pages), tag)
        self.owned_host.append(entry)
        return entry

    @rule(
        target=device_entries,
        entry=host_entries,
        fault=st.one_of(st.none(), st.integers(0, 5)),
        cancel=st.one_of(st.none(), st.integers(-1, 5)),
    )
    def load(self, entry: HostEntry | Gone, fault: int | None, cancel: int | None) -> Any:
        if entry not in self.owned_host:
            return self.gone()
        if fault is not None:
            self.rig.transfer.fail("load", layer=fault)

        async def go() -> DeviceEntry | None:
            engine = self.rig.engine
            try:
                handle = engine.prepare_load(entry.pages)
            except OutOfSlotsError:
                return None
            if cancel == -1:  # before submit
                await handle.cancel()
                assert handle.state is OperationState.CANCELLED
                return None
            engine.submit()
            try:
                if cancel is not None:
                    await handle.wait_layer_ready(cancel)
                    await handle.cancel()
                    if handle.state is OperationState.CANCELLED:
                        return None
                    # It had finished before the cancel: nothing changed, the pages are ours.
                    assert handle.state is OperationState.DONE
                for layer in range(self.rig.layers):
                    handle.wait_layer(layer)
                    assert self.rig.layer_ok(layer, entry.pages, handle.device_pages)
                await handle.wait()
            except TransferError:
                assert fault is not None
                with contextlib.suppress(TransferError):
                    await handle.wait()
                assert handle.state is OperationState.FAILED
                return None
            # A fault at a layer this load has no pool for never fires: both outcomes are fine.
            return DeviceEntry(handle.device_pages, entry)

        try:
            result = self.run(go)
        finally:
            self.rig.transfer.clear_faults()
        if result is None:
            return self.gone()
        self.owned_device.append(result)
        return result

    @rule(target=host_entries, entry=device_entries, fault=st.booleans(), cancel=st.booleans())
    def backup(self, entry: DeviceEntry | Gone, fault: bool, cancel: bool) -> Any:
        if entry not in self.owned_device:
            return self.gone()
        if fault:
            self.rig.transfer.fail("backup")

        async def go() -> HostEntry | None:
            try:
                handle = await self.rig.engine.backup(entry.pages)
            except OutOfSlotsError:
                return None
            if cancel:
                await handle.cancel()
                if handle.state is OperationState.CANCELLED:
                    return None
            try:
                await handle.wait()
            except TransferError:
                assert fault
                return None
            return HostEntry(handle.host_pages, entry.source.tag)

        try:
            result = self.run(go)
        finally:
            self.rig.transfer.clear_faults()
        if result is None:
            return self.gone()
        # The new host pages hold the source's bytes under the source's page numbers' tags;
        # re-tag them as a fresh entry whose bytes are checked against the device copy.
        fresh = HostEntry(result.pages, f"h{next(self.tags)}")
        src = entry.source
        t = self.rig.transfer
        for pool in self.rig.plan.pools:
            owner = KV if pool.name is INDEXER else pool.name
            for layer in range(pool.layers):
                for h_old, h_new in zip(
                    src.pages.get(owner, ()), fresh.pages.get(owner, ()), strict=True
                ):
                    assert t.host[pool.name][layer][h_new] == (
                        f"{src.tag}/{pool.name.value}/{layer}/{h_old}".encode()
                    )
                    t.host[pool.name][layer][h_new] = (
                        f"{fresh.tag}/{pool.name.value}/{layer}/{h_new}".encode()
                    )
        self.owned_host.append(fresh)
        return fresh

    @rule(entry=host_entries)
    def shared_load(self, entry: HostEntry | Gone) -> None:
        if entry not in self.owned_host:
            return
        before = len(self.rig.transfer.calls_of("load"))

        async def go() -> None:
            results = []

            async def one() -> None:
                try:
                    handle = await self.rig.engine.load(entry.pages)
                except OutOfSlotsError:
                    return
                await handle.wait()
                results.append(handle)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one)
                tg.start_soon(one)
            if len(results) == 2:
                assert results[0].device_pages == results[1].device_pages
                # One copy call per transfer layer that any of the entry's pools has.
                layers = {
                    t
                    for p in self.rig.plan.pools
                    if (KV if p.name is INDEXER else p.name) in entry.pages
                    for t in p.binding.transfer_layers
                }
                assert len(self.rig.transfer.calls_of("load")) - before == len(layers)
            if results:
                self.rig.engine.free_device(results[0].device_pages)

        self.run(go)

    @rule(entry=consumes(host_entries))
    def free_host(self, entry: HostEntry | Gone) -> None:
        if entry not in self.owned_host:
            return
        self.owned_host.remove(entry)

        async def go() -> None:
            self.rig.engine.free_host(entry.pages)

        self.run(go)

    @rule(entry=consumes(device_entries))
    def free_device(self, entry: DeviceEntry | Gone) -> None:
        if entry not in self.owned_device:
            return
        self.owned_device.remove(entry)

        async def go() -> None:
            self.rig.engine.free_device(entry.pages)

        self.run(go)

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def nothing_pinned_and_free_lists_whole(self) -> None:
        engine = self.rig.engine
        assert len(engine.host_pins) == 0
        assert len(engine.device_pins) == 0
        for slots, owned in (
            (self.rig.host_slots, self.owned_host),
            (self.rig.device_slots, self.owned_device),
        ):
            for pool, free in slots.free_counts().items():
                used = sum(len(e.pages.get(pool, ())) for e in owned)
                assert slots.allocator(pool).pages - free == used, (pool, free, used)

    @invariant()
    def owned_bytes_intact(self) -> None:
        for h in self.owned_host:
            assert self._expect_host(h), h
        for d in self.owned_device:
            # A device copy stays valid only while its source is unchanged; sources are never
            # rewritten in this model (freed host pages are re-tagged on reuse, so skip those).
            if d.source in self.owned_host:
                assert self._expect_device(d), d


@attrs.frozen
class Gone:
    """What a rule returns when its outcome left nothing to own (failed, cancelled, no room).

    Outcomes depend on thread timing; returning exactly one value per rule keeps the bundles'
    shapes, and so hypothesis's draws, independent of it. Rules skip entries they do not own.
    """

    n: int


EngineMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("HICACHE_STATEFUL_EXAMPLES", "30")),  # more: set it
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineStateMachine = EngineMachine.TestCase
