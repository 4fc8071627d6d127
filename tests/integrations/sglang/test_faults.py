"""Faults: a damaged page is a miss; a dead or stalled store makes SGLang miss or skip backups
and never holds its controller threads past ``deadline_s + grace_s``; the breaker stops calling
a store that keeps failing; get_stats is SGLang's StorageMetrics with hicache's statistics."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: E402

from hicache.adapters.storage.directory import DirectorySettings, DirectoryStore  # noqa: E402
from hicache.bootstrap.faults import (  # noqa: E402
    Faults,
    FaultyStore,
    StoreFaultRates,
    directory_corruptor,
)
from hicache.domain.storage import StoreKey  # noqa: E402
from hicache.integrations.sglang import HiCacheBackend  # noqa: E402
from hicache.integrations.sglang.keys import page_key  # noqa: E402
from tests.integrations.sglang.conftest import extra, storage_config  # noqa: E402
from tests.integrations.sglang.pools import fill_page, keys, mha_pool, tokens  # noqa: E402
from tests.storage.fakes import Stalled  # noqa: E402

pytestmark = pytest.mark.sglang


def backend_over(store: Any, tmp_path: Path, pool: Any, **more: Any) -> HiCacheBackend:
    backend = HiCacheBackend(storage_config(extra(None, **more)), {"store": store})
    backend.register_mem_pool_host(pool)
    return backend


def test_a_page_damaged_on_disk_is_a_miss_and_is_removed(make_backend: Any, tmp_path: Path) -> None:
    pool = mha_pool("page_first")
    backend = make_backend(pool, store_path=tmp_path / "d")
    fill_page(pool, 0, 1)
    fill_page(pool, pool.page_size, 2)
    k = keys(2)
    assert backend.batch_set_v1(k, tokens(pool, 0, 2)) == [True, True]
    damaged: StoreKey = backend.pool("kv").tier.store_keys(page_key(k[1]))[0]
    assert directory_corruptor(tmp_path / "d")(damaged)
    assert backend.batch_get_v1(k, tokens(pool, 8, 2)) == [True, False]
    assert backend.batch_exists(k) == 1  # the damaged object was removed by the get
    stats = backend.statistics()["pools"]["kv"]["tier"]
    assert stats["statuses"] == {"corrupt": 1}  # told apart from a plain miss


def test_a_dead_store_fails_backups_misses_queries_and_opens_the_breaker(tmp_path: Path) -> None:
    inner = DirectoryStore(DirectorySettings(root=tmp_path / "d"))
    dead = FaultyStore(inner, Faults(0), StoreFaultRates(transient=1.0))
    pool = mha_pool("page_first")
    backend = backend_over(dead, tmp_path, pool, breaker_threshold=2, breaker_cooldown_s=60)
    try:
        fill_page(pool, 0, 1)
        for _ in range(4):
            assert backend.batch_set_v1(keys(1), tokens(pool, 0, 1)) == [False]
            assert backend.batch_get_v1(keys(1), tokens(pool, 4, 1)) == [False]
        tier = backend.statistics()["pools"]["kv"]["tier"]
        assert tier["breaker"]["state"] == "open"
        assert tier["refused_calls"] >= 4
        assert (
            dead.faults.counts["store_put_transient"] + dead.faults.counts["store_get_transient"]
            == 2
        )
    finally:
        backend.close()


def test_a_stalled_store_never_holds_sglangs_thread_past_deadline_plus_grace(
    tmp_path: Path,
) -> None:
    stalled = Stalled(DirectoryStore(DirectorySettings(root=tmp_path / "d")))
    pool = mha_pool("page_first")
    backend = backend_over(stalled, tmp_path, pool, deadline_s=0.3, grace_s=0.3)
    try:
        fill_page(pool, 0, 1)
        assert backend.batch_set_v1(keys(1), tokens(pool, 0, 1)) == [True]
        start = time.monotonic()
        assert backend.batch_get_v1(keys(1), tokens(pool, 4, 1)) == [False]
        assert time.monotonic() - start < 3.0
        # While the stalled call runs, calls fail at once instead of queueing behind it.
        start = time.monotonic()
        assert backend.batch_exists(keys(1)) == 0
        assert time.monotonic() - start < 0.5
        assert backend.statistics()["timed_out_calls"] == 1
        assert backend.statistics()["refused_while_stuck"] >= 1
        stalled.release.set()
        deadline = time.monotonic() + 10
        while backend._stuck and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.batch_exists(keys(1)) == 1
    finally:
        stalled.release.set()
        backend.close()


def test_hicaches_slow_fault_turns_into_misses_by_the_deadline(tmp_path: Path) -> None:
    inner = DirectoryStore(DirectorySettings(root=tmp_path / "d"))
    pool = mha_pool("page_first")
    fill_page(pool, 0, 1)
    plain = backend_over(inner, tmp_path, pool)
    assert plain.batch_set_v1(keys(1), tokens(pool, 0, 1)) == [True]
    slow = FaultyStore(inner, Faults(1), StoreFaultRates(slow=1.0, slow_s=0.05))
    backend = backend_over(slow, tmp_path, pool, deadline_s=0.2, grace_s=1.0)
    try:
        start = time.monotonic()
        assert backend.batch_get_v1(keys(1), tokens(pool, 4, 1)) == [False]
        assert time.monotonic() - start < 1.2
        assert slow.faults.counts["store_get_slow"] == 1
    finally:
        backend.close()
        plain.close()


def test_get_stats_is_sglangs_storage_metrics_with_hicaches_statistics(make_backend: Any) -> None:
    pool = mha_pool("page_first")
    backend = make_backend(pool)
    fill_page(pool, 0, 1)
    backend.batch_set_v1(keys(1), tokens(pool, 0, 1))
    backend.batch_get_v1(keys(1), tokens(pool, 4, 1))
    metrics = backend.get_stats()
    assert isinstance(metrics, StorageMetrics)
    assert metrics.backup_pgs == [1]
    assert metrics.prefetch_pgs == [1]
    assert metrics.backup_bandwidth[0] > 0
    assert metrics.hicache["pools"]["kv"]["tier"]["pages_read_ok"] == 1
    assert backend.get_stats().backup_pgs == []  # drained per interval, as SGLang logs them


def test_close_returns_within_deadline_plus_grace_while_a_store_call_hangs(
    tmp_path: Path,
) -> None:
    inner = DirectoryStore(DirectorySettings(root=tmp_path / "d"))
    stalled = Stalled(inner)
    pool = mha_pool("page_first")
    backend = backend_over(stalled, tmp_path, pool, deadline_s=0.3, grace_s=0.3)
    try:
        fill_page(pool, 0, 1)
        assert backend.batch_set_v1(keys(1), tokens(pool, 0, 1)) == [True]
        assert backend.batch_get_v1(keys(1), tokens(pool, 4, 1)) == [False]  # hangs, then misses
        start = time.monotonic()
        backend.close()  # anyio's portal exit would wait for the hung call (up to 30 s here)
        assert time.monotonic() - start < 0.6 + 0.5
        assert backend.batch_exists(keys(1)) == 0  # closed: a miss
    finally:
        stalled.release.set()
