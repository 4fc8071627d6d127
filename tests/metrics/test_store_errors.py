"""Store errors by status and the breaker's state reach the scrape, labelled by pool and store."""

from __future__ import annotations

from pathlib import Path

import anyio

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.bootstrap import load_model_spec
from hicache.bootstrap.cache import open_cache
from hicache.bootstrap.faults import Faults, FaultyStore, StoreFaultRates
from hicache.cache.values import CacheSettings
from hicache.domain import PlanSettings, PoolName, WriteSettings, plan_stack
from hicache.engine.storage_settings import StorageTierSettings
from hicache.metrics import HiCacheMetrics
from hicache.metrics.prometheus import exposition
from tests.metrics.scrape import samples, value

KV = PoolName.KV
PAGE = 16


def test_a_store_answering_fatal_shows_its_errors_by_status_and_an_open_breaker(
    tmp_path: Path,
) -> None:
    async def run() -> tuple[str, object]:
        plan = plan_stack(
            load_model_spec("llama-3.1-8b-instruct"),
            PlanSettings(tp_size=8, device_tokens=1024, page_size=PAGE),
        )
        settings = CacheSettings(
            writes=WriteSettings(host="write_through", storage="write_through"),
            storage=StorageTierSettings(breaker_threshold=2, breaker_cooldown_s=60.0),
        )
        inner = DirectoryStore(DirectorySettings(root=str(tmp_path)))
        store = FaultyStore(inner, Faults(seed=1), StoreFaultRates(fatal=1.0))
        metrics = HiCacheMetrics()
        async with open_cache(plan, store=store, settings=settings) as rt:
            metrics.add_cache(rt.cache, name="r0")
            for i in range(3):  # three prompts, each written through to the failing store
                prompt = list(range(1000 * i, 1000 * i + 2 * PAGE))
                pages = rt.runtime.device_slots.allocate({KV: 2}).pages[KV]
                await rt.cache.insert(prompt, {KV: pages})
                await rt.cache.wait_idle()
            return exposition(metrics), rt.cache.statistics().storage

    text, st = anyio.run(run)
    scrape = samples(text)
    lab = {"cache": "r0", "pool": "kv", "store": "faulty-directory"}  # FaultyStore's name
    errors = value(scrape, "hicache_store_errors_total", **lab, status="fatal")
    assert errors == st.statuses["fatal"] > 0  # type: ignore[attr-defined]
    assert value(scrape, "hicache_breaker_state", **lab, state="open") == 1
    assert value(scrape, "hicache_breaker_state", **lab, state="closed") == 0
    refused = value(scrape, "hicache_store_refused_calls_total", **lab)
    assert refused == st.refused_calls > 0  # type: ignore[attr-defined]
    assert value(scrape, "hicache_store_pages_total", **lab, operation="write", outcome="ok") == 0
