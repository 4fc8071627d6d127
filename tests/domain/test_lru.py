"""TickLru: least recently touched first, unstamped items invisible, compaction keeps the order."""

from __future__ import annotations

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
    assert len(lru._queues[0]) <= 2 * 10 + 64
    assert lru.holds(0) == {id(i) for i in items}
    assert drain(lru) == [str(i) for i in range(10)]
