"""An integration's own counters (a vLLM connector, an SGLang backend) reach the same scrape,
labelled by ``source``; bad counts are typed errors naming the argument."""

from __future__ import annotations

import threading

import pytest

from hicache.domain import ConfigError, PerTier, Tier
from hicache.metrics import Family, FamilyBuilder, HiCacheMetrics, IntegrationCounters
from hicache.metrics.prometheus import exposition
from tests.metrics.scrape import samples, value


def test_an_integrations_lookups_loads_saves_and_errors_are_scraped_by_source() -> None:
    vllm = IntegrationCounters("vllm")
    vllm.count_lookup(tokens=300, hit_tokens=PerTier(host=256))
    vllm.count_lookup(tokens=300, hit_tokens={"host": 128, "storage": 128})
    vllm.count_lookup(tokens=100, hit_tokens={Tier.DEVICE: 64})
    vllm.count_load(pages=16, nbytes=4096, seconds=0.003)
    vllm.count_load(pages=8, nbytes=2048, seconds=0.2, ok=False)
    vllm.count_save(pages=4, nbytes=1024, seconds=0.001)
    vllm.count_error(operation="get", status="transient")
    vllm.count_error(operation="get", status="transient")
    sglang = IntegrationCounters("sglang")
    sglang.count_lookup(tokens=64, hit_tokens={})
    metrics = HiCacheMetrics()
    metrics.add_source(vllm)
    metrics.add_source(sglang)
    scrape = samples(exposition(metrics))

    def v(name: str, **labels: str) -> float:
        return value(scrape, f"hicache_integration_{name}", source="vllm", **labels)

    assert v("lookups_total") == 3
    assert v("lookup_tokens_total") == 700
    assert [v("hit_tokens_total", tier=t) for t in ("device", "host", "storage")] == [64, 384, 128]
    # misses cascade: device 700-64, host 636-384, storage (recomputed) 252-128
    assert [v("miss_tokens_total", tier=t) for t in ("device", "host", "storage")] == [
        636,
        252,
        124,
    ]
    assert (v("loads_total", outcome="ok"), v("loads_total", outcome="failed")) == (1, 1)
    assert (v("loaded_pages_total"), v("loaded_bytes_total")) == (24, 6144)
    assert v("load_seconds_count") == 2
    assert v("load_seconds_sum") == pytest.approx(0.203)
    assert v("load_seconds_bucket", le="0.005") == 1  # the 3 ms load; the 200 ms one above
    assert (v("saved_bytes_total"), v("save_seconds_count")) == (1024, 1)
    assert v("errors_total", operation="get", status="transient") == 2
    assert value(scrape, "hicache_integration_lookups_total", source="sglang") == 1
    assert (
        value(scrape, "hicache_integration_miss_tokens_total", source="sglang", tier="storage")
        == 64
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.count_lookup(tokens=-1, hit_tokens={}), "tokens must be a non-negative"),
        (lambda c: c.count_lookup(tokens=10, hit_tokens={"gpu": 5}), r"unknown tiers \['gpu'\]"),
        (lambda c: c.count_lookup(tokens=10, hit_tokens={"host": 16}), "more than tokens=10"),
        (lambda c: c.count_lookup(tokens=10, hit_tokens=(0, 5, 0)), "hit_tokens must be a"),
        (lambda c: c.count_load(pages=1, nbytes=1, seconds=-0.5), "seconds must be a non-neg"),
        (lambda c: c.count_save(pages=True, nbytes=1, seconds=0.1), "pages must be a non-neg"),
        (lambda c: c.count_save(pages=1, nbytes=1, seconds=0.1, ok=1), "ok must be True or"),
        (lambda c: c.count_error(operation="get", status="a b"), "status must be 1-64"),
    ],
)
def test_a_bad_count_is_a_config_error_naming_the_argument(call: object, message: str) -> None:
    counters = IntegrationCounters("vllm")
    with pytest.raises(ConfigError, match=message):
        call(counters)  # type: ignore[operator]
    assert counters.statistics().lookups == 0  # nothing was half-counted


def test_counts_from_many_threads_add_up() -> None:
    c = IntegrationCounters("sglang")

    def work() -> None:
        for _ in range(500):
            c.count_lookup(tokens=16, hit_tokens={"storage": 16})
            c.count_load(pages=1, nbytes=10, seconds=0.001)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = c.statistics()
    assert (s.lookups, s.hit_tokens.storage, s.loaded_bytes) == (2000, 32000, 20000)
    assert s.load_seconds.count == 2000


def test_a_source_of_ones_own_is_merged_and_a_disagreeing_one_refused() -> None:
    class Queue:
        def __init__(self, kind: str) -> None:
            self.kind = kind

        def metric_families(self) -> list[Family]:
            f = FamilyBuilder({"source": "scheduler"})
            f.add("hicache_integration_lookups", self.kind, "lookups", 7)
            return f.build()

    metrics = HiCacheMetrics()
    metrics.add_source(IntegrationCounters("vllm"))
    own = metrics.add_source(Queue("counter"))
    scrape = samples(exposition(metrics))
    assert value(scrape, "hicache_integration_lookups_total", source="scheduler") == 7
    assert value(scrape, "hicache_integration_lookups_total", source="vllm") == 0
    metrics.remove(own)
    metrics.add_source(Queue("gauge"))
    with pytest.raises(ConfigError, match="two sources disagree on its kind"):
        exposition(metrics)
    with pytest.raises(ConfigError, match="source must have metric_families"):
        metrics.add_source(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="source must be 1-64"):
        IntegrationCounters("")
