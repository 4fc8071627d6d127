"""The connector's KV events under vLLM's real Scheduler (tests/integrations/vllm/sched_harness.py,
no model): what vLLM publishes for the host tier (CPU) and the store (STORAGE) matches what each
tier holds after saves, evictions, a reset and a restart, with the hashes vLLM's GPU tier
publishes for the same blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from vllm.distributed.kv_events import (  # noqa: E402
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
)

from hicache.domain.keys import chain_keys  # noqa: E402
from hicache.integrations.vllm.connector import HiCacheConnector  # noqa: E402
from hicache.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from tests.integrations.vllm.kv_events_support import Consumer  # noqa: E402
from tests.integrations.vllm.sched_harness import BLOCK, Harness  # noqa: E402
from tests.integrations.vllm.sched_helpers import prompts  # noqa: E402

pytestmark = pytest.mark.vllm


def side_of(h: Harness) -> SchedulerSide:
    connector = h.scheduler.connector
    assert isinstance(connector, HiCacheConnector)
    return connector.scheduler_role.side


def tiers(h: Harness, consumer: Consumer) -> tuple[set[Any], set[Any]]:
    """The GPU tier's hashes of the blocks the host tier and the store hold now."""
    side = side_of(h)
    keys = list(consumer.key_hash)
    assert side.store is not None
    in_store = side.store.exists_each(keys).value
    host = {consumer.key_hash[k] for k in keys if side.index.lookup(k) is not None}
    store = {consumer.key_hash[k] for k, ok in zip(keys, in_store, strict=True) if ok}
    return host, store


def test_cpu_and_storage_events_match_the_tiers_with_the_gpu_tiers_hashes(
    tmp_path: Path,
) -> None:
    a, b = prompts(2, 6 * BLOCK + 4, seed=3)
    h = Harness(tmp_path / "h", store="directory", host_pages=8, kv_events=True)
    try:
        consumer = Consumer(BLOCK)
        h.add(a, max_tokens=1)
        h.settle()
        consumer.feed(h.published)
        hashes_a = {consumer.key_hash[k] for k in chain_keys(a, BLOCK)}
        assert len(hashes_a) == 6
        assert consumer.get(MEDIUM_CPU) == hashes_a == consumer.get(MEDIUM_STORAGE)
        assert hashes_a <= consumer.get(MEDIUM_GPU)
        # b's 6 pages evict 4 of a's from the 8 host pages; the store keeps both
        h.add(b, max_tokens=1)
        h.settle()
        consumer = Consumer(BLOCK)
        consumer.feed(h.published)
        host, store = tiers(h, consumer)
        assert len(host) == 8
        assert len(store) == 12
        assert consumer.get(MEDIUM_CPU) == host
        assert consumer.get(MEDIUM_STORAGE) == store
        assert any(isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU for e in h.published)
        # a reset of vLLM's prefix cache and the host tier: the store stays
        assert h.reset_prefix_cache(connector=True)
        h.settle()
        consumer = Consumer(BLOCK)
        consumer.feed(h.published)
        assert consumer.get(MEDIUM_CPU) == set()
        assert consumer.get(MEDIUM_STORAGE) == store
    finally:
        h.close()
    # a restart over the same store: nothing published until a lookup finds a's pages there
    h2 = Harness(tmp_path / "h", store="directory", host_pages=8, kv_events=True)
    try:
        h2.add(a, max_tokens=1)
        h2.settle()
        again = Consumer(BLOCK)
        again.feed(h2.published)
        found = {
            e for e in h2.published if isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE
        }
        assert found, "the lookup published nothing for the store"
        assert again.get(MEDIUM_STORAGE) == hashes_a  # the same hashes as before the restart
        assert again.get(MEDIUM_CPU) == hashes_a  # read back into host memory
    finally:
        h2.close()


def test_without_vllms_kv_events_the_connector_makes_none(tmp_path: Path) -> None:
    h = Harness(tmp_path / "h", host_pages=8)
    try:
        connector = h.scheduler.connector
        assert isinstance(connector, HiCacheConnector)
        assert connector.scheduler_role.events is None
        h.add(prompts(1, 3 * BLOCK + 1)[0], max_tokens=1)
        h.settle()
        assert len(side_of(h).index) == 3  # saved, and nothing recorded for events
        assert list(connector.take_events()) == []
    finally:
        h.close()
