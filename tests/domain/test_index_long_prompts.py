"""The prefix index after the long-prompt work (issue #19) gives the same answers as before it:
the same hits, actions and eviction order on random prompts, against the earlier per-page
implementation (one LRU entry per touched page, one stamp per unpinned page) kept here."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest

from hicache.domain import (
    CacheStateError,
    GroupRules,
    PoolName,
    PoolRule,
    PrefixIndex,
    Restore,
    Tier,
    chain_keys,
)
from hicache.domain.index_pages import PageRecord
from hicache.domain.pools import PoolName as P
from hicache.domain.tiers import Match

KV = PoolName.KV


class PerItemLru:
    """The earlier TickLru: one (tick, item) queue entry per stamp."""

    def __init__(self, slots: int) -> None:
        self._queues: list[deque[tuple[int, Any]]] = [deque() for _ in range(slots)]
        self._live = [0] * slots
        self._tick = 0

    def live(self, slot: int) -> int:
        return self._live[slot]

    def stamp(self, item: Any, slot: int) -> None:
        self._tick += 1
        if not item.stamp[slot]:
            self._live[slot] += 1
        item.stamp[slot] = self._tick
        self._queues[slot].append((self._tick, item))

    def unstamp(self, item: Any, slot: int) -> None:
        if item.stamp[slot]:
            item.stamp[slot] = 0
            self._live[slot] -= 1

    def touch(self, items: Iterable[Any], slot: int, admit: Callable[[Any], bool] | None) -> None:
        for item in items:
            if item.stamp[slot] or (admit is not None and admit(item)):
                if not item.stamp[slot]:
                    self._live[slot] += 1
                self._tick += 1
                item.stamp[slot] = self._tick
                self._queues[slot].append((self._tick, item))

    def pop_oldest(self, slot: int) -> Any:
        q = self._queues[slot]
        while q:
            tick, item = q.popleft()
            if item.stamp[slot] == tick:
                return item
        return None

    def holds(self, slot: int) -> set[int]:
        return {id(i) for t, i in self._queues[slot] if i.stamp[slot] == t}


class PerPageIndex(PrefixIndex):
    """The earlier index: match looks pages up then walks them, pins and unpins stamp page by
    page, touches admit on every tier (one pool, as the test uses)."""

    def __init__(self, rules: GroupRules) -> None:
        super().__init__(rules)
        self._lru = PerItemLru(self._slots)  # type: ignore[assignment]

    def match(self, keys: Sequence[bytes], *, touch: bool = True) -> Match:
        pages: list[PageRecord] = []
        for k in keys:
            p = self._pages.get(k)
            if p is None:
                break
            pages.append(p)
        n = len(pages)
        i = 0
        while i < n and pages[i].at[0] is not None:
            i += 1
        dev = i
        while i < n and (pages[i].at[0] is not None or pages[i].at[1] is not None):
            i += 1
        host = i
        while i < n and any(pages[i].at):
            i += 1
        sto = i
        if touch and host:
            self._touch(pages[:host])
        return Match(
            keys=tuple(keys[:sto]),
            page_size=self.rules.page_size,
            device_pages=dev,
            host_pages=max(dev, host),
            storage_pages=max(dev, host, sto),
        )

    def pin(self, tier: Tier, keys: Sequence[bytes]) -> None:
        pages = [self._page(k) for k in keys]
        if any(p.at[tier] is None for p in pages):
            super().pin(tier, keys)  # raises the same error
        for p in pages:
            p.pins[tier] += 1
            if p.pins[tier] == 1:
                self._lru_remove(p, tier)

    def unpin(self, tier: Tier, keys: Sequence[bytes]) -> None:
        pages = [self._page(k) for k in keys]
        for p in pages:
            p.pins[tier] -= 1
            if p.pins[tier] == 0:
                self._lru_add(p, tier)

    def _touch(self, pages: Sequence[PageRecord], *, enter: bool = False) -> None:
        for (tier, pool), slot in self._slot.items():
            if not enter and not self._lru.live(slot):
                continue
            seq: Iterable[PageRecord] = pages if pool in self._trailing else reversed(pages)
            admit = None
            if enter:

                def admit(p: PageRecord, tier: int = tier, pool: P = pool) -> bool:
                    at = p.at[tier]
                    return at is not None and pool in at and self._evictable(p, tier)

            self._lru.touch(seq, slot, admit)


def dropped(index: PrefixIndex, keys: list[bytes]) -> Any:
    """drop's actions, or its refusal (a pinned page) as text: both indexes must agree."""
    try:
        return outcome(index.drop(Tier.DEVICE, keys))
    except CacheStateError as e:
        return str(e)


