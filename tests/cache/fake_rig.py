"""Helpers of the cache face tests built on the engine's fakes (no torch).

- hybrid_plan(): KV + indexer sidecar + Mamba state restored from a checkpoint.
- cached_on_host(rig, cache, pages): a request inserted, backed up and evicted from the device.
- assert_consistent(rig, cache): no pins, nothing in flight, allocators agree with the index.
- FakeBuffers: HostPageBuffers over plain bytearrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from hicache.cache.face import HiCache
from hicache.domain import HitPolicy, HostGroupPlan, PoolName
from hicache.domain.storage import PageBuffer
from hicache.domain.tiers import PerTier, Tier
from tests.engine.fakes import Rig
from tests.engine.fakes import hybrid_plan as _hybrid_plan

KV, MAMBA = PoolName.KV, PoolName.MAMBA


PS = 4


def hybrid_plan() -> HostGroupPlan:
    """KV + indexer sidecar + Mamba state restored from a checkpoint (trailing pages)."""
    plan = _hybrid_plan()
    pools = [
        attrs.evolve(p, hit_policy=HitPolicy.TRAILING_PAGES) if p.name is MAMBA else p
        for p in plan.pools
    ]
    return attrs.evolve(plan, pools=pools)


def prompt(pages: int, first: int = 0) -> list[int]:
    return list(range(first, first + pages * PS + 1))


async def cached_on_host(
    rig: Rig,
    cache: HiCache,
    pages: int,
    *,
    first: int = 0,
    checkpoints: Sequence[int] | None = None,
) -> list[int]:
    """Insert a request of ``pages`` pages with state checkpoints, back it up, evict it from
    the device: it is then on host only. Returns its tokens."""
    tokens = prompt(pages, first)
    marks = list(checkpoints) if checkpoints is not None else [pages]
    got = rig.device_slots.allocate({KV: pages, MAMBA: len(marks)}).pages
    rig.transfer.fill_device(KV, got[KV], f"r{first}")
    rig.transfer.fill_device(PoolName.INDEXER, got[KV], f"r{first}")
    rig.transfer.fill_device(MAMBA, got[MAMBA], f"r{first}")
    await cache.insert(
        tokens,
        {KV: list(got[KV])},
        checkpoints={b: {MAMBA: s} for b, s in zip(marks, got[MAMBA], strict=True)},
    )
    await cache.wait_idle()
    await cache.evict(Tier.DEVICE, 100)
    return tokens


def assert_consistent(rig: Rig, cache: HiCache) -> None:
    cache.index.validate()
    s = cache.index.statistics()
    assert s.pinned == PerTier(), s
    assert s.in_flight == 0, s
    # every host page the allocator gave out is one the index holds
    on_host = s.on_tier.host
    used = {
        n: rig.host_slots.allocator(n).pages - f for n, f in rig.host_slots.free_counts().items()
    }
    assert used[KV] == on_host
    dev_used = {
        n: rig.device_slots.allocator(n).pages - f
        for n, f in rig.device_slots.free_counts().items()
    }
    assert dev_used[KV] == s.on_tier.device
    rig.assert_no_leaks(host_used=used, device_used=dev_used)


class FakeBuffers:
    """HostPageBuffers over plain bytearrays (the fake engine has no real host memory)."""

    def __init__(self, nbytes: int = 64) -> None:
        self.pages: dict[tuple[PoolName, int], bytearray] = {}
        self.nbytes = nbytes

    def buffer(self, pool: PoolName, page: int) -> PageBuffer:
        data = self.pages.setdefault(
            (pool, page), bytearray(f"{pool.value}{page}".encode().ljust(self.nbytes, b"."))
        )
        return [memoryview(data)]
