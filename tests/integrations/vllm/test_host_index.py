"""The scheduler's host index: slots, pins, LRU eviction and failed writes."""

from __future__ import annotations

import pytest

from hicache.domain import CacheStateError, ConfigError
from hicache.integrations.vllm.host_index import HostIndex


def k(i: int) -> bytes:
    return bytes([i]) * 32


def test_a_page_is_matchable_only_once_its_write_succeeded() -> None:
    idx = HostIndex(2)
    slot = idx.reserve(k(1))
    assert slot is not None
    assert idx.known(k(1))
    assert idx.lookup(k(1)) is None
    idx.ready(k(1))
    idx.unpin(k(1))
    assert idx.lookup(k(1)) == slot


def test_eviction_takes_the_least_recently_used_unpinned_page() -> None:
    idx = HostIndex(2)
    for i in (1, 2):
        idx.reserve(k(i))
        idx.ready(k(i))
        idx.unpin(k(i))
    idx.lookup(k(1), touch=True)  # 2 is now the oldest
    assert idx.reserve(k(3)) is not None
    assert idx.lookup(k(2)) is None
    assert idx.lookup(k(1)) is not None
    assert idx.evictions == 1


def test_pinned_pages_are_never_evicted() -> None:
    idx = HostIndex(1)
    idx.reserve(k(1))
    idx.ready(k(1))  # still pinned by its reservation
    assert idx.reserve(k(2)) is None
    idx.unpin(k(1))
    idx.pin(k(1))  # a load uses it
    assert idx.reserve(k(2)) is None


def test_a_failed_write_frees_its_slot_once_unpinned() -> None:
    idx = HostIndex(1)
    idx.reserve(k(1), pins=2)
    idx.drop(k(1))
    assert idx.free_slots == 0
    idx.unpin(k(1))
    assert idx.known(k(1))
    idx.unpin(k(1))
    assert not idx.known(k(1))
    assert idx.free_slots == 1


def test_unbalanced_pins_and_double_reserve_are_caught() -> None:
    idx = HostIndex(2)
    idx.reserve(k(1))
    with pytest.raises(CacheStateError):
        idx.reserve(k(1))
    idx.unpin(k(1))
    with pytest.raises(CacheStateError):
        idx.unpin(k(1))
    with pytest.raises(CacheStateError):
        idx.pin(k(1))  # not ready
    with pytest.raises(ConfigError):
        HostIndex(0)


def test_clear_unpinned_keeps_pages_in_use() -> None:
    idx = HostIndex(3)
    for i in (1, 2):
        idx.reserve(k(i))
        idx.ready(k(i))
        idx.unpin(k(i))
    idx.pin(k(2))
    assert idx.clear_unpinned() == 1
    assert idx.lookup(k(1)) is None
    assert idx.lookup(k(2)) is not None
