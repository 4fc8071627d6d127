"""A Prometheus scrape of a real cache (device, host, directory store) shows its statistics.

The cache runs a miss, a host hit and a storage hit; the test tallies what each match served
(from the matches themselves) and checks the scrape, parsed with prometheus_client's own
parser, against that tally and against ``statistics()``: through a registry of the framework's
own and through the HTTP endpoint on an ephemeral loopback port.
"""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, generate_latest

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.bootstrap import load_model_spec
from hicache.bootstrap.cache import open_cache
from hicache.cache.values import CacheSettings
from hicache.domain import ConfigError, PlanSettings, PoolName, Tier, WriteSettings, plan_stack
from hicache.metrics import HiCacheMetrics, IntegrationCounters
from hicache.metrics.prometheus import exposition, register, serve
from tests.metrics.scrape import Samples, samples, value

KV = PoolName.KV
PAGE = 16
TIERS = ("device", "host", "storage")


def total(scrape: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples that carry ``labels`` (whatever their other labels)."""
    want = set(labels.items())
    return sum(v for (n, labs), v in scrape.items() if n == name and want <= set(labs))


async def _run_hits(root: str, metrics: HiCacheMetrics, registry: CollectorRegistry) -> Any:
    """A miss, a host hit, a storage hit (prefetch, then the host hit it made); returns the
    tally of what the matches served, the statistics, and a scrape taken while the cache is
    open."""
    plan = plan_stack(
        load_model_spec("llama-3.1-8b-instruct"),
        PlanSettings(tp_size=8, device_tokens=1024, page_size=PAGE),
    )
    settings = CacheSettings(writes=WriteSettings(host="write_through", storage="write_through"))
    store = DirectoryStore(DirectorySettings(root=root))
    served = dict.fromkeys(TIERS, 0)
    async with open_cache(plan, store=store, settings=settings) as rt:
        cache, slots = rt.cache, rt.runtime.device_slots
        metrics.add_cache(cache, name="rank0")
        prompt = list(range(100, 100 + 8 * PAGE + 5))

        async def match() -> Any:
            m = await cache.match(prompt)
            served["device"] += m.device_tokens
            served["host"] += m.host_tokens - m.device_tokens
            served["storage"] += m.storage_tokens - m.host_tokens
            return m

        async with await match():  # a miss: prefill and insert
            pages = slots.allocate({KV: 9}).pages[KV]
            await cache.insert(prompt, {KV: pages})
        await cache.wait_idle()
        await cache.evict(Tier.DEVICE, 8)
        rt.runtime.engine.free_device({KV: pages[8:]})
        async with await match() as m:  # a host hit, loaded layer by layer
            assert m.host_tokens == 8 * PAGE
            dev = slots.allocate(m.load_counts()).pages
            async with await cache.load(m, dev) as load:
                for layer in range(plan.transfer_layers):
                    load.wait_layer(layer)
        await cache.wait_idle()
        await cache.evict(Tier.DEVICE, 8)
        await cache.evict(Tier.HOST, 8)
        async with await match() as m:  # the store has it: prefetch it back to host
            assert m.storage_tokens == 8 * PAGE
            await cache.prefetch(m)
        async with await match() as m:
            assert m.host_tokens == 8 * PAGE
        await cache.wait_idle()
        open_scrape = generate_latest(registry).decode()
        return served, cache.statistics(), cache.engine.statistics(), cache, open_scrape


@pytest.fixture
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("framework_requests", "the framework's own metric", registry=reg).inc(3)
    return reg


def test_a_scrape_in_the_frameworks_registry_shows_every_tiers_hits_and_misses(
    tmp_path: Path, registry: CollectorRegistry
) -> None:
    metrics = HiCacheMetrics()
    register(metrics, registry)
    served, stats, engine, cache, text = anyio.run(_run_hits, str(tmp_path), metrics, registry)
    scrape = samples(text)
    assert value(scrape, "framework_requests_total") == 3  # the framework's metric is kept
    # The tally of the matches: host 128 (the host hit) + 128 (after the prefetch), storage 128.
    assert served == {"device": 0, "host": 2 * 8 * PAGE, "storage": 8 * PAGE}
    for tier in TIERS:
        got = value(scrape, "hicache_hit_tokens_total", cache="rank0", tier=tier)
        assert got == served[tier] == stats.hit_tokens.of(Tier[tier.upper()])
        assert value(scrape, "hicache_hit_pages_total", cache="rank0", tier=tier) == (
            served[tier] // PAGE
        )
        assert value(scrape, "hicache_miss_tokens_total", cache="rank0", tier=tier) == (
            getattr(stats.miss_tokens, tier)
        )
    asked = 4 * (8 * PAGE + 5)
    assert value(scrape, "hicache_matched_tokens_total", cache="rank0") == asked
    # what no tier held: the first request (8 pages + 5 tokens) and every match's 5-token tail
    assert value(scrape, "hicache_miss_tokens_total", cache="rank0", tier="storage") == (
        asked - sum(served.values())
    )
    # bytes per pool (this plan has one pool, kv), summing to the face's totals
    for name, want in (
        ("loaded", stats.bytes_loaded),
        ("backed_up", stats.bytes_backed_up),
        ("prefetched", stats.bytes_prefetched),
        ("stored", stats.bytes_stored),
    ):
        got = value(scrape, f"hicache_{name}_bytes_total", cache="rank0", pool="kv")
        assert got == total(scrape, f"hicache_{name}_bytes_total", cache="rank0") == want > 0
    for tier in ("device", "host"):
        assert (
            value(scrape, "hicache_evicted_pages_total", cache="rank0", tier=tier)
            == (getattr(stats.evictions, tier))
            > 0
        )
    # histograms: one successful load; every wait on it (one per transfer layer, and the
    # load's own waits at its end), summing to the exposed time
    assert value(scrape, "hicache_load_seconds_count", cache="rank0") == engine.loads == 1
    assert value(scrape, "hicache_load_seconds_bucket", cache="rank0", le="+Inf") == 1
    waits = value(scrape, "hicache_layer_wait_seconds_count", cache="rank0")
    assert waits == engine.layer_waits >= cache.plan.transfer_layers
    assert value(scrape, "hicache_layer_wait_seconds_sum", cache="rank0") == pytest.approx(
        engine.exposed_wait_s
    )
    # occupancy and the breaker, per pool and store
    host = cache.engine.host_slots.allocator(KV)
    assert value(scrape, "hicache_slots_used", cache="rank0", tier="host", pool="kv") == (
        host.used_count()
    )
    assert value(scrape, "hicache_slots", cache="rank0", tier="host", pool="kv") == host.pages
    assert value(scrape, "hicache_pages", cache="rank0", tier="storage") == 8
    store = {"cache": "rank0", "pool": "kv", "store": "directory"}
    assert value(scrape, "hicache_breaker_state", **store, state="closed") == 1
    assert value(scrape, "hicache_breaker_state", **store, state="open") == 0
    assert (
        value(scrape, "hicache_store_pages_total", **store, operation="write", outcome="ok")
        == stats.storage.pages_written_ok
    )  # type: ignore[union-attr]


def test_the_http_endpoint_on_an_ephemeral_loopback_port_serves_the_same_figures(
    tmp_path: Path, registry: CollectorRegistry
) -> None:
    metrics = HiCacheMetrics()
    served, stats, *_ = anyio.run(_run_hits, str(tmp_path), metrics, registry)
    with serve(metrics, 0) as server:
        assert server.addr == "127.0.0.1"
        assert server.port > 0
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            assert resp.status == 200
            text = resp.read().decode()
    scrape = samples(text)
    for tier in TIERS:
        assert value(scrape, "hicache_hit_tokens_total", cache="rank0", tier=tier) == served[tier]
    assert value(scrape, "hicache_matches_total", cache="rank0") == stats.matches == 4
    with pytest.raises(OSError):  # closed: nothing listens there any more
        urllib.request.urlopen(server.url, timeout=2)


def test_serve_refuses_a_bad_port_and_a_port_already_taken() -> None:
    metrics = HiCacheMetrics()
    with pytest.raises(ConfigError, match=r"port must be an integer in 0\.\.65535 .* got 70000"):
        serve(metrics, 70000)
    with (
        serve(metrics, 0) as first,
        pytest.raises(ConfigError, match=f"127\\.0\\.0\\.1:{first.port}"),
    ):
        serve(metrics, first.port)


@pytest.mark.parametrize("holder", ["127.0.0.1", "0.0.0.0"])
def test_a_port_another_program_listens_on_is_an_error_naming_it_never_another_port(
    holder: str,
) -> None:
    with socket.socket() as other:
        other.bind((holder, 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(ConfigError, match=f":{port} .*pick another port"):
            serve(HiCacheMetrics(), port)


def test_two_caches_in_one_registry_are_told_apart_by_their_name_and_a_name_is_used_once(
    tmp_path: Path,
) -> None:
    async def two() -> str:
        plan = plan_stack(
            load_model_spec("llama-3.1-8b-instruct"),
            PlanSettings(tp_size=8, device_tokens=256, page_size=PAGE),
        )
        metrics = HiCacheMetrics()
        async with open_cache(plan) as a, open_cache(plan) as b:
            metrics.add_cache(a.cache, name="rank0")
            metrics.add_cache(b.cache, name="rank1")
            with pytest.raises(ConfigError, match="name 'rank1' is taken"):
                metrics.add_cache(b.cache, name="rank1")
            with pytest.raises(ConfigError, match="cache must be a HiCache or SyncCache, got str"):
                metrics.add_cache("rank2", name="rank2")  # type: ignore[arg-type]
            async with await a.cache.match(list(range(3 * PAGE))):
                pass
            return exposition(metrics)

    scrape = samples(anyio.run(two))
    assert value(scrape, "hicache_matches_total", cache="rank0") == 1
    assert value(scrape, "hicache_matches_total", cache="rank1") == 0
    assert value(scrape, "hicache_miss_pages_total", cache="rank0", tier="device") == 3
    # no store: no storage-tier metrics, and the breaker is not reported
    tiers = ("hicache_store_pages", "hicache_store_calls", "hicache_breaker_state")
    assert not [k for k in scrape if k[0].startswith(tiers)]


def test_the_collector_reads_at_scrape_time_without_counting_twice(tmp_path: Path) -> None:
    """Two scrapes of an idle cache are identical (a collector, not counters incremented)."""
    metrics = HiCacheMetrics()
    registry = CollectorRegistry()
    register(metrics, registry)
    anyio.run(_run_hits, str(tmp_path), metrics, registry)
    first = samples(generate_latest(registry).decode())
    second = samples(generate_latest(registry).decode())
    assert first == second
    assert torch is not None  # the cache ran on torch tensors (adapters), the metrics never did


def test_a_synchronous_face_is_scraped_over_http_while_it_serves() -> None:
    from hicache.cache.sync import open_sync_cache
    from hicache.engine import open_sync

    plan = plan_stack(
        load_model_spec("llama-3.1-8b-instruct"),
        PlanSettings(tp_size=8, device_tokens=1024, page_size=PAGE),
    )
    rt = open_cache(plan)  # not entered: the sync face runs it
    metrics = HiCacheMetrics()
    prompt = list(range(4 * PAGE + 1))
    with open_sync(rt.engine) as sync, open_sync_cache(sync, rt.cache) as cache:
        metrics.add_cache(cache, name="sync")
        pages = rt.runtime.device_slots.allocate({KV: 4}).pages[KV]
        cache.insert(prompt, {KV: pages})
        cache.call(rt.cache.wait_idle)
        cache.evict(Tier.DEVICE, 4)
        match = cache.match(prompt)
        with serve(metrics, 0) as server, urllib.request.urlopen(server.url, timeout=10) as r:
            scrape = samples(r.read().decode())
        cache.release(match)
    rt.close()
    assert match.host_pages == 4
    assert value(scrape, "hicache_hit_tokens_total", cache="sync", tier="host") == 4 * PAGE
    assert value(scrape, "hicache_pinned_pages", cache="sync", tier="host") == 4  # held by it


def test_registering_twice_is_refused_and_serving_a_registry_that_holds_them_adds_nothing(
    registry: CollectorRegistry,
) -> None:
    metrics = HiCacheMetrics()
    vllm = IntegrationCounters("vllm")
    vllm.count_lookup(tokens=8, hit_tokens={})
    metrics.add_source(vllm)
    register(metrics, registry)
    with pytest.raises(ConfigError, match="already in this registry"):
        register(metrics, registry)
    # the framework's registry served from one port: its metric and hicache's, each once
    with (
        serve(metrics, 0, registry=registry) as server,
        urllib.request.urlopen(server.url, timeout=10) as r,
    ):
        text = r.read().decode()
    assert text.count('hicache_integration_lookups_total{source="vllm"} 1.0') == 1
    assert "framework_requests_total 3.0" in text
    auto = CollectorRegistry(auto_describe=True)  # as prometheus_client's global REGISTRY
    first, second = HiCacheMetrics(), HiCacheMetrics()
    first.add_source(IntegrationCounters("a"))
    second.add_source(IntegrationCounters("b"))
    register(first, auto)
    with pytest.raises(ConfigError, match="put every cache in one HiCacheMetrics"):
        register(second, auto)
    with pytest.raises(ConfigError, match="registry must be a CollectorRegistry, got dict"):
        register(metrics, {})  # type: ignore[arg-type]
