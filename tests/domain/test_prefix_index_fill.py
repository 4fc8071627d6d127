"""Fills: a load or prefetch destination without the anchor completes a page's copy on that tier
with the pools it lacks (a state checkpoint, a window page), pinned until the transfer ends."""

from __future__ import annotations

import pytest

from hicache.domain import CacheStateError, ConfigError, PoolName
from hicache.domain.prefix_index import PrefixIndex
from hicache.domain.tiers import Tier, WriteSettings
from tests.domain.index_rules import HYBRID, keys

KV, IDX, MAMBA = PoolName.KV, PoolName.INDEXER, PoolName.MAMBA
D, H, S = Tier.DEVICE, Tier.HOST, Tier.STORAGE


def _on_host_without_state() -> tuple[PrefixIndex, list[bytes]]:
    """Two pages on host and storage (checkpoint at boundary 2); the checkpoint left host."""
    idx = PrefixIndex(HYBRID, WriteSettings(host="write_through", storage="write_through"))
    a = keys(2)
    idx.insert(a, [{KV: 1}, {KV: 2, MAMBA: 3}])
    idx.complete(idx.prepare_backup(a, [{KV: 11}, {KV: 12, MAMBA: 13}]), True)
    idx.complete(idx.prepare_store(a), True)
    idx.drop(D, a)
    assert idx.evict(H, 1, MAMBA).free_ids(H, MAMBA) == [13]
    assert idx.match(a).host_pages == 0  # the anchor is on host, the checkpoint only in storage
    return idx, a


def test_a_prefetch_fill_adds_the_missing_pool_to_the_host_copy_and_the_hit_comes_back() -> None:
    idx, a = _on_host_without_state()
    t = idx.prepare_prefetch(a[1:], [{MAMBA: 23}])
    assert idx.pins(H, a[1]) == 1  # the copy it completes cannot be evicted meanwhile
    assert idx.evict(H, 5).evicted == 1  # only the other page could go
    idx.complete(t, True)
    assert idx.placement(H, a[1]) == {KV: 12, MAMBA: 23}
    assert idx.pins(H, a[1]) == 0
    assert idx.placement(S, a[1]) == {KV: 0, IDX: 0, MAMBA: 0}
    idx.validate()
    assert idx.evict(H, 1, MAMBA).free_ids(H, MAMBA) == [23]  # back in the LRU
    idx.validate()


def test_a_failed_fill_frees_only_its_pages_and_keeps_the_copy() -> None:
    idx, a = _on_host_without_state()
    t = idx.prepare_prefetch(a[1:], [{MAMBA: 23}])
    out = idx.complete(t, False)
    assert out.free_ids(H, MAMBA) == [23]
    assert out.free_ids(H, KV) == []
    assert idx.placement(H, a[1]) == {KV: 12}
    assert idx.pins(H, a[1]) == 0
    idx.validate()
    # dropping only the failed pool's storage object keeps the anchor's
    idx.drop(S, a[1:], MAMBA)
    assert idx.placement(S, a[1]) == {KV: 0, IDX: 0}
    idx.validate()


def test_fills_are_refused_where_there_is_nothing_to_complete() -> None:
    idx, a = _on_host_without_state()
    idx.complete(idx.prepare_prefetch(a[1:], [{MAMBA: 23}]), True)
    with pytest.raises(CacheStateError, match="already has"):
        idx.prepare_prefetch(a[1:], [{MAMBA: 24}])
    t = idx.prepare_prefetch(a[:1], [{MAMBA: 25}])  # a checkpoint for boundary 1 as well
    with pytest.raises(CacheStateError, match="on its way"):
        idx.prepare_prefetch(a[:1], [{MAMBA: 26}])
    idx.abort(t)
    idx.validate()
    with pytest.raises(CacheStateError, match="there is none"):
        PrefixIndex(HYBRID).prepare_prefetch(keys(1, base=40), [{MAMBA: 1}])
    with pytest.raises(CacheStateError, match="there is none"):
        idx.prepare_load(a[1:], [{MAMBA: 5}])  # not on device at all
    with pytest.raises(ConfigError, match="empty placement"):
        idx.prepare_prefetch(a[1:], [{}])
    with pytest.raises(ConfigError, match="no pages of their own"):
        idx.prepare_prefetch(a[1:], [{IDX: 1}])


def test_a_fill_of_a_copy_being_evicted_is_refused() -> None:
    idx = PrefixIndex(HYBRID, WriteSettings(host="write_through", storage="write_back"))
    a = keys(1)
    idx.insert(a, [{KV: 1, MAMBA: 2}])
    idx.complete(idx.prepare_backup(a, [{KV: 11}]), True)  # the checkpoint never reached host
    idx.drop(D, a)
    store = idx.evict(H, 1)  # write_back: the host copy waits for its store
    assert len(store.store) == 1
    with pytest.raises(CacheStateError, match="being evicted"):
        idx.prepare_prefetch(a, [{MAMBA: 5}])
    idx.validate()


def test_a_load_fill_completes_the_device_copy_and_an_insert_meanwhile_is_a_duplicate() -> None:
    idx = PrefixIndex(HYBRID, WriteSettings(host="write_through"))
    a = keys(2)
    idx.insert(a, [{KV: 1}, {KV: 2, MAMBA: 3}])
    idx.complete(idx.prepare_backup(a, [{KV: 11}, {KV: 12, MAMBA: 13}]), True)
    assert idx.evict(D, 1, MAMBA).free_ids(D, MAMBA) == [3]
    t = idx.prepare_load(a[1:], [{MAMBA: 4}])
    assert idx.pins(D, a[1]) == 1
    assert idx.pins(H, a[1]) == 1
    # another request inserts the same page with its own checkpoint while the fill runs
    out = idx.insert(a[1:], [{KV: 2, MAMBA: 5}])
    assert out.free_ids(D, MAMBA) == [5]
    idx.complete(t, True)
    assert idx.placement(D, a[1]) == {KV: 2, MAMBA: 4}
    assert (idx.pins(D, a[1]), idx.pins(H, a[1])) == (0, 0)
    idx.validate()
    with pytest.raises(CacheStateError, match="already has"):
        idx.prepare_load(a[1:], [{MAMBA: 6}])
