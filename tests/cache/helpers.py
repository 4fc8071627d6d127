"""Helpers of the cache face tests: the bundled stacks' small plans, device bytes, leak checks.

- STACKS: name -> (bundled model, settings) of every stack archetype the face must restore.
- stack_plan(name): the plan (tiny capacities) and the CacheSettings (sliding window) of a stack.
- Request: one request's device pages (anchor per page, window pool per page, a state slot),
  filled with random bytes and remembered, so that a restore can be compared byte by byte.
- device_bytes / poison_device / assert_clean: reading device pages, overwriting every device
  byte, and checking that nothing leaks (pins, index invariants).
"""

from __future__ import annotations

import random

import torch

from hicache.bootstrap import load_model_spec
from hicache.bootstrap.cache import CacheRuntime
from hicache.cache.face import HiCache
from hicache.cache.values import CacheSettings
from hicache.domain import HostGroupPlan, PlanSettings, PoolName, PoolRole, plan_stack
from hicache.domain.hybrid import Restore
from hicache.domain.tiers import PerTier

KV, SWA, MAMBA = PoolName.KV, PoolName.SWA, PoolName.MAMBA

STACKS = {
    "dense": "llama-3.1-8b-instruct",
    "latent": "deepseek-v3",
    "sliding": "gpt-oss-20b",
    "state": "qwen3-next-80b-a3b-instruct",
    "parallel_hybrid": "falcon-h1-7b-instruct",
    "indexer": "deepseek-v3.2-exp",
    "indexer_minimax": "minimax-m3",
}


def stack_plan(name: str, *, page_size: int = 16) -> tuple[HostGroupPlan, CacheSettings]:
    spec = load_model_spec(STACKS[name])
    plan = plan_stack(
        spec,
        PlanSettings(tp_size=8, page_size=page_size, device_tokens=16 * page_size, device_slots=4),
    )
    return plan, CacheSettings(sliding_window=spec.sliding_window)


def _rows(rt: CacheRuntime, pool: PoolName, page: int) -> list[torch.Tensor]:
    dp = rt.runtime.device.pool(pool)
    ps = dp.page_size
    out = []
    for layers in dp.buffers.values():
        for t in layers:
            raw = t.view(torch.uint8).view(t.shape[0], -1)
            out.append(raw[page * ps : (page + 1) * ps])
    return out


def device_bytes(rt: CacheRuntime, pool: PoolName, page: int) -> bytes:
    return b"".join(r.cpu().numpy().tobytes() for r in _rows(rt, pool, page))


