"""LruMap: a bounded map in LRU order on the domain's TickLru."""

from __future__ import annotations

import random

import pytest

from hicache.domain import ConfigError
from hicache.domain.lru_map import LruMap


def test_past_its_limit_the_least_recently_used_entries_go_first() -> None:
    m: LruMap[str, int] = LruMap(3)
    assert m.put("a", 1) == []
    m.put("b", 2)
    m.put("c", 3)
    assert m.touch("a")  # b is now the oldest
    assert m.put("d", 4) == [("b", 2)]
    assert m.put("c", 30) == []  # a replacement evicts nothing and refreshes c
    assert m.put("e", 5) == [("a", 1)]
    assert sorted(m.values()) == [4, 5, 30]
    assert len(m) == 3


def test_get_reads_without_refreshing_and_pop_takes_an_entry_out() -> None:
    m: LruMap[str, int] = LruMap(2)
    m.put("a", 1)
    m.put("b", 2)
    assert m.get("a") == 1  # not a touch: a stays the oldest
    assert m.pop("b") == 2
    assert m.pop("b") is None
    assert "b" not in m
    assert not m.touch("b")
    m.put("c", 3)
    assert m.put("d", 4) == [("a", 1)]


def test_the_order_matches_a_plain_reference_over_random_operations() -> None:
    rng = random.Random(3)
    m: LruMap[int, int] = LruMap(8)
    ref: list[int] = []  # keys, oldest first
    for step in range(5_000):
        key = rng.randrange(20)
        op = rng.random()
        if op < 0.5:
            got = m.put(key, step)
            if key in ref:
                ref.remove(key)
            ref.append(key)
            gone = []
            while len(ref) > 8:
                gone.append(ref.pop(0))
            assert [k for k, _ in got] == gone
        elif op < 0.8:
            assert m.touch(key) == (key in ref)
            if key in ref:
                ref.remove(key)
                ref.append(key)
        else:
            assert (m.pop(key) is not None) == (key in ref)
            if key in ref:
                ref.remove(key)
        assert len(m) == len(ref)


@pytest.mark.parametrize("limit", [0, -1, True, 2.5])
def test_a_limit_below_one_is_a_config_error_naming_it(limit: object) -> None:
    with pytest.raises(ConfigError, match="limit"):
        LruMap(limit)  # type: ignore[arg-type]
