"""HostPages: the host-tier-only index (slots, pins, LRU eviction, failed writes, reset)."""

from __future__ import annotations

import pytest

from hicache.domain import CacheStateError, ConfigError
from hicache.domain.host_pages import HostPages
from hicache.domain.pins import PinnedPageError
from hicache.domain.pools import PoolName


def k(i: int) -> bytes:
    return bytes([i]) * 32


def held(idx: HostPages, *keys: int) -> HostPages:
    """Pages written and released: READY, unpinned, in this order of use."""
    for i in keys:
        assert idx.reserve(k(i)) is not None
        idx.ready(k(i))
        idx.unpin(k(i))
    return idx


def test_a_page_is_matchable_only_once_its_write_succeeded() -> None:
    idx = HostPages(2)
    slot = idx.reserve(k(1))
    assert slot is not None
    assert idx.known(k(1))
    assert idx.lookup(k(1)) is None
    idx.ready(k(1))
    idx.unpin(k(1))
    assert idx.lookup(k(1)) == slot


def test_reserve_evicts_the_least_recently_used_unpinned_ready_page() -> None:
    idx = held(HostPages(2), 1, 2)
    idx.lookup(k(1), touch=True)  # 2 is now the oldest
    assert idx.reserve(k(3)) is not None
    assert idx.lookup(k(2)) is None
    assert not idx.known(k(2))
    assert idx.lookup(k(1)) is not None
    assert idx.evictions == 1
    # without the touch the oldest page goes
    idx2 = held(HostPages(2), 1, 2)
    idx2.reserve(k(3))
    assert idx2.lookup(k(1)) is None
    assert idx2.lookup(k(2)) is not None


def test_a_reused_slot_is_the_evicted_pages_slot() -> None:
    idx = held(HostPages(1), 1)
    slot = idx.lookup(k(1))
    assert idx.reserve(k(2)) == slot
    assert idx.free_slots == 0
    assert len(idx) == 1


def test_pins_and_pending_writes_block_eviction() -> None:
    idx = HostPages(1)
    idx.reserve(k(1))
    assert idx.reserve(k(2)) is None  # pending: its write is in flight
    idx.ready(k(1))  # still pinned by its reservation
    assert idx.reserve(k(2)) is None
    idx.unpin(k(1))
    idx.pin(k(1))  # a load uses it
    assert idx.reserve(k(2)) is None
    assert idx.lookup(k(1)) is not None
    idx.unpin(k(1))
    assert idx.reserve(k(2)) is not None  # unpinned: evictable again


def test_a_touch_of_a_pinned_page_does_not_make_it_evictable() -> None:
    idx = held(HostPages(1), 1)
    idx.pin(k(1))
    idx.lookup(k(1), touch=True)
    assert idx.reserve(k(2)) is None


def test_a_dropped_pinned_page_frees_its_slot_once_unpinned() -> None:
    idx = HostPages(1)
    idx.reserve(k(1), pins=2)  # saved to host and to the store
    idx.drop(k(1))
    assert idx.lookup(k(1)) is None
    assert idx.free_slots == 0
    idx.ready(k(1))  # a late success report does not revive it
    assert idx.lookup(k(1)) is None
    idx.unpin(k(1))
    assert idx.known(k(1))
    assert idx.free_slots == 0
    idx.unpin(k(1))
    assert not idx.known(k(1))
    assert idx.free_slots == 1
    assert idx.reserve(k(1)) is not None  # the key can be written again


def test_a_dropped_unpinned_page_is_gone_at_once() -> None:
    idx = held(HostPages(2), 1)
    idx.drop(k(1))
    assert not idx.known(k(1))
    assert idx.free_slots == 2
    idx.drop(k(9))  # unknown: nothing to do


def test_unbalanced_pins_and_double_reserve_are_caught() -> None:
    idx = HostPages(2)
    idx.reserve(k(1))
    with pytest.raises(CacheStateError, match="already held"):
        idx.reserve(k(1))
    with pytest.raises(CacheStateError, match="not ready"):
        idx.pin(k(1))
    idx.unpin(k(1))
    with pytest.raises(CacheStateError, match="not pinned"):
        idx.unpin(k(1))
    with pytest.raises(CacheStateError, match="not held"):
        idx.unpin(k(7))
    with pytest.raises(CacheStateError, match="at least one pin"):
        idx.reserve(k(2), pins=0)
    with pytest.raises(ConfigError, match="host pages"):
        HostPages(0)


def test_clear_unpinned_forgets_ready_unpinned_pages_and_keeps_pages_in_use() -> None:
    idx = held(HostPages(4), 1, 2)
    idx.pin(k(2))
    idx.reserve(k(3))  # pending
    assert idx.clear_unpinned() == 1
    assert idx.lookup(k(1)) is None
    assert not idx.known(k(1))
    assert idx.lookup(k(2)) is not None
    assert idx.known(k(3))
    assert idx.free_slots == 2
    assert idx.evictions == 0  # a reset is not an eviction
    idx.unpin(k(2))
    assert idx.clear_unpinned() == 1


def test_the_pin_counts_are_the_domains_pin_table() -> None:
    idx = HostPages(2, pool=PoolName.MAMBA)
    slot = idx.reserve(k(1), pins=2)
    assert slot is not None
    assert idx.pins.count(PoolName.MAMBA, slot) == 2 == idx.pin_count(k(1))
    # A pin table that lost a count (a broken caller) makes the free of a pinned slot raise
    # instead of handing the slot to another page.
    idx.ready(k(1))
    idx.unpin(k(1))
    idx.unpin(k(1))
    idx.pins.pin({PoolName.MAMBA: [slot]})  # pinned behind the index's back
    with pytest.raises(PinnedPageError):
        idx.clear_unpinned()


def test_the_listener_hears_each_page_become_matchable_and_stop_being_so_once() -> None:
    heard: list[tuple[int, bool]] = []
    idx = HostPages(2, on_change=lambda key, held: heard.append((key[0], held)))
    held(idx, 1, 2)
    assert heard == [(1, True), (2, True)]
    assert idx.reserve(k(3)) is not None  # evicts 1 (the oldest); 3 is pending: not heard
    assert heard[2:] == [(1, False)]
    idx.drop(k(3))  # a failed write of a page never matchable: nothing to hear
    idx.unpin(k(3))
    assert heard[3:] == []
    idx.pin(k(2))
    idx.drop(k(2))  # pinned: unmatchable now (heard), its slot freed at the unpin (not again)
    idx.unpin(k(2))
    assert heard[3:] == [(2, False)]
    held(idx, 4, 5)
    assert idx.clear_unpinned() == 2
    assert heard[4:] == [(4, True), (5, True), (4, False), (5, False)]