def fill_device(rt: CacheRuntime, pool: PoolName, page: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    for r in _rows(rt, pool, page):
        r.copy_(torch.randint(0, 256, r.shape, generator=gen, dtype=torch.uint8))
    return device_bytes(rt, pool, page)


def poison_device(rt: CacheRuntime) -> None:
    for pool in rt.runtime.device.pools.values():
        for layers in pool.buffers.values():
            for t in layers:
                t.view(torch.uint8).fill_(0xA5)


def sidecars(plan: HostGroupPlan) -> list[PoolName]:
    return [p.name for p in plan.pools if p.role is PoolRole.SIDECAR]


class Request:
    """A request of ``pages`` full pages (+3 tokens) computed on the device, bytes remembered."""

    def __init__(self, rt: CacheRuntime, pages: int, *, seed: int = 0, first: int = 1000) -> None:
        self.rt = rt
        plan = rt.plan
        cache = rt.cache
        ps = cache.page_size
        self.tokens = list(range(first, first + pages * ps + 3))
        self.pages = pages
        owners = [p.name for p in plan.independent_pools()]
        counts = {KV: pages + 1}
        if SWA in owners:
            counts[SWA] = pages + 1
        if MAMBA in owners:
            counts[MAMBA] = 1
        got = rt.runtime.device_slots.allocate(counts).pages
        self.device = {p: list(v) for p, v in got.items()}
        self.bytes: dict[tuple[PoolName, int], bytes] = {}
        rng = random.Random(seed)
        for pool, ids in self.device.items():
            for page in ids:
                self.bytes[(pool, page)] = fill_device(rt, pool, page, rng.randrange(1 << 30))
                if pool is KV:
                    for side in sidecars(plan):
                        self.bytes[(side, page)] = fill_device(
                            rt, side, page, rng.randrange(1 << 30)
                        )
        self.rules = cache.rules

    @classmethod
    def replay(cls, rt: CacheRuntime, other: Request) -> Request:
        """``other`` seen from another runtime (a restart): same tokens and remembered bytes,
        no device pages taken."""
        req = cls.__new__(cls)
        req.rt, req.tokens, req.pages = rt, other.tokens, other.pages
        req.device, req.bytes, req.rules = other.device, other.bytes, rt.cache.rules
        return req

    def insert_args(
        self,
    ) -> tuple[dict[PoolName, list[int | None]], dict[int, dict[PoolName, int]]]:
        pages: dict[PoolName, list[int | None]] = {KV: list(self.device[KV])}
        if SWA in self.device:
            pages[SWA] = list(self.device[SWA])
        checkpoints = {}
        if MAMBA in self.device:
            checkpoints[self.pages] = {MAMBA: self.device[MAMBA][0]}
        return pages, checkpoints

    async def insert(self, cache: HiCache) -> None:
        pages, checkpoints = self.insert_args()
        await cache.insert(self.tokens, pages, checkpoints=checkpoints)

    def original(self, pool: PoolName, i: int) -> int:
        """The request's device page of ``pool`` for page i (state: its one slot)."""
        return self.device[pool][0] if pool is MAMBA else self.device[pool][i]

    def check_restored(self, placements: list[dict[PoolName, int]], boundary: int) -> int:
        """Compare every restored page with what was computed; returns pages compared."""
        plan = self.rt.plan
        compared = 0
        assert len(placements) == boundary
        for i, where in enumerate(placements):
            for pool, page in where.items():
                want = self.bytes[(pool, self.original(pool, i))]
                assert device_bytes(self.rt, pool, page) == want, (pool, i, page)
                compared += 1
                if pool is KV:
                    for side in sidecars(plan):
                        want = self.bytes[(side, self.original(KV, i))]
                        assert device_bytes(self.rt, side, page) == want, (side, i)
        # every pool restores something at the boundary
        restored = {p for w in placements for p in w}
        owners = {self.rules.anchor if r.follows_anchor else r.pool for r in self.rules.rules}
        assert restored == owners, (restored, owners)
        return compared


def window_pages(cache: HiCache) -> int:
    return max(
        (r.window_pages for r in cache.rules.rules if r.restore is Restore.WINDOW), default=0
    )


def assert_clean(cache: HiCache) -> None:
    """No pins anywhere, the index's invariants hold, nothing in flight, and every host page
    the allocator gave out is one the index holds (nothing leaked)."""
    cache.index.validate()
    stats = cache.index.statistics()
    assert stats.pinned == PerTier(), stats
    assert stats.in_flight == 0, stats
    assert len(cache.engine.host_pins) == 0
    assert len(cache.engine.device_pins) == 0
    host = cache.engine.host_slots
    anchor = cache.rules.anchor
    assert host.allocator(anchor).used_count() == stats.on_tier.host


async def restore(rt: CacheRuntime, req: Request, pages: int) -> None:
    """With the prefix only in storage: match (storage hint), prefetch it all, match (host
    hit), load, and compare every byte with what the request computed."""
    cache = rt.cache
    poison_device(rt)
    async with await cache.match(req.tokens) as m:
        assert (m.device_pages, m.host_pages, m.storage_pages) == (0, 0, pages)
        got = await cache.prefetch(m)
        assert (got.requested, got.read, got.host_pages) == (pages, pages, pages)
    async with await cache.match(req.tokens) as m:
        assert m.host_pages == pages
        load = await cache.load(m)
        await load.wait()
        req.check_restored(m.placements(), pages)
