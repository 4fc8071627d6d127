"""The prefix index: matching, LRU, pins, write policies, two-phase transfers and their failures."""

from __future__ import annotations

import itertools
import sys
import threading

import pytest

from hicache.domain import CacheStateError, ConfigError, PoolName
from hicache.domain.prefix_index import PrefixIndex
from hicache.domain.tiers import Actions, PerTier, Tier, WritePolicy, WriteSettings
from tests.domain.index_rules import HYBRID, PLAIN, keys

KV, IDX, MAMBA = PoolName.KV, PoolName.INDEXER, PoolName.MAMBA
D, H, S = Tier.DEVICE, Tier.HOST, Tier.STORAGE
_ids = itertools.count(100)


def at(n: int) -> list[dict[PoolName, int]]:
    return [{KV: next(_ids)} for _ in range(n)]


def index(host: str = "write_through", storage: str | None = None, **kw: int) -> PrefixIndex:
    return PrefixIndex(PLAIN, WriteSettings(host=host, storage=storage, **kw))  # type: ignore[arg-type]


def freed(actions: Actions, tier: Tier = D) -> list[int]:
    return actions.free_ids(tier, KV)


def test_an_inserted_prefix_matches_on_device_up_to_its_first_unknown_page() -> None:
    idx = index()
    a = keys(3)
    idx.insert(a, at(3))
    m = idx.match([*a, *keys(2, base=999)])
    assert (m.device_pages, m.host_pages, m.storage_pages) == (3, 3, 3)
    assert m.device_tokens == 12
    assert m.keys == tuple(a)
    assert idx.match(keys(3, base=7)).storage_pages == 0
    idx.validate()


def test_lru_evicts_the_least_recently_matched_prefix_tail_first() -> None:
    idx = index()
    a, b = keys(3), keys(3, base=50)
    pa, pb = at(3), at(3)
    idx.insert(a, pa)
    idx.insert(b, pb)
    idx.match(a)  # a is now the most recently used
    first = idx.evict(D, 1)
    assert freed(first) == [pb[2][KV]]  # b's last page goes first
    assert freed(idx.evict(D, 2)) == [pb[1][KV], pb[0][KV]]
    assert idx.match(a).device_pages == 3
    assert idx.statistics().evictions == PerTier(device=3)
    idx.validate()


def test_eviction_never_takes_a_pinned_page() -> None:
    idx = index()
    a, b = keys(2), keys(2, base=50)
    pa, pb = at(2), at(2)
    idx.insert(a, pa)
    idx.insert(b, pb)
    idx.pin(D, a)
    out = idx.evict(D, 10)
    assert out.evicted == 2
    assert sorted(freed(out)) == sorted(p[KV] for p in pb)
    assert idx.match(a).device_pages == 2
    idx.unpin(D, a)
    assert sorted(freed(idx.evict(D, 10))) == sorted(p[KV] for p in pa)
    assert len(idx) == 0
    idx.validate()


def test_unpin_below_zero_raises_and_changes_nothing() -> None:
    idx = index()
    a = keys(2)
    idx.insert(a, at(2))
    idx.pin(D, a[:1])
    with pytest.raises(CacheStateError, match="not pinned"):
        idx.unpin(D, [a[0], a[0]])
    assert idx.pins(D, a[0]) == 1
    with pytest.raises(CacheStateError, match="not on HOST"):
        idx.pin(H, a)
    idx.validate()


def test_write_through_backs_up_on_insert_and_duplicates_come_back_to_free() -> None:
    idx = index("write_through")
    a = keys(2)
    first = idx.insert(a, at(2))
    assert [op.key for op in first.backup] == a
    again = idx.insert(a, dup := at(2))
    assert freed(again) == [p[KV] for p in dup]
    assert again.backup == first.backup  # still not on host: still wanted


def test_write_through_selective_backs_up_after_n_hits() -> None:
    idx = index("write_through_selective", host_hits=3)
    a = keys(2)
    assert not idx.insert(a, at(2)).backup
    assert not idx.insert(a, at(2)).backup
    assert [op.key for op in idx.insert(a, at(2)).backup] == a


def test_write_back_backs_up_on_eviction_and_frees_only_after_the_copy() -> None:
    idx = index("write_back")
    a = keys(2)
    dev = at(2)
    assert not idx.insert(a, dev).backup
    out = idx.evict(D, 2)
    assert out.evicted == 2
    assert not out.free
    assert sorted(op.key for op in out.backup) == sorted(a)
    assert not idx.evict(D, 2)  # the victims are no longer candidates
    ticket = idx.prepare_backup(a, host := at(2))
    done = idx.complete(ticket, True)
    assert sorted(freed(done)) == sorted(p[KV] for p in dev)
    m = idx.match(a)
    assert (m.device_pages, m.host_pages) == (0, 2)
    assert idx.placement(H, a[1]) == host[1]
    idx.validate()


