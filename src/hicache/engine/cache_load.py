"""The two ends of a load of the cache face that run around the engine's copy.

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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

from hicache.domain.errors import CacheStateError
from hicache.domain.tiers import Tier
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
