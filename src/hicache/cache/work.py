"""Performing what the prefix index asks: frees, device -> host backups, host -> storage writes.

- Counters: the face's mutable counters (one owner: the event loop).
- pool_counts(wants) / split_ids(counts, ids, wants): pages per pool over per-page pool lists;
  allocated ids handed out to the pages in order.
- CacheWork: frees page ids (host ids held back while the store says buffers are unsafe),
  allocates host and device pages (evicting from the index when full), starts backups and
  storage writes and settles them (``wait=False``: in the face's task group), always feeding
  the index a completion or an abort so that nothing stays pinned or reserved.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc

from hicache.cache.storage import CacheStorage
from hicache.domain.errors import CacheStateError, OutOfSlotsError, TransferError
from hicache.domain.pools import PoolName
from hicache.domain.prefix_index import PrefixIndex
from hicache.domain.tiers import Actions, Freed, PageOp, Placement, Ticket, Tier
from hicache.engine.engine import TransferEngine
from hicache.engine.logs import get_logger

log = get_logger("hicache.cache")

PageIds = dict[PoolName, list[int]]


class Counters:
    """Mutable counters of the face (read by ``HiCache.statistics``)."""

    def __init__(self) -> None:
        self.c: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        self.c[name] = self.c.get(name, 0) + n

    def __getitem__(self, name: str) -> int:
        return self.c.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        """A copy taken in one step: safe from another thread while the loop adds counters."""
        return dict(self.c)


def _ids(placements: Iterable[Placement], pools: Sequence[PoolName]) -> PageIds:
    out: PageIds = {}
    for where in placements:
        for p in pools:
            if p in where:
                out.setdefault(p, []).append(where[p])
    return out


def pool_counts(wants: Iterable[Iterable[PoolName]]) -> dict[PoolName, int]:
    """Pages per pool over ``wants`` (one entry per page: the pools it takes an id of)."""
    counts: dict[PoolName, int] = {}
    for pools in wants:
        for p in pools:
            counts[p] = counts.get(p, 0) + 1
    return counts


def split_ids(
    counts: Mapping[PoolName, int],
    ids: Mapping[PoolName, Sequence[int]],
    wants: Sequence[Iterable[PoolName]],
) -> list[dict[PoolName, int]]:
    """Hand out ``ids`` per pool to pages in order, page i taking one id of each pool it wants."""
    pos = dict.fromkeys(counts, 0)
    out: list[dict[PoolName, int]] = []
    for pools in wants:
        where: dict[PoolName, int] = {}
        for p in pools:
            where[p] = ids[p][pos[p]]
            pos[p] += 1
        out.append(where)
    return out


class CacheWork:
    """The I/O side of the face's bookkeeping (see the module docstring)."""

    def __init__(
        self,
        index: PrefixIndex,
        engine: TransferEngine,
        storage: CacheStorage | None,
        counters: Counters,
    ) -> None:
        self.index = index
        self.engine = engine
        self.storage = storage
        self.counters = counters
        self.framework_device = engine.device_ownership == "framework"
        self.owners = tuple(p.name for p in engine.plan.independent_pools())
        self.page_bytes = {
            p.name: p.page_size * p.bytes_per_unit_per_layer * p.layers for p in engine.plan.pools
        }
        self.anchor = engine.plan.anchor.name
        self.sidecars = tuple(p.name for p in engine.plan.pools if p.name not in self.owners)
        self.quarantine: PageIds = {}
        self.tg: anyio.abc.TaskGroup | None = None
        self.busy = 0  # background tasks running (backups, storage writes, load settling)
        self.scopes: set[anyio.CancelScope] = set()  # one per background task (cancel_all)
        self.cancelled = False

    def count_bytes(self, direction: str, placements: Iterable[Placement]) -> None:
        """Add the bytes of ``placements`` to ``bytes_<direction>`` and, per pool (a sidecar's
        bytes under the sidecar), to ``bytes_<direction>:<pool>``."""
        total = 0
        for where in placements:
            for p in where:
                pools = (p, *self.sidecars) if p is self.anchor else (p,)
                for q in pools:
                    n = self.page_bytes[q]
                    total += n
                    self.counters.add(f"bytes_{direction}:{q.value}", n)
        self.counters.add(f"bytes_{direction}", total)

    # -- frees ---------------------------------------------------------------------------------
    def free(self, freed: Iterable[Freed]) -> PageIds:
        """Return ids to their allocators; the device ids (per pool) are returned to the caller."""
        host: PageIds = {}
        device: PageIds = {}
        for f in freed:
            (host if f.tier is Tier.HOST else device).setdefault(f.pool, []).append(f.page)
        if host:
            if self.storage is not None and not self.storage.buffers_safe():
                # A store call that overran its deadline may still write these buffers: hold
                # them until the store says it is safe again (docs/storage-mooncake.md).
                for p, ids in host.items():
                    self.quarantine.setdefault(p, []).extend(ids)
            else:
                self.engine.free_host(host)
        self.release_quarantine()
        if device and not self.framework_device:
            self.engine.free_device(device)
        return device

    def release_quarantine(self) -> None:
        if self.quarantine and (self.storage is None or self.storage.buffers_safe()):
            held, self.quarantine = self.quarantine, {}
            self.engine.free_host(held)

    # -- allocation ------------------------------------------------------------------------------
    async def allocate(self, tier: Tier, counts: Mapping[PoolName, int]) -> PageIds:
        """Allocate pages on HOST or DEVICE (engine-owned), evicting LRU pages when short."""
        slots = self.engine.host_slots if tier is Tier.HOST else self.engine.device_slots
        want = {p: n for p, n in counts.items() if n}
        try:
            return {p: list(v) for p, v in slots.allocate(want).pages.items()}
        except OutOfSlotsError:
            pass
        free = slots.free_counts()
        for p, n in want.items():
            short = n - free.get(p, 0)
            if short > 0:
                acts = self.index.evict(tier, short, None if p is self.anchor else p)
                await self.perform(acts, wait=True)
        return {p: list(v) for p, v in slots.allocate(want).pages.items()}

    # -- actions ---------------------------------------------------------------------------------
    async def perform(self, acts: Actions, *, wait: bool) -> PageIds:
        """Free, back up and store what ``acts`` asks; returns the device ids freed (all of
        them when ``wait``: write-back copies are waited for)."""
        device = self.free(acts.free)
        if acts.backup:
            more = await self.backup(acts.backup, wait=wait, evicting=True)
            for p, ids in more.items():
                device.setdefault(p, []).extend(ids)
        if acts.store:
            await self.store(acts.store, wait=wait)
        return device

    async def backup(self, ops: Sequence[PageOp], *, wait: bool, evicting: bool = False) -> PageIds:
        """Device -> host for ``ops``; settles in the background unless ``wait``.

        ``evicting``: the ops are write-back victims of an eviction; if no host page can be
        had they are dropped from the device (the page is lost from the cache, consistently).
        """
        keys = [op.key for op in ops]
        counts = pool_counts(op.source for op in ops)
        try:
            host = await self.allocate(Tier.HOST, counts)
        except OutOfSlotsError:
            self.counters.add("backups_skipped", len(ops))
            if not evicting:
                return {}
            # Write-back victims waiting for this copy are dropped instead (lost, consistent).
            victims = [op.key for op in ops if self.index.pins(Tier.DEVICE, op.key) == 0]
            return self.free(self.index.drop(Tier.DEVICE, victims).free)
        dests = split_ids(counts, host, [list(op.source) for op in ops])
        try:
            ticket = self.index.prepare_backup(keys, dests)
        except CacheStateError:
            self.engine.free_host(host)
            self.counters.add("backups_skipped", len(ops))
            return {}
        device = _ids((op.source for op in ops), self.owners)
        try:
            handle = await self.engine.backup(device, host)
        except BaseException:
            with anyio.CancelScope(shield=True):
                self.free(self.index.abort(ticket).free)
            self.counters.add("backups_failed", len(ops))
            raise
        if wait:
            return await self._settle_backup(ticket, handle)
        self.spawn(self._settle_backup, ticket, handle)
        return {}

    async def _settle_backup(self, ticket: Ticket, handle: Any) -> PageIds:
        ok = False
        try:
            await handle.wait()
            ok = True
        except TransferError as e:
            log.warning("cache_backup_failed", pages=len(ticket), error=str(e))
        finally:
            with anyio.CancelScope(shield=True):
                acts = self.index.complete(ticket, ok)
                if ok:
                    self.counters.add("backups", len(ticket))
                    self.count_bytes("backed_up", ticket.dests)
                else:
                    self.counters.add("backups_failed", len(ticket))
                device = self.free(acts.free)
        if acts.store:
            await self.store(acts.store, wait=False)
        return device

    async def store(self, ops: Sequence[PageOp], *, wait: bool) -> None:
        """Host -> storage for ``ops`` (in the background unless ``wait``)."""
        if self.storage is None:
            return
        try:
            ticket = self.index.prepare_store([op.key for op in ops])
        except CacheStateError:
            return
        if wait:
            await self._write(ticket)
        else:
            self.spawn(self._write, ticket)

    async def _write(self, ticket: Ticket) -> None:
        storage = self.storage
        oks: list[bool] | None = None
        try:
            if storage is not None:
                oks = await storage.write(ticket.keys, ticket.sources)
        finally:
            with anyio.CancelScope(shield=True):
                flags = oks if oks is not None else [False] * len(ticket)
                acts = self.index.complete(ticket, flags)
                good = sum(flags)
                self.counters.add("stored_pages", good)
                self.count_bytes(
                    "stored", (s for s, f in zip(ticket.sources, flags, strict=True) if f)
                )
                self.counters.add("store_failures", len(ticket) - good)
                self.free(acts.free)

    def spawn(self, func: Any, *args: Any) -> None:
        if self.tg is None:
            raise CacheStateError("the cache is not open: enter it with 'async with cache:'")
        self.busy += 1  # counted from now: wait_idle must not miss a task not yet started
        self.tg.start_soon(self._guarded, func, *args)

    async def _guarded(self, func: Any, *args: Any) -> None:
        """A background task: its bookkeeping is shielded; an error is logged, never raised
        into the face's task group (which would close the face)."""
        scope = anyio.CancelScope()
        if self.cancelled:
            scope.cancel()
        self.scopes.add(scope)
        try:
            with scope:
                await func(*args)
        except Exception as e:
            log.warning("cache_background_failed", task=func.__name__, error=repr(e))
        finally:
            self.scopes.discard(scope)
            self.busy -= 1

    def cancel_all(self) -> None:
        """Cancel every background task (a cancelled close): each settles shielded."""
        self.cancelled = True
        for scope in self.scopes:
            scope.cancel()