def test_a_write_back_victim_pinned_meanwhile_stays_on_device() -> None:
    idx = index("write_back")
    a = keys(1)
    idx.insert(a, at(1))
    idx.evict(D, 1)
    ticket = idx.prepare_backup(a, at(1))
    idx.pin(D, a)  # a request matched it while the copy ran
    assert not freed(idx.complete(ticket, True))
    assert idx.match(a).device_pages == 1
    idx.unpin(D, a)
    assert idx.evict(D, 1).evicted == 1  # back in the LRU, and now on host: freed at once
    idx.validate()


def test_a_failed_backup_returns_the_host_pages_and_registers_nothing() -> None:
    idx = index("write_through")
    a = keys(2)
    idx.insert(a, at(2))
    ticket = idx.prepare_backup(a, host := at(2))
    assert idx.pins(D, a[0]) == 1
    assert idx.match(a).host_pages == 2  # device pages still count
    out = idx.abort(ticket)
    assert sorted(freed(out, H)) == sorted(p[KV] for p in host)
    assert idx.placement(H, a[0]) is None
    assert idx.pins(D, a[0]) == 0
    with pytest.raises(CacheStateError, match="not in flight"):
        idx.complete(ticket, True)
    idx.validate()


def test_a_failed_load_leaves_nothing_half_registered() -> None:
    idx = index("write_through")
    a = keys(3)
    idx.insert(a, dev := at(3))
    idx.complete(idx.prepare_backup(a, at(3)), True)
    assert sorted(freed(idx.evict(D, 3))) == sorted(p[KV] for p in dev)
    ticket = idx.prepare_load(a, new := at(3))
    assert idx.match(a).device_pages == 0  # destinations in flight are invisible
    out = idx.complete(ticket, [True, False, True])
    assert freed(out) == [new[1][KV]]
    m = idx.match(a)
    assert (m.device_pages, m.host_pages) == (1, 3)
    assert all(idx.pins(H, k) == 0 for k in a)
    idx.validate()


def test_a_failed_prefetch_forgets_pages_it_created() -> None:
    idx = index(storage="write_through")
    a = keys(2)
    ticket = idx.prepare_prefetch(a, host := at(2))
    assert len(idx) == 2
    assert idx.match(a).storage_pages == 0
    out = idx.complete(ticket, [False, False])
    assert sorted(freed(out, H)) == sorted(p[KV] for p in host)
    assert len(idx) == 0
    ok = idx.complete(idx.prepare_prefetch(a, at(2)), True)
    assert not ok.store  # read from storage: already stored
    m = idx.match(a)
    assert (m.host_pages, m.storage_pages) == (2, 2)
    idx.validate()


def test_storage_write_through_stores_what_reaches_host_and_a_failed_store_unregisters() -> None:
    idx = index("write_through", storage="write_through")
    a = keys(2)
    idx.insert(a, at(2))
    done = idx.complete(idx.prepare_backup(a, at(2)), True)
    assert [op.key for op in done.store] == a
    ticket = idx.prepare_store(a)
    assert ticket.sources[0] == idx.placement(H, a[0])
    idx.complete(ticket, [True, False])
    assert idx.placement(S, a[0]) == {KV: 0}
    assert idx.placement(S, a[1]) is None
    idx.drop(D, a)
    idx.drop(H, a)
    assert idx.match(a).storage_pages == 1
    idx.drop(S, a[:1])  # the store answered MISS: forget it
    assert len(idx) == 0
    idx.validate()


def test_storage_write_back_stores_on_host_eviction_then_frees_the_host_page() -> None:
    idx = index("write_through", storage="write_back")
    a = keys(1)
    idx.insert(a, at(1))
    done = idx.complete(idx.prepare_backup(a, host := at(1)), True)
    assert not done.store
    out = idx.evict(H, 1)
    assert [op.key for op in out.store] == a
    assert not out.free
    assert freed(idx.complete(idx.prepare_store(a), True), H) == [host[0][KV]]
    assert idx.placement(H, a[0]) is None
    assert idx.placement(S, a[0]) == {KV: 0}
    idx.validate()


def test_transfers_refuse_pages_already_there_or_on_their_way() -> None:
    idx = index()
    a = keys(1)
    idx.insert(a, at(1))
    with pytest.raises(CacheStateError, match="already on DEVICE"):
        idx.prepare_load(a, at(1))
    idx.prepare_backup(a, at(1))
    with pytest.raises(CacheStateError, match="on its way"):
        idx.prepare_backup(a, at(1))
    with pytest.raises(CacheStateError, match="twice"):
        index().prepare_prefetch([a[0], a[0]], at(2))
    stored = index()
    stored.complete(stored.prepare_prefetch(a, at(1)), True)
    stored.drop(H, a)
    with pytest.raises(CacheStateError, match="not on HOST"):
        stored.prepare_load(a, at(1))
    with pytest.raises(CacheStateError, match="not in the index"):
        stored.pin(D, keys(1, base=77))


