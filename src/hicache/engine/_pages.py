"""Page sets the engine is given (private): normalised, checked against the plan and allocators.

- normalise_pages: a mapping (or GroupAllocation) of slot-owning pool to page ids, checked (pools
  of this group, no sidecars, ids in range, no duplicates, allocated unless the framework owns
  them) and put in the plan's pool order.
- check_pairing: host and device page sets pair 1:1 per pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hicache.domain.errors import ConfigError, ForeignIndexError, SlotError
from hicache.domain.pools import PoolName
from hicache.domain.slots import GroupAllocation, GroupAllocator, PageAllocator

PageSet = Mapping[PoolName, Sequence[int]] | Mapping[str, Sequence[int]] | GroupAllocation
PageDict = dict[PoolName, tuple[int, ...]]


def normalise_pages(
    pages: PageSet,
    side: str,
    slots: GroupAllocator,
    *,
    owners: Sequence[PoolName],
    sidecars: Sequence[PoolName],
    anchor: PoolName,
    allocated: bool = True,
) -> PageDict:
    """Normalise a page set: slot-owning pools of this plan, valid ids, allocated pages."""
    raw: Mapping[Any, Sequence[int]]
    raw = pages.pages if isinstance(pages, GroupAllocation) else pages
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{side} pages must be a mapping of pool name to page ids, got {type(raw).__name__}"
        )
    out: PageDict = {}
    for key, ids in raw.items():
        pool = PoolName.parse(key)
        if pool in sidecars:
            raise ConfigError(
                f"pool {pool.value!r} is a sidecar: it follows the anchor's pages; give "
                f"pages for {anchor.value!r} instead"
            )
        if pool not in owners:
            raise ConfigError(
                f"pool {pool.value!r} is not in this group: expected pages for "
                f"{[p.value for p in owners]}"
            )
        if pool in out:
            raise ConfigError(f"pool {pool.value!r} is named twice in the {side} pages")
        allocator = slots.allocator(pool)
        out[pool] = _check_ids(ids, pool, side, allocator, allocated=allocated)
    if not any(out.values()):
        raise ConfigError(f"no {side} pages given: expected at least one page")
    return {p: out[p] for p in owners if out.get(p)}


def _check_ids(
    ids: Iterable[int], pool: PoolName, side: str, allocator: PageAllocator, *, allocated: bool
) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ConfigError(
            f"{side} pages of pool {pool.value!r} must be a sequence of ints, got {ids!r}"
        )
    out = tuple(ids)
    seen: set[int] = set()
    for page in out:
        if type(page) is not int or not 0 <= page < allocator.pages:
            raise ForeignIndexError(
                f"{side} page {page!r} does not belong to pool {pool.value!r} "
                f"(ids 0..{allocator.pages - 1})"
            )
        if page in seen:
            raise ConfigError(f"{side} page {page} of pool {pool.value!r} is listed twice")
        seen.add(page)
        if allocated and allocator.is_free(page):
            raise SlotError(
                f"{side} page {page} of pool {pool.value!r} is free: allocate it before "
                f"a transfer uses it"
            )
    return out


def check_pairing(a: PageDict, b: PageDict) -> None:
    """Host and device pages pair 1:1: the same pools with the same counts."""
    for pool in a.keys() | b.keys():
        na, nb = len(a.get(pool, ())), len(b.get(pool, ()))
        if na != nb:
            raise ConfigError(
                f"pool {pool.value!r}: {na} pages on one side paired with {nb} on the other; "
                f"host and device pages pair 1:1"
            )
