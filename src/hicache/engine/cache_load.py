"""A load of the cache face: the host part of a hit copied to the device, and its two ends.

- load_match(cache, match, device_pages, after): joins loads already bringing the match's pages,
  takes (or allocates) the device pages, drops partial device copies, prepares the index's
  ticket, registers the pages as loading and asks the engine; a failure before the engine
  answers aborts the ticket and gives the pages back (shielded); a CacheLoad.
- arriving(cache, key, pools): whether a load is bringing ``key`` to the device or it is there
  with ``pools``.
- join_loads(cache, match): pages of the match that another load is bringing to the device are
  waited for and taken from the device (their pins move from host to device), so a prefix that
  two requests load at once is copied once.
- displace_partial(cache, keys): pages a load must restore whole that the device holds only in
  part (no window page or state checkpoint there) lose that partial copy, so the host's whole
  page can be loaded; CacheStateError when the copy is pinned by another match.
- settle_load(cache, load, handle, ticket, allocated): runs in the face's task group once the
  engine's load finished: registers the pages on the device tier and pins them for the match,
  or aborts the ticket and frees the device pages it allocated; always shielded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from hicache.domain.errors import CacheStateError, ConfigError
from hicache.domain.pools import PoolName
from hicache.domain.tiers import Tier
from hicache.engine.cache_insert import pool_name
from hicache.engine.cache_match import CacheLoad, CacheMatch
from hicache.engine.cache_work import _split
from hicache.engine.handles import LoadHandle

if TYPE_CHECKING:
    from hicache.engine.cache import HiCache


async def load_match(
    cache: HiCache,
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
        counts = match.load_counts()
        if device_pages is not None:
            break
        if work.framework_device:
            raise ConfigError(
                "the framework owns device pages (device_ownership='framework'): pass "
                "device_pages with {p.value: n for p, n in counts.items()} pages"
            )
        ids = await work.allocate(Tier.DEVICE, counts)
        allocated = True
        # The allocation may have awaited an eviction: another request's load may have
        # brought (or started bringing) some of these pages meanwhile. Give the pages back
        # and join it rather than copy a page twice.
        if not any(arriving(cache, match.keys[i], match.needed[i]) for i in todo):
            break
        engine.free_device(ids)
    if device_pages is not None:
        got = {pool_name(p): list(v) for p, v in device_pages.items()}
        if {p: len(v) for p, v in got.items()} != counts:
            raise ConfigError(
                "device_pages give {p.value: len(v) for p, v in got.items()} "
                "pages; this load needs {p.value: n for p, n in counts.items()}"
            )
        ids, allocated = got, False
    wants = [sorted(match.needed[i], key=lambda p: p.value) for i in todo]
    dests = _split(counts, ids, wants)
    keys = [match.keys[i] for i in todo]
    try:
        displace_partial(cache, keys)
    except BaseException:
        if allocated:
            engine.free_device(ids)
        raise
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


def arriving(cache: HiCache, key: bytes, pools: frozenset[PoolName]) -> bool:
    """Whether a load is bringing ``key`` to the device or it is there with ``pools``."""
    where = cache.index.placement(Tier.DEVICE, key)
    return key in cache.loading or (where is not None and pools <= where.keys())


async def join_loads(cache: HiCache, match: CacheMatch) -> None:
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

def displace_partial(cache: HiCache, keys: Sequence[bytes]) -> None:
    """Pages this load must restore whole that the device holds only in part (another request
    inserted them without a window page or a state checkpoint, or a pool's copy was evicted
    there since the match): that partial copy is dropped, so the host's whole page can be
    loaded. CacheStateError when it cannot be: pinned there by another match, or device pages
    the framework owns (the face cannot hand their ids back from a load)."""
    index = cache.index
    partial = [k for k in keys if index.placement(Tier.DEVICE, k) is not None]
    if not partial:
        return
    pinned = [k.hex()[:16] for k in partial if index.pins(Tier.DEVICE, k)]
    if pinned or cache.work.framework_device:
        why = (
            f"pinned there by another match ({pinned})"
            if pinned
            else "the framework owns device pages"
        )
        raise CacheStateError(
            f"load: pages {[k.hex()[:16] for k in partial]} are on the device without every "
            f"pool this match restores, and that copy cannot be replaced: {why}"
        )
    cache.work.free(index.drop(Tier.DEVICE, partial).free)


async def settle_load(
    cache: HiCache, load: CacheLoad, handle: LoadHandle, ticket: Any, allocated: bool
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
            cache.counters.add("bytes_loaded", cache.work.bytes_of(ticket.dests))
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
