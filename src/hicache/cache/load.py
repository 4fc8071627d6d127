"""A load of the cache face: the host part of a hit copied to the device, and its two ends.

- load_match(cache, match, device_pages, after): joins loads already bringing the match's pages,
  takes (or allocates) the device pages (only the missing pools of a page partly on the
  device: a fill of that copy), prepares the index's
  ticket, registers the pages as loading and asks the engine; a failure before the engine
  answers aborts the ticket and gives the pages back (shielded); a CacheLoad.
- arriving(cache, key, pools): whether a load is bringing ``key`` to the device or it is there
  with ``pools``.
- join_loads(cache, match): pages of the match that another load is bringing to the device are
  waited for and taken from the device (their pins move from host to device), so a prefix that
  two requests load at once is copied once.
- load_pools(cache, match): per page of the host hit, the pools a load copies: none for a page
  taken from the device, every pool it restores for a page not on the device, and only the
  pools its device copy lacks for a page partly there (a window page or state checkpoint not
  inserted or evicted there): the load completes that copy (an index fill) instead of
  replacing it, so a copy another match pins, or framework-owned pages, stay as they are.
- completes(device, host) / partial(device, needed): whether a host copy has pools a device
  copy lacks; whether a device copy lacks pools a page restores.
- settle_load(cache, load, handle, ticket, allocated): runs in the face's task group once the
  engine's load finished: registers the pages on the device tier and pins them for the match,
  or aborts the ticket and frees the device pages it allocated; always shielded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from hicache.cache.insert import pool_name
from hicache.cache.match import CacheLoad, CacheMatch
from hicache.cache.parts import CacheParts
from hicache.cache.work import pool_counts, split_ids
from hicache.domain.errors import CacheStateError, ConfigError
from hicache.domain.pools import PoolName
from hicache.domain.tiers import Placement, Tier
from hicache.engine.handles import LoadHandle


async def load_match(
    cache: CacheParts,
    match: CacheMatch,
    device_pages: Mapping[PoolName, Sequence[int]] | None,
    *,
    after: object | None = None,
) -> CacheLoad:
    """Copy the host part of ``match`` to the device (see ``HiCache.load``)."""
    if match.released:
        raise CacheStateError(f"{match!r} was released: match again")
    engine, work, index = cache.engine, cache.work, cache.index
    while True:
        await join_loads(cache, match)
        todo = [i for i, s in enumerate(match.sources) if s is Tier.HOST]
        if not todo:
            load = CacheLoad(match, None)
            match.attach(load)
            return load
        pools = load_pools(cache, match)
        counts = pool_counts(pools)
        if device_pages is not None:
            break
        if work.framework_device:
            want = {p.value: n for p, n in counts.items()}
            raise ConfigError(
                "the framework owns device pages (device_ownership='framework'): pass "
                f"device_pages with {want} pages"
            )
        ids = await work.allocate(Tier.DEVICE, counts)
        allocated = True
        # The allocation may have awaited an eviction: another request's load may have
        # brought (or started bringing) some of these pages meanwhile. Give the pages back
        # and join it rather than copy a page twice.
        coming = any(arriving(cache, match.keys[i], match.needed[i]) for i in todo)
        if not coming and load_pools(cache, match) == pools:
            break
        engine.free_device(ids)
    if device_pages is not None:
        got = {pool_name(p): list(v) for p, v in device_pages.items()}
        if {p: len(v) for p, v in got.items()} != counts:
            given = {p.value: len(v) for p, v in got.items()}
            want = {p.value: n for p, n in counts.items()}
            raise ConfigError(f"device_pages give {given} pages; this load needs {want}")
        ids, allocated = got, False
    # A page whose device copy lacks pools gets only those (a fill of that copy).
    wants = [sorted(pools[i], key=lambda p: p.value) for i in todo]
    dests = split_ids(counts, ids, wants)
    keys = [match.keys[i] for i in todo]
    # Registered before the engine is asked (an await): a concurrent load of the same
    # pages joins this one instead of finding them "on their way" with nobody to wait for.
    load = CacheLoad(match, None, starting=True)
    try:
        match.attach(load)
        ticket = index.prepare_load(keys, dests)
    except BaseException as e:
        if allocated:
            engine.free_device(ids)
        load.settle(e)
        raise
    host = {p: [ticket.sources[j][p] for j, w in enumerate(dests) if p in w] for p in counts}
    device = {p: [w[p] for w in dests if p in w] for p in counts}
    for key in ticket.keys:
        cache.loading[key] = load
    try:
        handle = await engine.load(host, device, after=after)
    except BaseException as e:
        with anyio.CancelScope(shield=True):
            for key in ticket.keys:
                if cache.loading.get(key) is load:
                    del cache.loading[key]
            acts = index.abort(ticket)
            work.free(f for f in acts.free if allocated or f.tier is not Tier.DEVICE)
            cache.counters.add("loads_failed")
            load.settle(e)
        raise
    load.handle = handle
    match.pins.loading = True
    work.spawn(settle_load, cache, load, handle, ticket, allocated)
    return load


def arriving(cache: CacheParts, key: bytes, pools: frozenset[PoolName]) -> bool:
    """Whether a load is bringing ``key`` to the device or it is there with ``pools``."""
    where = cache.index.placement(Tier.DEVICE, key)
    return key in cache.loading or (where is not None and pools <= where.keys())


async def join_loads(cache: CacheParts, match: CacheMatch) -> None:
    """Pages of ``match`` that another load is bringing to the device: wait for that load; then
    take every page now on the device from there instead of loading it twice (pins move with
    them), including pages a load finished while the match awaited its agreement."""
    while True:
        others = {
            id(ld): ld
            for i, key in enumerate(match.keys[: len(match.sources)])
            if match.sources[i] is Tier.HOST and (ld := cache.loading.get(key)) is not None
        }
        for other in others.values():
            await other.settled()
        if match.released:
            raise CacheStateError(f"{match!r} was released while it waited for a load")
        sources = list(match.sources)
        moved: list[bytes] = []
        for i, src in enumerate(sources):
            if src is Tier.HOST:
                where = cache.index.placement(Tier.DEVICE, match.keys[i])
                if where is not None and match.needed[i] <= where.keys():
                    moved.append(match.keys[i])
                    sources[i] = Tier.DEVICE
        if moved:
            pins = match.pins
            cache.index.pin(Tier.DEVICE, moved)
            pins.device.extend(moved)
            cache.index.unpin(Tier.HOST, moved)
            gone = set(moved)
            pins.host = [k for k in pins.host if k not in gone]
        match.set_sources(sources)
        if not others:
            return


def completes(device: Placement | None, host: Placement | None) -> bool:
    """Whether ``host`` holds pools the ``device`` copy lacks."""
    return host is not None and device is not None and not host.keys() <= device.keys()


def partial(device: Placement | None, needed: frozenset[PoolName]) -> bool:
    """Whether a page that restores ``needed`` must be loaded: no device copy, or one without
    every pool of ``needed``."""
    return device is None or not needed <= device.keys()


def load_pools(cache: CacheParts, match: CacheMatch) -> list[frozenset[PoolName]]:
    """Per page of ``match``, the pools its load copies (see the module docstring)."""
    out: list[frozenset[PoolName]] = []
    for key, src, needed in zip(match.keys, match.sources, match.needed, strict=False):
        if src is Tier.DEVICE:
            out.append(frozenset())
            continue
        where = cache.index.placement(Tier.DEVICE, key)
        out.append(needed if where is None else needed - where.keys())
    return out


async def settle_load(
    cache: CacheParts, load: CacheLoad, handle: LoadHandle, ticket: Any, allocated: bool
) -> None:
    error: BaseException | None = None
    try:
        await handle.wait()
    except BaseException as e:
        error = e
    with anyio.CancelScope(shield=True):
        match = load.match
        match.pins.loading = False
        for key in ticket.keys:
            if cache.loading.get(key) is load:
                del cache.loading[key]
        if error is None:
            cache.index.complete(ticket, True)
            cache.counters.add("loads")
            cache.counters.add("loaded_pages", len(ticket))
            cache.work.count_bytes("loaded", ticket.dests)
            pins = match.pins
            if not pins.released:
                # The match now holds the loaded pages on the device instead of on host.
                cache.index.pin(Tier.DEVICE, ticket.keys)
                pins.device.extend(ticket.keys)
                loaded = set(ticket.keys)
                still = [k for k in pins.host if k not in loaded]
                cache.index.unpin(Tier.HOST, [k for k in pins.host if k in loaded])
                pins.host = still
            match.set_sources([Tier.DEVICE] * len(match.sources))
        else:
            acts = cache.index.abort(ticket)
            cache.work.free(f for f in acts.free if allocated or f.tier is not Tier.DEVICE)
            cache.counters.add("loads_failed")
        load.settle(error)
    if error is not None and not isinstance(error, Exception):
        raise error
