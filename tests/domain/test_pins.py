"""The pin table: reference counts of pages that in-flight transfers use (pure, no fakes)."""

from __future__ import annotations

import threading

import pytest

from hicache.domain import ConfigError, PoolName, SlotError
from hicache.domain.pins import PinnedPageError, PinTable, page_set

KV, MAMBA = PoolName.KV, PoolName.MAMBA


def test_pin_and_unpin_count_references() -> None:
    pins = PinTable("host")
    pins.pin({KV: [1, 2], MAMBA: [0]})
    pins.pin({KV: [2]})
    assert pins.count(KV, 2) == 2
    assert pins.is_pinned(MAMBA, 0)
    assert not pins.is_pinned(KV, 3)
    assert len(pins) == 3
    assert pins.snapshot() == {KV: {1: 1, 2: 2}, MAMBA: {0: 1}}
    assert pins.pages_of(KV) == frozenset({1, 2})
    pins.unpin({KV: [2]})
    assert pins.count(KV, 2) == 1
    pins.unpin({KV: [1, 2], MAMBA: [0]})
    assert len(pins) == 0
    assert pins.snapshot() == {}


def test_unpin_is_all_or_nothing() -> None:
    pins = PinTable("device")
    pins.pin({KV: [1]})
    with pytest.raises(SlotError, match="page 2 of pool 'kv' is pinned 0 time"):
        pins.unpin({KV: [1, 2]})
    assert pins.count(KV, 1) == 1
    with pytest.raises(SlotError, match="cannot unpin it 2 time"):
        pins.unpin({KV: [1, 1]})
    assert pins.count(KV, 1) == 1


def test_check_unpinned_names_the_pages() -> None:
    pins = PinTable("host pins")
    pins.pin({KV: list(range(12))})
    pins.check_unpinned({KV: [20], MAMBA: [0]})
    with pytest.raises(PinnedPageError, match=r"host pins: cannot evict pages kv:3"):
        pins.check_unpinned({KV: [3, 20]}, action="evict")
    with pytest.raises(PinnedPageError, match="and 4 more"):
        pins.check_unpinned({KV: list(range(12))})
    assert issubclass(PinnedPageError, SlotError)
    assert pins.pinned({KV: [0, 20, 1]}) == [(KV, 0), (KV, 1)]


def test_pool_names_as_strings_name_the_same_pool() -> None:
    pins = PinTable()
    pins.pin({"kv": [0]})  # type: ignore[dict-item]
    assert pins.count(KV, 0) == 1
    assert pins.is_pinned("kv", 0)
    pins.unpin({KV: [0]})
    assert len(pins) == 0


def test_bad_keys_and_pages_are_typed_errors() -> None:
    pins = PinTable()
    with pytest.raises(ConfigError, match="unknown pool name 'kvv'"):
        pins.pin({"kvv": [0]})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="a pool name must be a string or a PoolName, got 3"):
        pins.pin({3: [0]})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="must be a mapping of pool name to pages, got list"):
        pins.pin([0, 1])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be a sequence of page ids, got 5"):
        pins.pin({KV: 5})  # type: ignore[dict-item]
    with pytest.raises(SlotError, match="page -1 of pool 'kv'"):
        pins.pin({KV: [-1]})
    with pytest.raises(SlotError, match="page True"):
        pins.pin({KV: [True]})
    assert len(pins) == 0


def test_repr_and_truthiness() -> None:
    pins = PinTable("t")
    assert bool(pins)  # an empty table is still a table
    pins.pin({KV: [1, 1]})
    assert repr(pins) == "<PinTable t: 1 pages pinned, 2 references>"
    assert page_set({KV: [3, 4]}) == {KV: (3, 4)}


def test_threads_pinning_concurrently_keep_exact_counts() -> None:
    pins = PinTable()

    def worker() -> None:
        for _ in range(500):
            pins.pin({KV: [0, 1]})
            pins.unpin({KV: [0]})

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pins.count(KV, 0) == 0
    assert pins.count(KV, 1) == 2000