def outcome(result: Any) -> Any:
    if hasattr(result, "device_pages"):
        return (result.keys, result.device_pages, result.host_pages, result.storage_pages)
    return repr(result)


@pytest.mark.parametrize("page_size", [1, 4])
def test_hits_actions_and_eviction_order_equal_the_per_page_index(page_size: int) -> None:
    rng = random.Random(page_size)
    rules = GroupRules(page_size=page_size, rules=[PoolRule(pool=KV, restore=Restore.ALL_PAGES)])
    new, old = PrefixIndex(rules), PerPageIndex(rules)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(4)]
    # Prompts come back (so later matches meet the holes and partial copies earlier ones left)
    # and share prefixes (so one prompt's insert or backup changes another's pages).
    prompts = [
        rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
        for _ in range(12)
    ]
    pinned: list[list[bytes]] = []
    next_id = 0
    hosts_seen = 0
    for _ in range(600):
        op = rng.random()
        prompt = rng.choice(prompts)
        keys = chain_keys(prompt, page_size)
        if op < 0.3:
            where = [{KV: next_id + i} for i in range(len(keys))]
            next_id += len(keys)
            acts = [ix.insert(keys, where) for ix in (new, old)]
            got = [outcome(a) for a in acts]
            backup = [op.key for op in acts[0].backup]
            if backup and rng.random() < 0.5:  # host copies, so hits span device and host
                hosts = [{KV: next_id + i} for i in range(len(backup))]
                next_id += len(backup)
                for ix in (new, old):
                    ix.complete(ix.prepare_backup(backup, hosts), True)
        elif op < 0.55:
            got = [outcome(ix.match(keys)) for ix in (new, old)]
            hosts_seen += got[0][2] > got[0][1]  # the hit reaches past the device pages
        elif op < 0.7:
            hit = new.match(keys, touch=False).device_pages
            take = keys[:hit] + keys[: rng.randrange(0, hit + 1)]  # some keys twice
            for ix in (new, old):
                ix.pin(Tier.DEVICE, take)
            pinned.append(take)
            got = []
        elif op < 0.82 and pinned:
            take = pinned.pop(rng.randrange(len(pinned)))
            for ix in (new, old):
                ix.unpin(Tier.DEVICE, take)
            got = []
        elif op < 0.9 and keys:
            # Forget one page on the device (a hole: host-only pages amid device pages).
            hole = [rng.choice(keys)]
            got = [dropped(ix, hole) for ix in (new, old)]
        else:
            count = rng.randrange(1, 20)
            got = [outcome(ix.evict(Tier.DEVICE, count)) for ix in (new, old)]
        if got:
            assert got[0] == got[1]

        new.validate()
        assert new.statistics() == old.statistics()
    assert hosts_seen  # some matches found pages on host only: the host boundary was compared
    # Drain both: every remaining unpinned page leaves in the same order.
    for take in pinned:
        for ix in (new, old):
            ix.unpin(Tier.DEVICE, take)
    assert outcome(new.evict(Tier.DEVICE, 10**6)) == outcome(old.evict(Tier.DEVICE, 10**6))


def test_a_host_only_page_amid_device_pages_keeps_the_hit_going_as_before() -> None:
    rules = GroupRules(page_size=1, rules=[PoolRule(pool=KV, restore=Restore.ALL_PAGES)])
    results = []
    for ix in (PrefixIndex(rules), PerPageIndex(rules)):
        stem, tail = chain_keys(list(range(8)), 1), chain_keys(list(range(12)), 1)[8:]
        ix.insert(stem + tail, [{KV: i} for i in range(12)])  # no backup completed: device only
        ix.complete(ix.prepare_backup(stem, [{KV: 100 + i} for i in range(8)]), True)
        ix.drop(Tier.DEVICE, [stem[5]])  # page 5 now on host only, pages 8.. on device only
        m = ix.match(stem + tail)
        results.append((m.device_pages, m.host_pages, m.storage_pages))
    assert results[0] == results[1] == (5, 12, 12)
