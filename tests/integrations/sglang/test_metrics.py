"""hicache's metrics of the SGLang backend: what its calls returned is what a scrape counts.

The backend is built by SGLang's own factory over SGLang's real host pools; the scrape is
hicache.metrics.prometheus.exposition (and a served port), parsed with prometheus_client's
parser, so a family missing or miscounted fails here.
"""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()
pytest.importorskip("prometheus_client")

from prometheus_client import REGISTRY, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer  # noqa: E402

from hicache.domain.errors import ConfigError  # noqa: E402
from hicache.metrics import HiCacheMetrics  # noqa: E402
from hicache.metrics.prometheus import exposition  # noqa: E402
from tests.integrations.sglang.pools import (  # noqa: E402
    fill_page,
    keys,
    mamba_pool,
    mha_pool,
    tokens,
)

pytestmark = pytest.mark.sglang


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(scrape: dict[Any, float], name: str, **labels: str) -> float:
    return scrape[(name, frozenset(labels.items()))]


def test_hits_loads_and_saves_counted_equal_what_the_calls_returned(make_backend: Any) -> None:
    pool = mha_pool("page_first")
    backend = make_backend(pool)
    assert isinstance(backend.metrics, HiCacheMetrics)
    ps = pool.page_size
    page_bytes = backend.pool("kv").pages.flat_nbytes
    for i in range(3):
        fill_page(pool, i * ps, i)
    k = keys(5)
    saved = backend.batch_set_v1(k[:3], tokens(pool, 0, 3))
    found = backend.batch_exists(k)  # 5 asked, 3 there
    loaded = backend.batch_get_v1(k, tokens(pool, 10, 5))
    flat = [pool.get_dummy_flat_data_page() for _ in range(2)]
    legacy = backend.batch_get(k[3:5], flat)  # two misses
    assert (sum(saved), found, sum(loaded), legacy) == (3, 3, 3, [None, None])

    scrape = samples(exposition(backend.metrics))
    src = {"source": "sglang"}
    assert value(scrape, "hicache_integration_lookups_total", **src) == 1
    assert value(scrape, "hicache_integration_lookup_tokens_total", **src) == 5 * ps
    assert (
        value(scrape, "hicache_integration_hit_tokens_total", tier="storage", **src) == found * ps
    )
    assert value(scrape, "hicache_integration_miss_tokens_total", tier="storage", **src) == 2 * ps
    assert value(scrape, "hicache_integration_saved_pages_total", **src) == sum(saved)
    assert value(scrape, "hicache_integration_saved_bytes_total", **src) == 3 * page_bytes
    assert value(scrape, "hicache_integration_saves_total", outcome="ok", **src) == 1
    assert value(scrape, "hicache_integration_loaded_pages_total", **src) == sum(loaded)
    assert value(scrape, "hicache_integration_loaded_bytes_total", **src) == 3 * page_bytes
    assert value(scrape, "hicache_integration_loads_total", outcome="ok", **src) == 2
    assert value(scrape, "hicache_integration_load_seconds_count", **src) == 2
    # The pool's storage tier, label cache="sglang": its own count of the same pages.
    tier = {"cache": "sglang", "pool": "kv", "store": backend.store.name}
    assert value(scrape, "hicache_store_pages_total", operation="write", outcome="ok", **tier) == 3
    assert value(scrape, "hicache_store_pages_total", operation="read", outcome="ok", **tier) == 3
    assert value(scrape, "hicache_breaker_state", state="closed", **tier) == 1


def test_v2_lookups_count_the_prefix_every_pool_can_restore(make_backend: Any) -> None:
    kv, side = mha_pool("page_first"), mamba_pool("page_first")
    backend = make_backend(kv, {"mamba": side})
    k = keys(4)
    backend.batch_set_v2([PoolTransfer(name="kv", keys=k, host_indices=tokens(kv, 0, 4))])
    backend.batch_set_v2([PoolTransfer(name="mamba", keys=k[:2], host_indices=tokens(side, 0, 2))])
    result = backend.batch_exists_v2(
        k, [PoolTransfer(name="mamba", keys=k, hit_policy=PoolHitPolicy.ALL_PAGES)]
    )
    assert result.kv_hit_pages == 2
    scrape = samples(exposition(backend.metrics))
    ps = kv.page_size
    assert (
        value(scrape, "hicache_integration_hit_tokens_total", tier="storage", source="sglang")
        == 2 * ps
    )
    assert value(scrape, "hicache_integration_saved_pages_total", source="sglang") == 6
    assert (
        value(
            scrape,
            "hicache_store_pages_total",
            cache="sglang",
            pool="mamba",
            store=backend.store.name,
            operation="write",
            outcome="ok",
        )
        == 2
    )


def test_bad_v2_host_indices_are_counted_as_an_error(make_backend: Any) -> None:
    kv, side = mha_pool("page_first"), mamba_pool("page_first")
    backend = make_backend(kv, {"mamba": side})
    k = keys(2)
    backend.batch_set_v2([PoolTransfer(name="mamba", keys=k, host_indices=tokens(side, 0, 1))])
    stats = backend.counters.statistics()
    assert stats.errors == {("set", "bad_host_indices"): 1}


def test_calls_after_close_are_counted_as_errors_not_saves(make_backend: Any) -> None:
    pool = mha_pool("page_first")
    backend = make_backend(pool)
    backend.close()
    assert backend.batch_set_v1(keys(2), tokens(pool, 0, 2)) == [False, False]
    stats = backend.counters.statistics()
    assert stats.errors == {("set", "closed"): 1}
    assert (stats.saved_pages, stats.saves["failed"]) == (0, 1)


def test_metrics_port_serves_the_backends_scrape(make_backend: Any) -> None:
    pool = mha_pool("page_first")
    backend = make_backend(pool, config={"metrics_port": 0})
    backend.batch_exists(keys(3))
    with urllib.request.urlopen(backend._exports.server.url, timeout=10) as r:
        scrape = samples(r.read().decode())
    assert value(scrape, "hicache_integration_lookups_total", source="sglang") == 1
    backend.close()
    assert backend._exports.server is None


def test_metrics_true_registers_in_the_global_registry_until_close(make_backend: Any) -> None:
    pool = mha_pool("page_first")
    backend = make_backend(pool, config={"metrics": True})
    backend.batch_exists(keys(2))
    text = generate_latest(REGISTRY).decode()
    assert value(samples(text), "hicache_integration_lookups_total", source="sglang") == 1
    backend.close()
    after = samples(generate_latest(REGISTRY).decode())
    assert ("hicache_integration_lookups_total", frozenset({("source", "sglang")})) not in after


@pytest.mark.parametrize(
    ("key", "bad"), [("metrics", "yes"), ("metrics_port", 70000), ("metrics_port", True)]
)
def test_a_bad_metrics_key_fails_the_start_naming_the_key(
    make_backend: Any, key: str, bad: object
) -> None:
    with pytest.raises(ConfigError, match=key):
        make_backend(mha_pool("page_first"), config={key: bad})
