"""TickLru: least recently touched first, unstamped items invisible, compaction keeps the order."""

from __future__ import annotations

import random

from hicache.domain.lru import TickLru


class Item:
    def __init__(self, name: str) -> None:
        self.name = name
        self.stamp = [0]


def drain(lru: TickLru[Item]) -> list[str]:
    out = []
    while (item := lru.pop_oldest(0)) is not None:
        out.append(item.name)
        lru.unstamp(item, 0)
    return out


def test_pop_oldest_follows_touch_order_and_skips_unstamped_items() -> None:
    lru: TickLru[Item] = TickLru(1)
    a, b, c = Item("a"), Item("b"), Item("c")
    for item in (a, b, c):
        lru.stamp(item, 0)
    lru.touch([a], 0, None)  # a is now the most recent
    lru.unstamp(b, 0)  # pinned: invisible
    assert lru.live(0) == 2
    assert drain(lru) == ["c", "a"]
    assert lru.live(0) == 0


def test_touch_admits_only_what_the_predicate_accepts() -> None:
    lru: TickLru[Item] = TickLru(1)
    items = [Item(str(i)) for i in range(4)]
    lru.touch(items, 0, lambda it: it.name != "2")
    assert lru.live(0) == 3
    lru.touch(reversed(items), 0, None)  # restamps only the stamped ones, in this order
    assert drain(lru) == ["3", "1", "0"]


def test_compaction_drops_stale_entries_and_keeps_the_order() -> None:
    lru: TickLru[Item] = TickLru(1)
    items = [Item(str(i)) for i in range(10)]
    for _ in range(50):  # many touches: stale entries pile up and get compacted
        lru.touch(items, 0, lambda _it: True)
    assert lru.queued(0) <= 4 * 10 + 64
    assert lru.holds(0) == {id(i) for i in items}
    assert drain(lru) == [str(i) for i in range(10)]


class Reference:
    """The order TickLru must give, kept the slow way: a counter per touch, min by counter."""

    def __init__(self) -> None:
        self.count = 0
        self.at: dict[int, int] = {}  # id -> counter of its last touch, while queued
        self.stamped: set[int] = set()

    def stamp(self, item: Item) -> None:
        self.count += 1
        self.at[id(item)] = self.count
        self.stamped.add(id(item))

    def touch(self, items: list[Item], admit: bool) -> None:
        for item in items:
            if id(item) in self.stamped or admit:
                self.stamp(item)

    def unstamp(self, item: Item) -> None:
        self.stamped.discard(id(item))
        self.at.pop(id(item), None)

    def pop_oldest(self, by_id: dict[int, Item]) -> Item | None:
        if not self.at:
            return None
        key = min(self.at, key=self.at.__getitem__)
        del self.at[key]  # popped: stamped until the caller unstamps, but no longer queued
        return by_id[key]


def test_runs_give_the_order_of_one_entry_per_touched_item_under_random_operations() -> None:
    rng = random.Random(7)
    for _ in range(30):
        items = [Item(str(i)) for i in range(rng.randrange(1, 40))]
        by_id = {id(i): i for i in items}
        lru: TickLru[Item] = TickLru(1)
        ref = Reference()
        for _ in range(400):
            op = rng.random()
            if op < 0.3:  # a batch touch, duplicates and reversed order included
                batch = [rng.choice(items) for _ in range(rng.randrange(0, 60))]
                admit = rng.random() < 0.5
                lru.touch(batch, 0, (lambda _it: True) if admit else None)
                ref.touch(batch, admit)
            elif op < 0.5:
                item = rng.choice(items)
                lru.stamp(item, 0)
                ref.stamp(item)
            elif op < 0.7:
                item = rng.choice(items)
                lru.unstamp(item, 0)
                ref.unstamp(item)
            else:
                got = lru.pop_oldest(0)
                assert got is ref.pop_oldest(by_id)
                if got is not None and rng.random() < 0.7:
                    lru.unstamp(got, 0)
                    ref.unstamp(got)
            assert lru.live(0) == len(ref.stamped)
            assert lru.holds(0) == set(ref.at)
            assert lru.queued(0) <= 4 * lru.live(0) + 64 + 60