def test_bad_placements_are_config_errors() -> None:
    idx = PrefixIndex(HYBRID)
    a = keys(1)
    with pytest.raises(ConfigError, match="anchor"):
        idx.insert(a, [{MAMBA: 1}])
    with pytest.raises(ConfigError, match="no pages of their own"):
        idx.insert(a, [{KV: 1, IDX: 1}])
    with pytest.raises(ConfigError, match="2 placements"):
        idx.insert(a, at(2))
    with pytest.raises(ConfigError, match="owns no pages"):
        idx.evict(D, 1, IDX)
    with pytest.raises(ConfigError, match="DEVICE or HOST"):
        idx.evict(S, 1)
    with pytest.raises(ConfigError, match="write policy"):
        WriteSettings(host="write_sometimes")  # type: ignore[arg-type]


def test_hybrid_hit_stops_at_the_deepest_state_checkpoint_and_evicting_it_shrinks_the_hit() -> None:
    idx = PrefixIndex(HYBRID, WriteSettings(host=WritePolicy.WRITE_THROUGH))
    a = keys(4)
    places: list[dict[PoolName, int]] = [{KV: next(_ids)} for _ in a]
    places[1][MAMBA] = 7  # a checkpoint at boundary 2
    places[3][MAMBA] = 8  # and at boundary 4
    idx.insert(a, places)
    assert idx.match(a).device_pages == 4
    out = idx.evict(D, 1, MAMBA)  # head-first for state pools: the older checkpoint goes
    assert out.free_ids(D, MAMBA) == [7]
    assert idx.match(a).device_pages == 4
    assert idx.evict(D, 1, MAMBA).free_ids(D, MAMBA) == [8]
    assert idx.match(a).device_pages == 0  # KV pages are all there; no state to restore
    idx.validate()


def test_a_store_of_a_hybrid_page_records_only_the_pools_it_wrote() -> None:
    idx = PrefixIndex(HYBRID, WriteSettings(host="write_through", storage="write_through"))
    a = keys(2)
    idx.insert(a, [{KV: 1}, {KV: 2, MAMBA: 3}])
    idx.complete(idx.prepare_backup(a, [{KV: 11}, {KV: 12, MAMBA: 13}]), True)
    idx.complete(idx.prepare_store(a), True)
    assert idx.placement(S, a[0]) == {KV: 0, IDX: 0}
    assert idx.placement(S, a[1]) == {KV: 0, IDX: 0, MAMBA: 0}
    idx.drop(D, a)
    idx.drop(H, a)
    assert idx.match(a).storage_pages == 2
    assert idx.match(a[:1]).storage_pages == 0  # no checkpoint at boundary 1


def test_validate_catches_a_pinned_page_left_in_the_lru() -> None:
    idx = index()
    a = keys(1)
    idx.insert(a, at(1))
    idx.pin(D, a)
    idx.validate()
    idx._lru.stamp(idx._pages[a[0]], 0)  # the broken case: a pinned page an eviction could take
    with pytest.raises(CacheStateError, match="LRU"):
        idx.validate()


def test_a_destination_with_pools_the_source_lacks_is_refused_whole() -> None:
    idx = PrefixIndex(HYBRID)
    a = keys(2)
    idx.insert(a, [{KV: 1}, {KV: 2}])
    with pytest.raises(CacheStateError, match="would register pages nothing was copied to"):
        idx.prepare_backup(a, [{KV: 11}, {KV: 12, MAMBA: 13}])
    assert idx.pins(D, a[0]) == 0
    assert idx.statistics().in_flight == 0
    with pytest.raises(ConfigError, match="non-negative integers"):
        idx.insert(a, [{KV: -1}, {KV: 2}])
    idx.validate()


def test_statistics_from_another_thread_while_the_index_changes_never_break_the_count() -> None:
    """A metrics scrape reads ``statistics()`` from its own thread while the event loop inserts
    and drops pages: the records are copied in one step, so the dict may change size under it."""
    idx = index(host="write_back")
    for i in range(2000):  # enough records that counting them spans thread switches
        idx.insert(keys(1, base=100_000 + 4 * i), at(1))
    stop = threading.Event()
    errors: list[BaseException] = []
    counts: list[int] = []

    def scrape() -> None:
        try:
            while not stop.is_set():
                counts.append(idx.statistics().pages)
        except BaseException as e:  # a RuntimeError here is the bug
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=scrape)
    t.start()
    try:
        for i in range(3000):
            k = keys(1, base=4 * i)
            idx.insert(k, at(1))
            idx.drop(D, k)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    assert counts
    assert all(2000 <= n <= 2001 for n in counts)
