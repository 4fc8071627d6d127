"""TickLru's runs count the items whose latest touch they hold: exact under any operations, a
run every item left is dropped without looking at its entries, a wrong count is caught."""

from __future__ import annotations

import random

import pytest

from hicache.domain import (
    CacheStateError,
    GroupRules,
    PoolName,
    PoolRule,
    PrefixIndex,
    Restore,
    key_chain,
)
from hicache.domain.lru import TickLru


class Item:
    def __init__(self, name: int) -> None:
        self.name = name
        self.stamp: list[object] = [0]


class Untouchable:
    @property
    def stamp(self) -> list[object]:
        raise AssertionError("a stale run's entry was looked at")


def counts_hold(lru: TickLru[Item], items: list[Item]) -> None:
    for run in lru._queues[0]:
        assert run.live == sum(1 for it in items if it.stamp[0] is run)
    assert lru.live(0) == sum(1 for it in items if it.stamp[0])


def test_each_run_counts_exactly_the_items_it_holds_under_random_operations() -> None:
    rng = random.Random(3)
    for _ in range(20):
        items = [Item(i) for i in range(rng.randrange(1, 30))]
        lru: TickLru[Item] = TickLru(1)
        for _ in range(300):
            op = rng.random()
            if op < 0.35:  # stretches of one run, entering items and repeats mixed
                start = rng.randrange(len(items))
                batch = items[start : start + rng.randrange(0, 20)]
                batch += [rng.choice(items) for _ in range(rng.randrange(0, 4))]
                lru.touch(batch, 0, (lambda _it: True) if rng.random() < 0.5 else None)
            elif op < 0.5:
                lru.stamp(rng.choice(items), 0)
            elif op < 0.7:
                lru.unstamp(rng.choice(items), 0)
            else:
                got = lru.pop_oldest(0)
                if got is not None and rng.random() < 0.7:
                    lru.unstamp(got, 0)
            counts_hold(lru, items)


def test_a_run_every_item_left_is_dropped_whole() -> None:
    lru: TickLru[Item] = TickLru(1)
    items = [Item(i) for i in range(100)]
    lru.touch(items, 0, lambda _it: True)
    first = lru._queues[0][0]
    lru.touch(reversed(items), 0, None)  # every item moves on: the first run holds none
    assert first.live == 0
    first.items = [Untouchable()] * 100  # were its entries looked at, popping would fail
    assert lru.pop_oldest(0) is items[-1]


def test_validate_catches_a_run_that_says_it_holds_no_item_while_one_is_there() -> None:
    idx = PrefixIndex(
        GroupRules(page_size=1, rules=[PoolRule(pool=PoolName.KV, restore=Restore.ALL_PAGES)])
    )
    keys = key_chain(list(range(8)), 1)
    idx.insert(keys, [{PoolName.KV: i} for i in range(8)])
    idx.validate()
    idx._lru._queues[0][-1].live = 0  # the broken case: eviction would skip these pages
    with pytest.raises(CacheStateError, match="lost track"):
        idx.validate()


def popped(lru: TickLru[Item]) -> list[int]:
    out = []
    while (item := lru.pop_oldest(0)) is not None:
        out.append(item.name)
    return out


def test_unstamp_all_equals_one_unstamp_per_item() -> None:
    rng = random.Random(5)
    for _ in range(50):
        items = [Item(i) for i in range(20)]
        twins = [Item(i) for i in range(20)]
        a: TickLru[Item] = TickLru(1)
        b: TickLru[Item] = TickLru(1)
        for _ in range(5):
            start = rng.randrange(20)
            picks = list(range(start, min(20, start + rng.randrange(1, 12))))
            a.touch([items[i] for i in picks], 0, lambda _it: True)
            b.touch([twins[i] for i in picks], 0, lambda _it: True)
        gone = [rng.randrange(20) for _ in range(rng.randrange(0, 25))]  # repeats included
        a.unstamp_all([items[i] for i in gone], 0)
        for i in gone:
            b.unstamp(twins[i], 0)
        counts_hold(a, items)
        assert a.live(0) == b.live(0)
        assert popped(a) == popped(b)
