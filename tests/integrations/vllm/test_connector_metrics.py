"""The connector's statistics through vLLM's own objects (KVConnectorStats, Prometheus)."""

from __future__ import annotations

import functools

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from hicache.integrations.vllm.connector import HiCacheConnector, HiCacheStats  # noqa: E402

pytestmark = pytest.mark.vllm


def test_stats_from_ranks_add_up_and_reduce_to_the_nonzero_counts() -> None:
    a = HiCacheConnector.build_kv_connector_stats({"load_bytes": 10, "hit_tokens_host": 32})
    b = HiCacheConnector.build_kv_connector_stats({"load_bytes": 5})
    assert isinstance(a, HiCacheStats)
    assert b is not None
    total = a.aggregate(b)
    assert total.reduce() == {"load_bytes": 15, "hit_tokens_host": 32}
    assert not total.is_empty()
    total.reset()
    assert total.is_empty()


def test_prometheus_counters_count_what_the_workers_reported() -> None:
    registry = CollectorRegistry()
    types = {
        Counter: functools.partial(Counter, registry=registry),
        Gauge: functools.partial(Gauge, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    config = type("Config", (), {"kv_transfer_config": None})()
    prom = HiCacheConnector.build_prom_metrics(config, types, ["engine"], {0: ["0"]})  # type: ignore[arg-type]
    assert prom is not None
    prom.observe({"hit_tokens_storage": 64, "load_errors": 2, "read_bytes": 0}, engine_idx=0)
    prom.observe({"hit_tokens_storage": 32}, engine_idx=0)
    get = registry.get_sample_value
    assert get("vllm:hicache_hit_tokens_storage_total", {"engine": "0"}) == 96
    assert get("vllm:hicache_load_errors_total", {"engine": "0"}) == 2
    assert get("vllm:hicache_read_bytes_total", {"engine": "0"}) == 0
