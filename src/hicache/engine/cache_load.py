"""The two ends of a load of the cache face that run around the engine's copy.

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

from typing import TYPE_CHECKING, Any

import anyio

from hicache.domain.errors import CacheStateError
from hicache.domain.pools import PoolName
from hicache.domain.tiers import Placement, Tier
from hicache.engine.cache_match import CacheLoad, CacheMatch
from hicache.engine.handles import LoadHandle

if TYPE_CHECKING:
    from hicache.engine.cache import HiCache


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

def completes(device: Placement | None, host: Placement | None) -> bool:
    """Whether ``host`` holds pools the ``device`` copy lacks."""
    return host is not None and device is not None and not host.keys() <= device.keys()


def partial(device: Placement | None, needed: frozenset[PoolName]) -> bool:
    """Whether a page that restores ``needed`` must be loaded: no device copy, or one without
    every pool of ``needed``."""
    return device is None or not needed <= device.keys()


def load_pools(cache: HiCache, match: CacheMatch) -> list[frozenset[PoolName]]:
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
